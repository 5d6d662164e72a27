"""Chat formatting: render a conversation with a chat template, tokenise it, mask everything but assistant turns.

Label contract (labels are NOT shifted; the trainer shifts, as in Hugging Face causal-LM losses):
    labels[t] == input_ids[t]  if token t overlaps an assistant turn, else IGNORE_INDEX.
An assistant turn is the text the model must generate after the template's generation prompt: the assistant content
plus the template's end-of-turn text that follows it (e.g. " </s>" for llama-2-chat, "</s>" for vicuna_v1.1),
trailing whitespace excluded.

How turns are located (template-agnostic; no `{% generation %}` tags needed):
    start = len(render(messages[:i], add_generation_prompt=True))
    end   = len(render(messages[:i + 1]))
when both renders are prefixes of the full render (true for llama-2, vicuna, ChatML, Zephyr, ...). Templates that
rewrite earlier turns (e.g. strip reasoning from past answers) fall back to searching the content in the full render
and extending the span through a following eos token. Char spans become token labels through the fast tokenizer's
offset mapping (or, for tokenizers without offsets, through token counts of rendered prefixes).

Control-token text inside message contents (e.g. a user typing "</s>") is tokenised as the control token, as
`tokenizer.apply_chat_template(..., tokenize=True)` does by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from data.templates import ChatTemplateError, resolve_template

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")

Message = dict[str, str]
Conversation = list[Message]


@dataclass(frozen=True)
class EncodedChat:
    """One tokenised sample; `len(input_ids) == len(labels)`, labels use IGNORE_INDEX on untrained tokens."""

    input_ids: list[int]
    labels: list[int]

    @property
    def num_trained(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


def encode_chat(
    tokenizer: Any, messages: Conversation, max_length: int, chat_template: str | None = None
) -> EncodedChat:
    """Tokenise `messages` with the chat template and keep labels on assistant turns only.

    `chat_template`: None (the tokenizer's own), a shipped template name (see data.templates.TEMPLATES), or a Jinja
    string. The result is truncated to the first `max_length` tokens; it may then hold no trained token (callers
    decide whether to drop it, see `EncodedChat.num_trained`).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    _check_messages(messages)
    template = resolve_template(tokenizer, chat_template)
    text, spans = assistant_char_spans(tokenizer, messages, template)
    input_ids, labels = _label_spans(tokenizer, text, spans, max_length)
    return EncodedChat(input_ids=input_ids, labels=labels)


def encode_prompt(tokenizer: Any, messages: Conversation, chat_template: str | None = None) -> list[int]:
    """Token ids of `messages` followed by the template's generation prompt (the input for generating a reply).

    A trailing assistant message is dropped first, so a training conversation can be reused as an eval prompt.
    """
    _check_messages(messages)
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise ValueError("encode_prompt needs at least one non-assistant message")
    template = resolve_template(tokenizer, chat_template)
    text = _render(tokenizer, messages, template, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def first_user_turn(conversation: Conversation) -> Conversation | None:
    """The conversation up to and including its first user message (what a prompt set asks first), or None when
    it has no user message."""
    first = next((i for i, m in enumerate(conversation) if m["role"] == "user"), None)
    return None if first is None else conversation[: first + 1]


def encode_text(tokenizer: Any, text: str, max_length: int) -> EncodedChat:
    """Plain language-modelling sample, no chat template: [bos] + text + [eos], every token but bos trained."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    labels = list(ids)
    if tokenizer.bos_token_id is not None:
        ids, labels = [tokenizer.bos_token_id, *ids], [IGNORE_INDEX, *labels]
    if tokenizer.eos_token_id is not None:
        ids, labels = [*ids, tokenizer.eos_token_id], [*labels, tokenizer.eos_token_id]
    return EncodedChat(input_ids=ids[:max_length], labels=labels[:max_length])


def assistant_char_spans(
    tokenizer: Any, messages: Conversation, template: str | None
) -> tuple[str, list[tuple[int, int]]]:
    """The full render of `messages` and the [start, end) char span of each assistant turn in it, in order."""
    full = _render(tokenizer, messages, template, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], template, add_generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[: i + 1], template, add_generation_prompt=False)
        if cursor <= len(before) <= len(through) and full.startswith(before) and full.startswith(through):
            start, end = len(before), len(through)
        else:
            start, end = _search_turn(tokenizer, full, message["content"], cursor, turn=i)
        end = start + len(full[start:end].rstrip())
        if end > start:
            spans.append((start, end))
        cursor = max(cursor, end)
    return full, spans


def _search_turn(tokenizer: Any, full: str, content: str, cursor: int, turn: int) -> tuple[int, int]:
    """Fallback for templates whose prefix renders are not prefixes: find the content, extend through eos."""
    for needle in (content, content.strip()):
        start = full.find(needle, cursor) if needle else -1
        if start >= 0:
            end = start + len(needle)
            eos = tokenizer.eos_token
            tail = full[end:]
            if eos and tail.lstrip().startswith(eos):
                end += len(tail) - len(tail.lstrip()) + len(eos)
            return start, end
    raise ChatTemplateError(
        f"cannot locate assistant message {turn} in the rendered chat template output "
        "(the template rewrites assistant contents); use a template whose prefix renders are prefixes"
    )


def _render(tokenizer: Any, messages: Conversation, template: str | None, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as err:  # jinja2 TemplateError / raise_exception(): report it as a data problem
        raise ChatTemplateError(f"chat template failed on a {len(messages)}-message conversation: {err}") from err


def _label_spans(
    tokenizer: Any, text: str, spans: list[tuple[int, int]], max_length: int
) -> tuple[list[int], list[int]]:
    """The first max_length token ids of `text` (no added special tokens: the template writes them), labels on spans."""
    if not getattr(tokenizer, "is_fast", False):
        return _label_spans_by_prefix(tokenizer, text, spans, max_length)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(enc["input_ids"][:max_length])
    labels = [IGNORE_INDEX] * len(input_ids)
    span_idx = 0
    for t, (tok_start, tok_end) in enumerate(enc["offset_mapping"][:max_length]):
        # Spans and tokens are both in text order: one pass, skipping spans that end before this token.
        while span_idx < len(spans) and tok_start >= spans[span_idx][1]:
            span_idx += 1
        if span_idx == len(spans):
            break
        # Overlap test; a zero-width token (some Metaspace tokenizers) counts as one char wide.
        if max(tok_end, tok_start + 1) > spans[span_idx][0]:
            labels[t] = input_ids[t]
    return input_ids, labels


def _label_spans_by_prefix(
    tokenizer: Any, text: str, spans: list[tuple[int, int]], max_length: int
) -> tuple[list[int], list[int]]:
    """No offsets: tokens [n(start), n(end)) are trained, n(c) = token count of text[:c].

    Assumes tokenisation is prefix-stable at span boundaries, which holds at the template/content seams of usual
    templates (they sit next to control tokens or whitespace).
    """
    def count(c: int) -> int:
        return len(tokenizer(text[:c], add_special_tokens=False)["input_ids"]) if c else 0

    input_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"][:max_length])
    labels = [IGNORE_INDEX] * len(input_ids)
    for start, end in spans:
        for t in range(count(start), min(count(end), len(input_ids))):
            labels[t] = input_ids[t]
    return input_ids, labels


def _check_messages(messages: Conversation) -> None:
    for i, message in enumerate(messages):
        if message.get("role") not in ROLES:
            raise ValueError(f"message {i}: role must be one of {ROLES}, got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"message {i}: content must be a string, got {type(message.get('content')).__name__}")
