"""Prompt lookup drafting: the n-gram index against a brute-force search, per-row drafts in a batch, and the loop
against plain greedy decoding."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

from inference.drafters.prompt_lookup import NgramIndex, PromptLookupDrafter
from inference.engine.drafter import DecodeState
from inference.engine.loop import DecodeConfig, generate
from tests.test_generate import plain_greedy
from tests.test_lookahead import repetitive_prompts

pytestmark = pytest.mark.usefixtures("single_thread")


def naive_lookup(seq: list[int], length: int, max_n: int, min_n: int) -> list[int]:
    """Reference: scan for the latest earlier occurrence of the longest suffix, then copy with the match's period."""
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        for end in range(len(seq) - 2, n - 2, -1):
            if seq[end - n + 1 : end + 1] == seq[len(seq) - n :]:
                out = list(seq)
                while len(out) < len(seq) + length:
                    out.append(out[len(out) - (len(seq) - 1 - end)])
                return out[end + 1 : end + 1 + length]
    return []


def test_ngram_index_examples_and_brute_force():
    index = NgramIndex(max_n=3)
    index.extend([1, 2, 5, 1, 2, 6, 1, 2])
    assert index.lookup(3) == [6, 1, 2]  # the most recent occurrence of (1, 2), not the first
    assert index.lookup(5) == [6, 1, 2, 6, 1]  # past the end: repeats with period 3
    index.extend([6])
    assert index.lookup(2) == [1, 2]  # (1, 2, 6) now matches with 3 tokens
    loop = NgramIndex(max_n=3)
    loop.extend([4, 7, 7, 7])
    assert loop.lookup(4) == [7, 7, 7, 7]
    strict = NgramIndex(max_n=3, min_n=2)
    strict.extend([1, 2, 3, 1])
    assert strict.lookup(4) == []  # only a 1-token match exists
    rng = random.Random(0)
    for _ in range(200):
        seq = [rng.randrange(5) for _ in range(rng.randint(1, 25))]
        index = NgramIndex(max_n=3, min_n=1)
        cut = rng.randint(0, len(seq))
        index.extend(seq[:cut])  # streamed in two pieces, as prompt then steps
        index.extend(seq[cut:])
        assert index.lookup(6) == naive_lookup(seq, 6, 3, 1), seq


def test_rows_without_a_match_get_fillers_or_a_root_only_tree():
    def state(prompt: list[list[int]], generated: list[list[int]]) -> DecodeState:
        ids = torch.tensor(prompt)
        return DecodeState(cache=DynamicCache(), valid=ids > 0, next_pos=(ids > 0).sum(-1), root=torch.tensor(
            [g[-1] for g in generated]), hidden=None, prompt=ids, generated=generated)

    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=2, num_draft=4)
    draft = drafter.propose(state([[5, 6, 7, 5], [0, 8, 9, 10]], [[6], [11]]))  # row 0 matches (5, 6); row 1 not
    assert draft.tree.choices == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    assert draft.tokens.tolist() == [[6, 7, 5, 6, 7], [11, 11, 11, 11, 11]]
    alone = drafter.propose(state([[0, 8, 9, 10]], [[11]]))
    assert alone.tree.num_nodes == 1 and alone.tokens.tolist() == [[11]]
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_prompt_lookup_greedy_equals_plain_greedy_batched(tiny_lm_factory, arch):
    model = tiny_lm_factory(arch)
    prompts = repetitive_prompts(11, 3)
    references = [plain_greedy(model, p, 24) for p in prompts]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = generate(model, ids, PromptLookupDrafter(), DecodeConfig(max_new_tokens=24), attention_mask=mask)
    assert out.sequences == references
    assert sum(a for step in out.stats.accepted for a in step if a > 0) > 0
    short = PromptLookupDrafter(num_draft=4)
    single = generate(model, torch.tensor([prompts[0]]), short, DecodeConfig(max_new_tokens=24))
    assert single.sequences[0] == references[0]


def test_api_and_cli_spec(tmp_path, tiny_lm_factory):
    from inference.api import load
    from inference.drafters.registry import build_from_spec
    from inference.session import drafter_spec

    model = tiny_lm_factory("llama")
    base = tmp_path / "base"
    model.save_pretrained(base)
    engine = load("prompt_lookup", base=str(base), dtype="fp32")
    prompts = repetitive_prompts(12, 2)
    out = engine.generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert out.sequences == [plain_greedy(model, p, 12) for p in prompts]
    assert engine.drafter_config == {"drafter_type": "prompt_lookup"}
    cli_drafter = build_from_spec(drafter_spec("prompt_lookup", ["num_draft=4", "max_ngram=2"]))
    assert (cli_drafter.num_draft, cli_drafter.max_ngram) == (4, 2)
    with pytest.raises(ValueError, match="prompt_lookup: unknown option 'gamma'"):
        build_from_spec("prompt_lookup:gamma=4")


def test_api_load_takes_model_names_as_the_command_line_does(monkeypatch):
    """`load(..., base="tiny")` loads the built-in `builtin:tiny` (conf/model/tiny.yaml's path), as `--base tiny`
    does, instead of asking the hub for a repository named "tiny"; paths and hub ids pass through unchanged."""
    import inference.api as api

    asked = []

    def fake_load_target(name, **kwargs):
        asked.append(name)
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(api, "load_target", fake_load_target)
    monkeypatch.setattr(api, "load_text_side", lambda *a, **k: (None, None))  # the tokenizer loads first
    for base in ("tiny", "builtin:tiny", "org/some-model", "./a/local/dir"):
        with pytest.raises(RuntimeError, match="stop before loading"):
            api.load("prompt_lookup", base=base)
    assert [str(ref) for ref in asked] == ["builtin:tiny", "builtin:tiny", "org/some-model", "./a/local/dir"]
