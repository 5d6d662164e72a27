"""Jinja chat templates shipped for models whose tokenizer has none, rendered by `tokenizer.apply_chat_template`.

vicuna_v1.1  FastChat `vicuna_v1.1` conversation (sep_style ADD_COLON_TWO, sep " ", sep2 "</s>"), with the BOS that
             FastChat's tokenizer call adds:
             "<s>{system} USER: {u1} ASSISTANT: {a1}</s>USER: {u2} ASSISTANT:"
             The default system prompt is FastChat's; a leading system message replaces it. Contents are not stripped.
llama-2-chat Meta `llama/generation.py::chat_completion`: every user/assistant pair is "<s>[INST] {u} [/INST] {a} </s>",
             contents stripped, the system message folded into the first user turn as
             "<<SYS>>\\n{system}\\n<</SYS>>\\n\\n{u1}"; the generation prompt is empty (a user turn ends in "[/INST]").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data.errors import UsageError
from data.locations import written_as_path

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)

_VICUNA_V1_1 = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system = '" + VICUNA_SYSTEM.replace("'", "\\'") + "' -%}{%- set turns = messages -%}"
    "{%- endif -%}"
    "{{- system + ' ' -}}"
    "{%- for message in turns -%}"
    "{%- if message['role'] == 'user' -%}{{- 'USER: ' + message['content'] + ' ' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- 'ASSISTANT: ' + message['content'] + eos_token -}}"
    "{%- else -%}{{- raise_exception('vicuna_v1.1: a system message may only come first') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
)

_LLAMA_2_CHAT = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system = none -%}{%- set turns = messages -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('llama-2-chat: after an optional system message, roles must alternate user/assistant') -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if loop.first and system is not none -%}"
    "{%- set text = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] -%}{%- endif -%}"
    "{{- bos_token + '[INST] ' + (text | trim) + ' [/INST]' -}}"
    "{%- else -%}"
    "{{- ' ' + (message['content'] | trim) + ' ' + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

TEMPLATES: dict[str, str] = {"vicuna_v1.1": _VICUNA_V1_1, "llama-2-chat": _LLAMA_2_CHAT}


class ChatTemplateError(UsageError):
    """No usable chat template, or the template cannot render / be aligned with a conversation."""


def get_template(name: str) -> str:
    """The Jinja source of a shipped template, or of a template file (a path to a .jinja file, as vLLM's
    --chat-template takes); other names raise ChatTemplateError listing the shipped ones."""
    if name in TEMPLATES:
        return TEMPLATES[name]
    path = Path(name).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"chat template {name}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    if name.endswith(".jinja") or written_as_path(name):
        raise ChatTemplateError(f"chat template {name}: no such file")
    raise ChatTemplateError(f"unknown chat template {name!r}; shipped templates: {', '.join(sorted(TEMPLATES))} "
                            f"(or a .jinja file, or the Jinja text itself)")


def resolve_template(tokenizer: Any, chat_template: str | None) -> str | None:
    """Jinja source to render with: a shipped template by name, a literal Jinja string, or None for the tokenizer's own.

    Raises ChatTemplateError when `chat_template` is None and the tokenizer has no template.
    """
    if chat_template is None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                "the tokenizer has no chat template; set data.chat_template to one of: "
                + ", ".join(sorted(TEMPLATES))
            )
        return None
    if "{%" in chat_template or "{{" in chat_template:
        return chat_template
    return get_template(chat_template)
