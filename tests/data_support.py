"""Test helpers for data/: fixture paths, a data-config stand-in, a tiny offline BPE tokenizer with a chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

FIXTURES = Path(__file__).parent / "fixtures" / "data"
SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"  # public data; tests skip when absent

WORDS = "the quick brown fox jumps over lazy dog hello world have a nice day what is two plus three".split()

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# "<s><|user|>\nhi<|end|>\n<|assistant|>\nhello<|end|>\n": assistant turns are "hello<|end|>".
SIMPLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Who are you? I am a helpful assistant.",
    "USER: ASSISTANT: [INST] [/INST] <<SYS>> <</SYS>> A chat between a curious user and an artificial intelligence",
    "What is 2 + 3? The answer is 5. #### 5 Natalia sold clips to 48 of her friends in April.",
    "Describe a process of making crepes. Mix the batter, heat the pan, cook each side.",
    "hello world, hello there! Have a nice day. You too! Translate to French: bonjour.",
]


def tiny_tokenizer(
    chat_template: str | None = SIMPLE_TEMPLATE, vocab_size: int = 400, metaspace: bool = False
) -> PreTrainedTokenizerFast:
    """A deterministic fast tokenizer: bos <s>, eos </s>, pad <pad>.

    Default: byte-level BPE (exact decode of any text; its ids are pinned by other tests, keep the corpus fixed).
    metaspace=True: SentencePiece-style "▁" pieces as in Llama-2 tokenizers (a leading "▁" on the first word;
    characters outside the training corpus become <unk>).
    """
    if metaspace:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        corpus, alphabet = [*_CORPUS, "Be nice.\nline breaks\n\n<|im_start|>system user assistant<|im_end|>"], []
    else:
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        corpus, alphabet = _CORPUS, pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
        chat_template=chat_template,
    )


@dataclass(frozen=True)
class DataCfg:
    """Stand-in for the `data` config group (train/config.py holds the real schema); defaults as in the brief."""

    name: str = "default"
    format: str = "builtin"
    path: str | None = None
    split: str = "train"
    validation_path: str | None = None
    validation_fraction: float = 0.02
    max_length: int = 512
    packing: bool = False
    on_error: str = "raise"
    max_samples: int | None = None
    chat_template: str | None = None
    system_prompt: str | None = None
    text_field: str = "text"
    seed: int = 0
    recover_truncated: bool = False
    require_user_first: bool = False
    dedupe: bool = False
    decontaminate: bool = True
    max_tokens: int | None = None


SHAREGPT = DataCfg(name="sharegpt", format="sharegpt", path=str(FIXTURES / "sharegpt.json"), validation_fraction=0.0)


def pretend_installed(monkeypatch, package: str, location: Path | None) -> None:
    """Make importlib.util.find_spec see `package` installed at `location` (None: not installed); every other module
    resolves as usual (transformers finds its optional dependencies this way)."""
    import importlib.machinery
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name != package:
            return real(name, *args, **kwargs)
        if location is None:
            return None
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(location)]
        return spec

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def random_chats(count: int, user: int | Callable[[int], int] = 5, reply: int | Callable[[int], int] = 12,
                 seed: int = 0) -> list[list[dict[str, str]]]:
    """`count` two-turn chats of random WORDS, the same for the same arguments: chat i's user turn has `user` words
    and its reply `reply` (a number, or a function of i)."""
    g = torch.Generator().manual_seed(seed)

    def words(n: int | Callable[[int], int], i: int) -> str:
        k = n(i) if callable(n) else n
        return " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (k,), generator=g).tolist())

    chats = []
    for i in range(count):
        question = words(user, i)
        chats.append([{"role": "user", "content": question}, {"role": "assistant", "content": words(reply, i)}])
    return chats


def write_sharegpt(path: Path, chats: list[list[dict[str, str]]], ids: bool = True) -> Path:
    """`chats` as a ShareGPT-format JSON file (human / gpt turns; an "id" per record unless ids=False)."""
    records = [{**({"id": str(i)} if ids else {}),
                "conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                                  for m in chat]} for i, chat in enumerate(chats)]
    path.write_text(json.dumps(records))
    return path
