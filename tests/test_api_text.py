"""Text in, text out: `load(...)` gives an engine that knows its tokenizer and chat template; `generate` takes a
prompt, a conversation or a batch of them and returns the same text as plain greedy decoding, `stream` yields it in
pieces. On a tiny random Llama saved to disk with the tests' chat tokenizer, and a saved Medusa checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data.chat import encode_prompt
from inference import load
from inference.api import attach
from inference.drafters.registry import API, resolve
from inference.engine.loop import GenerationOutput
from models.checkpoint import save_drafter
from models.loading import load_tokenizer
from models.medusa import MedusaConfig, MedusaHeads
from tests.data_support import tiny_tokenizer
from tests.model_support import save_tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPT = "Write a poem about the sea."


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    """A peaked tiny Llama (greedy answers vary instead of repeating one token) and 2 Medusa heads for it."""
    root = tmp_path_factory.mktemp("api_text")
    model_dir = save_tiny_model(root / "model", initializer_range=0.2)
    engine = load(None, base=str(model_dir), dtype="fp32")
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=32, vocab_size=engine.model.vocab_size))
    heads.init_from_base(engine.model.lm_head)
    save_drafter(root / "ckpt", heads, str(model_dir), tokenizer=engine.tokenizer)
    return {"model": model_dir, "ckpt": root / "ckpt"}


@pytest.fixture(scope="module")
def engine(paths):
    return load(paths["ckpt"], dtype="fp32")


def hf_greedy_text(model: torch.nn.Module, tokenizer, ids: list[int], max_new_tokens: int) -> str:
    """Plain Hugging Face greedy decoding of `ids`, decoded as the engine decodes."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_engine_knows_the_checkpoints_tokenizer(engine, paths):
    assert engine.tokenizer is not None
    assert engine.tokenizer.get_vocab() == load_tokenizer(str(paths["model"])).get_vocab()
    assert engine.drafter_config["drafter_type"] == "medusa"


def test_text_prompt_gives_the_text_of_plain_greedy_decoding(engine):
    ids = encode_prompt(engine.tokenizer, [{"role": "user", "content": PROMPT}])
    expected = hf_greedy_text(engine.model, engine.tokenizer, ids, 24)
    assert expected  # the peaked model says something
    text = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert isinstance(text, str) and text == expected


def test_conversation_and_batch(engine):
    conversation = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."},
                    {"role": "user", "content": PROMPT}]
    one = engine.generate(conversation, max_new_tokens=16, ignore_eos=True)
    ids = encode_prompt(engine.tokenizer, conversation)
    assert one == hf_greedy_text(engine.model, engine.tokenizer, ids, 16)
    single = engine.generate(PROMPT, max_new_tokens=16, ignore_eos=True)
    batch = engine.generate([conversation, PROMPT], max_new_tokens=16, ignore_eos=True)  # rows of unequal lengths
    assert batch == [one, single]


def test_raw_prompt_skips_the_chat_template(engine):
    ids = list(engine.tokenizer("Once upon a time")["input_ids"])
    text = engine.generate("Once upon a time", raw=True, max_new_tokens=12, ignore_eos=True)
    assert text == hf_greedy_text(engine.model, engine.tokenizer, ids, 12)


def test_stop_strings_cut_the_text_and_the_ids(engine):
    full = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip()
    out = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True, stop=[stop], return_output=True)
    assert isinstance(out, GenerationOutput)
    assert out.texts == [full[: full.index(stop)]]
    decoded = engine.tokenizer.decode(out.sequences[0], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert stop in decoded and not decoded[: decoded.rindex(stop)].count(stop)  # the ids end at the stop's token


def test_stream_yields_the_text_of_generate(engine):
    full = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    pieces = list(engine.stream(PROMPT, max_new_tokens=24, ignore_eos=True))
    assert len(pieces) > 1 and "".join(pieces) == full


def test_a_hugging_face_streamer_prints_what_it_prints_for_model_generate(engine):
    """transformers' own streamers plug in as they do into model.generate: the same text, chunk by chunk (several
    tokens a chunk when drafts are accepted), the prompt skipped, end() called once."""
    from transformers import TextIteratorStreamer

    class Recorder(TextIteratorStreamer):
        def __init__(self, tokenizer):
            super().__init__(tokenizer, skip_prompt=True, decode_kwargs={"clean_up_tokenization_spaces": False},
                             timeout=5)
            self.puts, self.ends = [], 0

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())
            super().put(value)

        def end(self):
            self.ends += 1
            super().end()

    ids = encode_prompt(engine.tokenizer, [{"role": "user", "content": PROMPT}])
    ours, theirs = Recorder(engine.tokenizer), Recorder(engine.tokenizer)
    full = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True, streamer=ours)
    engine.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, streamer=theirs,
                          pad_token_id=engine.tokenizer.pad_token_id)
    printed = ["".join(recorder) for recorder in (ours, theirs)]  # the iterator's queue, read after the run
    assert printed[0] == printed[1] and printed[0].strip() == full.strip()
    assert ours.puts[0] == ids and ours.ends == 1 and sum(map(len, ours.puts[1:])) == 24
    with pytest.raises(ValueError, match="batch-1"):
        engine.generate([PROMPT, PROMPT], streamer=Recorder(engine.tokenizer))


def test_leaving_a_stream_early_stops_the_loop(engine):
    stream = engine.stream(PROMPT, max_new_tokens=200, ignore_eos=True)
    first = next(stream)
    stream.close()  # joins the worker: the loop ends after its current step instead of decoding 200 tokens
    assert first and engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True).startswith(first)


def test_errors_inside_the_stream_reach_the_caller(engine):
    with pytest.raises(ValueError, match="max_new_tokens"):
        list(engine.stream(PROMPT, max_new_tokens=0))


def test_token_ids_still_give_a_generation_output(engine):
    ids = encode_prompt(engine.tokenizer, [{"role": "user", "content": PROMPT}])
    out = engine.generate(ids, max_new_tokens=8, ignore_eos=True)
    assert isinstance(out, GenerationOutput) and out.texts is None and len(out.sequences[0]) == 8
    text = engine.tokenizer.decode(out.sequences[0], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert text == engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("call, message", [
    (lambda e: e.generate([{"role": "user", "content": "hi"}], raw=True), "raw=True takes a str"),
    (lambda e: e.generate([1, 2, 3], stop=["x"]), "stop strings apply to text"),
    (lambda e: e.generate(PROMPT, stream=lambda row, ids: None), "engine.stream"),
    (lambda e: e.generate(PROMPT, stop=[""]), "non-empty stop strings"),
    (lambda e: next(e.stream([1, 2, 3])), "one text prompt"),
    (lambda e: e.generate("", raw=True), "encodes to no tokens"),
])
def test_bad_text_calls_say_what_is_wrong(engine, call, message):
    with pytest.raises(ValueError, match=message):
        call(engine)


def test_an_engine_without_tokenizer_takes_ids_only(engine, paths):
    bare = attach(resolve(None, str(paths["model"]), API), engine.model)
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.generate(PROMPT)
    assert isinstance(bare.generate([1, 2, 3], max_new_tokens=2), GenerationOutput)


def test_a_tokenizer_without_chat_template_names_the_fix(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    for name in ("chat_template.jinja", "tokenizer_config.json", "tokenizer.json"):
        (model_dir / name).unlink(missing_ok=True)
    tiny_tokenizer(chat_template=None).save_pretrained(model_dir)
    engine = load(None, base=str(model_dir), dtype="fp32")
    with pytest.raises(ValueError, match="chat_template=NAME"):
        engine.generate(PROMPT)
    assert isinstance(engine.generate(PROMPT, raw=True, max_new_tokens=2), str)
    templated = load(None, base=str(model_dir), dtype="fp32", chat_template="vicuna_v1.1")
    assert templated.encode(PROMPT)[-1] != templated.encode(PROMPT, raw=True)[-1]


def test_a_bare_model_folder_serves_token_ids(tmp_path):
    """A base folder with weights and config only (no tokenizer files): `load` still serves it, ids in and out, and
    a text call says what is missing."""
    model_dir = save_tiny_model(tmp_path / "model")
    for name in ("chat_template.jinja", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json"):
        (model_dir / name).unlink(missing_ok=True)
    engine = load(None, base=str(model_dir), dtype="fp32")
    assert engine.tokenizer is None
    assert len(engine.generate([1, 2, 3], max_new_tokens=3, ignore_eos=True).sequences[0]) == 3
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.generate(PROMPT)
