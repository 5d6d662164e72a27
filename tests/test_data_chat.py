"""Chat encoding: assistant-only labels across templates, shipped templates vs their reference formats."""

import pytest

from data.chat import IGNORE_INDEX, encode_chat, encode_prompt, encode_text
from data.templates import TEMPLATES, VICUNA_SYSTEM, ChatTemplateError
from tests.data_support import tiny_tokenizer

CHAT = [
    {"role": "user", "content": "Who are you?"},
    {"role": "assistant", "content": "I am a helpful assistant."},
    {"role": "user", "content": " Have a nice day! "},
    {"role": "assistant", "content": " You too! "},
]
WITH_SYSTEM = [{"role": "system", "content": "Be nice."}, *CHAT]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def sp_tok():
    return tiny_tokenizer(metaspace=True)


def _labelled_runs(tok, encoded):
    """Decoded text of each maximal run of trained tokens."""
    runs, current = [], []
    for token, label in zip(encoded.input_ids, encoded.labels):
        assert label in (IGNORE_INDEX, token)
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    runs = runs + [current] if current else runs
    return [tok.decode(r) for r in runs]


def _assistant(messages):
    return [m["content"] for m in messages if m["role"] == "assistant"]


# A ChatML template (Qwen/Hermes style), passed as a literal Jinja string.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Expected trained text of one assistant turn: content + end-of-turn, as each template writes it.
TURN_TEXT = {
    None: lambda c: c + "<|end|>",
    "vicuna_v1.1": lambda c: " " + c + "</s>",
    "llama-2-chat": lambda c: " " + c.strip() + " </s>",
    CHATML: lambda c: c + "<|im_end|>",
}
TEMPLATE_IDS = ["own", "vicuna", "llama2", "chatml"]


@pytest.mark.parametrize("template", list(TURN_TEXT), ids=TEMPLATE_IDS)
@pytest.mark.parametrize("messages", [CHAT, WITH_SYSTEM], ids=["plain", "system"])
def test_only_assistant_turns_are_trained(tok, template, messages):
    encoded = encode_chat(tok, messages, max_length=512, chat_template=template)
    assert _labelled_runs(tok, encoded) == [TURN_TEXT[template](c) for c in _assistant(messages)]
    jinja = TEMPLATES.get(template, template)
    reference = tok.apply_chat_template(messages, chat_template=jinja, tokenize=True, return_dict=False)
    assert encoded.input_ids == reference


@pytest.mark.parametrize("template", list(TURN_TEXT), ids=TEMPLATE_IDS)
def test_sentencepiece_style_tokens_at_turn_seams(sp_tok, template):
    # "▁"-prefixed pieces merge the space after "ASSISTANT:" / "[/INST]" into the first content token.
    encoded = encode_chat(sp_tok, WITH_SYSTEM, max_length=512, chat_template=template)
    runs = _labelled_runs(sp_tok, encoded)  # the decoder drops a run's leading "▁"
    assert [r.lstrip() for r in runs] == [TURN_TEXT[template](c).lstrip() for c in _assistant(WITH_SYSTEM)]
    assert "<unk>" not in sp_tok.decode(encoded.input_ids)


@pytest.mark.parametrize("template", list(TURN_TEXT), ids=TEMPLATE_IDS)
def test_prompt_is_the_untrained_prefix_of_the_chat(tok, template):
    single = CHAT[:2]
    encoded = encode_chat(tok, single, max_length=512, chat_template=template)
    prompt = encode_prompt(tok, single, chat_template=template)  # the trailing assistant turn is dropped
    assert encoded.input_ids[: len(prompt)] == prompt
    assert set(encoded.labels[: len(prompt)]) == {IGNORE_INDEX}
    assert encoded.labels[len(prompt)] != IGNORE_INDEX


def test_truncation_keeps_the_head(tok):
    full = encode_chat(tok, CHAT, max_length=512)
    cut = encode_chat(tok, CHAT, max_length=7)
    assert cut.input_ids == full.input_ids[:7] and cut.labels == full.labels[:7]
    with pytest.raises(ValueError, match="max_length"):
        encode_chat(tok, CHAT, max_length=0)


class _NoOffsets:
    """The tiny tokenizer seen as a tokenizer without offset mapping (slow-tokenizer code path)."""

    is_fast = False

    def __init__(self, tok):
        self._tok, self.chat_template = tok, tok.chat_template

    def __call__(self, text, add_special_tokens):
        return {"input_ids": self._tok(text, add_special_tokens=add_special_tokens)["input_ids"]}

    def apply_chat_template(self, *args, **kwargs):
        return self._tok.apply_chat_template(*args, **kwargs)


@pytest.mark.parametrize("template", list(TURN_TEXT), ids=TEMPLATE_IDS)
@pytest.mark.parametrize("metaspace", [False, True])
def test_prefix_count_path_equals_offset_path(template, metaspace):
    tok = tiny_tokenizer(metaspace=metaspace)
    for max_length in (512, 20):
        fast = encode_chat(tok, WITH_SYSTEM, max_length, template)
        assert encode_chat(_NoOffsets(tok), WITH_SYSTEM, max_length, template) == fast


def test_template_rewriting_past_turns_falls_back_to_content_search(tok):
    # Past assistant turns end in "</s>", the last one in "<|end|>": prefix renders are not prefixes of the full one.
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
        "{% if m['role'] == 'assistant' and not loop.last %}</s>{% else %}<|end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    encoded = encode_chat(tok, CHAT, 512, chat_template=template)
    assert _labelled_runs(tok, encoded) == ["I am a helpful assistant.</s>", " You too! <|end|>"]
    upper_past = template.replace("{{ m['content'] }}", "{{ m['content'] if loop.last else m['content'] | upper }}")
    with pytest.raises(ChatTemplateError, match="cannot locate assistant message 1"):
        encode_chat(tok, CHAT, 512, chat_template=upper_past)


def test_template_errors_are_clear(tok):
    with pytest.raises(ChatTemplateError, match="shipped templates: llama-2-chat, vicuna_v1.1"):
        encode_chat(tok, CHAT, 512, chat_template="chatml")
    with pytest.raises(ChatTemplateError, match="has no chat template; set data.chat_template"):
        encode_chat(tiny_tokenizer(chat_template=None), CHAT, 512)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        encode_chat(tok, [CHAT[0], CHAT[0], CHAT[1]], 512, chat_template="llama-2-chat")
    with pytest.raises(ValueError, match="role must be one of"):
        encode_chat(tok, [{"role": "robot", "content": "x"}], 512)


def test_encode_text_trains_every_token_but_bos(tok):
    encoded = encode_text(tok, "hello world", max_length=512)
    assert tok.decode(encoded.input_ids) == "<s>hello world</s>"
    assert encoded.labels == [IGNORE_INDEX, *encoded.input_ids[1:]]


# Reference prompt builders, written from FastChat `Conversation.get_prompt` (SeparatorStyle.ADD_COLON_TWO,
# vicuna_v1.1: sep " ", sep2 "</s>") and Meta `llama/generation.py::chat_completion`.
def _fastchat_vicuna(messages, add_generation_prompt):
    system = messages[0]["content"] if messages[0]["role"] == "system" else VICUNA_SYSTEM
    turns = [m for m in messages if m["role"] != "system"]
    text, seps = system + " ", (" ", "</s>")
    for i, m in enumerate(turns):
        text += ("USER" if m["role"] == "user" else "ASSISTANT") + ": " + m["content"] + seps[i % 2]
    return "<s>" + text + ("ASSISTANT:" if add_generation_prompt else "")


def _meta_llama2(messages):
    if messages[0]["role"] == "system":
        first = "<<SYS>>\n" + messages[0]["content"] + "\n<</SYS>>\n\n" + messages[1]["content"]
        messages = [{"role": "user", "content": first}, *messages[2:]]
    text = "".join(
        f"<s>[INST] {q['content'].strip()} [/INST] {a['content'].strip()} </s>"
        for q, a in zip(messages[::2], messages[1::2])
    )
    if len(messages) % 2:
        text += f"<s>[INST] {messages[-1]['content'].strip()} [/INST]"
    return text


@pytest.mark.parametrize("messages", [CHAT, WITH_SYSTEM, CHAT[:3], WITH_SYSTEM[:2]], ids=["chat", "sys", "open", "q"])
def test_shipped_templates_match_reference_formats(tok, messages):
    open_turn = messages[-1]["role"] == "user"
    vicuna = tok.apply_chat_template(messages, chat_template=TEMPLATES["vicuna_v1.1"], tokenize=False,
                                     add_generation_prompt=open_turn)
    assert vicuna == _fastchat_vicuna(messages, open_turn)
    llama = tok.apply_chat_template(messages, chat_template=TEMPLATES["llama-2-chat"], tokenize=False,
                                    add_generation_prompt=open_turn)
    assert llama == _meta_llama2(messages)
