"""Building the built-in tiny models (models.tiny: their names, directories and format version), offline on this
machine: by `python scripts/build_tiny_models.py`, or by train.task before a training run that uses one.

Both share one byte-level BPE tokenizer trained on the standard-library corpus (data.stdlib_corpus). Each model is a
stock `LlamaForCausalLM` pretrained on that corpus, then fine-tuned on the chat data mined from it (data.stdlib_chat,
labels on assistant turns only, via data.chat.encode_chat). Everything is seeded and runs for a fixed number of steps,
so a rebuild gives the same weights on the same machine and library versions.

Beside the models (models.tiny.models_dir), <root>/models/tokenizer/ holds the tokenizer files and the tokenised
corpus (corpus-<split>.pt), shared by both models. Each directory is built in a sibling temp dir and moved in whole
(models.buildcache.atomic_dir); builds of one name are serialised with a lock file, so processes that start together
(the ranks of one torchrun) build once: one builds, the others wait and find it built.

Shape letters: B batch, T time, V vocab.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from data.chat import encode_chat, encode_prompt
from data.stdlib_chat import stdlib_conversations
from data.stdlib_corpus import corpus_documents
from models.buildcache import atomic_dir, build_lock, is_complete
from models.tiny import FORMAT_VERSION, check_name, is_built, model_dir, models_dir

TOKENIZER_DIR = "tokenizer"
MAX_CHAT_TOKENS = 2048  # longer conversations are truncated before packing

BOS, EOS, PAD = "<|bos|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)
# One line per turn: "<|role|>\n{content}<|end|>\n"; EOS is the end-of-turn token, so generation stops after a turn.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class TokenizerSpec:
    vocab_size: int = 4096
    max_corpus_chars: int | None = None  # cap on the training text (None: the whole corpus); tests use a small cap


@dataclass(frozen=True)
class TinySpec:
    """Architecture and training recipe of one built-in model (pretraining, then chat SFT)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    pretrain_steps: int  # random windows of the corpus token stream
    pretrain_batch: int
    pretrain_seq_len: int  # short windows: many independent samples per step learn fastest early on
    lr: float
    sft_steps: int  # packed rows of encoded conversations
    sft_batch: int
    sft_seq_len: int  # also the evaluation context
    sft_lr: float
    warmup_steps: int
    long_seq_len: int = 512  # the last `long_fraction` of pretraining uses windows this long, same tokens per step
    long_fraction: float = 0.0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    max_positions: int = 1024
    eval_tokens: int = 32768
    seed: int = 0
    threads: int = 2


SPECS: dict[str, TinySpec] = {
    # Recipe from measured sweeps on 2 cores (fp32: bf16 autocast backward is ~10x slower on CPU). At this budget the
    # number of optimizer steps limits quality: 8 x 128-token windows at lr 1.5e-3 beat 16 x 128 (and 4 x 128) per
    # token, and 1.5e-3 beat both 8e-4 and 5e-3. The last 20% of pretraining uses 512-token windows so that
    # positions up to the chat context are trained before SFT.
    "tiny": TinySpec(
        hidden_size=256, num_layers=4, num_heads=4, intermediate_size=768,
        pretrain_steps=900, pretrain_batch=8, pretrain_seq_len=128, lr=1.5e-3,
        sft_steps=120, sft_batch=2, sft_seq_len=512, sft_lr=6e-4, warmup_steps=30,
        long_seq_len=512, long_fraction=0.2,
    ),
    "tiny-draft": TinySpec(
        hidden_size=64, num_layers=3, num_heads=2, intermediate_size=192,
        pretrain_steps=900, pretrain_batch=8, pretrain_seq_len=128, lr=4e-3,
        sft_steps=60, sft_batch=4, sft_seq_len=512, sft_lr=1.5e-3, warmup_steps=30,
        long_seq_len=512, long_fraction=0.2,
    ),
}


@dataclass(frozen=True)
class BuildInfo:
    """What a build did and how good it is; written as build_info.json next to the weights."""

    name: str
    params: int
    pretrain_steps: int
    sft_steps: int
    tokens_seen: int
    seconds: float  # training wall time (tokenizer, evaluation and saving excluded)
    cpu_seconds: float
    tokens_per_second: int
    val_loss: float  # next-token loss (nats) on the corpus validation split, final model, sft_seq_len windows
    val_top1: float
    val_bits_per_byte: float  # the same loss per byte of source text: comparable across tokenizers
    chat_val_loss: float  # assistant-token loss on validation conversations
    chat_val_top1: float
    sample_prompt: str
    sample_completion: str  # greedy, up to 64 new tokens
    spec: dict
    format_version: int = FORMAT_VERSION


def ensure_built(name: str, progress: bool = True, cache_dir: Path | None = None, force: bool = False) -> Path:
    """Directory of the built model `name`, building it (and the shared tokenizer) first when missing.

    `force` rebuilds the model even when complete (the shared tokenizer is kept: the other model depends on it).
    `cache_dir` overrides the cache root.
    """
    target = model_dir(name, cache_dir)
    if is_built(name, cache_dir) and not force:
        return target
    tokenizer_dir = ensure_tokenizer(models_dir(cache_dir) / TOKENIZER_DIR, progress=progress)
    with build_lock(target.parent, name):
        if force or not is_built(name, cache_dir):  # another process may have finished it while we waited
            with atomic_dir(target, FORMAT_VERSION) as tmp:
                build(name, tmp, tokenizer_dir, progress=progress)
    return target


def ensure_tokenizer(
    path: Path, spec: TokenizerSpec = TokenizerSpec(), progress: bool = True, force: bool = False
) -> Path:
    """The shared tokenizer directory at `path`, trained (with the tokenised corpus cached beside it) when missing."""
    path = Path(path)
    if is_complete(path) and not force:
        return path
    with build_lock(path.parent, path.name):
        if force or not is_complete(path):
            with atomic_dir(path, FORMAT_VERSION) as tmp:
                build_tokenizer(tmp, spec, progress=progress)
    return path


def build_tokenizer(out_dir: Path, spec: TokenizerSpec = TokenizerSpec(), progress: bool = True) -> None:
    """Train the byte-level BPE on the train split, save it as a PreTrainedTokenizerFast, tokenise both splits."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    docs = {split: _capped(corpus_documents(split), spec.max_corpus_chars) for split in ("train", "validation")}
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=progress,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs["train"], trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama tokenizers: plain `tokenizer(text)` prepends BOS; the chat template writes its own.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(out_dir)
    for split, texts in docs.items():
        # Each document is BOS + its tokens; documents are concatenated in corpus order.
        ids = [i for enc in tok.encode_batch(texts, add_special_tokens=False) for i in (bos_id, *enc.ids)]
        torch.save(torch.tensor(ids, dtype=torch.int32), out_dir / f"corpus-{split}.pt")


def build(
    name: str, out_dir: Path, tokenizer_dir: Path, spec: TinySpec | None = None, progress: bool = True,
    max_conversations: int | None = None,
) -> BuildInfo:
    """Pretrain + chat-SFT model `name` (recipe `spec`, default SPECS[name]) and save it loadable by from_pretrained.

    `max_conversations` caps the mined chat data (tests); the full build uses all train conversations it needs.
    """
    from transformers import AutoTokenizer

    check_name(name)
    spec = SPECS[name] if spec is None else spec
    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        torch.manual_seed(spec.seed)
        generator = torch.Generator().manual_seed(spec.seed)
        model = _init_model(spec, tokenizer)
        train_stream = torch.load(tokenizer_dir / "corpus-train.pt", weights_only=True)
        _train(model, _pretrain_batches(train_stream, spec, generator), spec.pretrain_steps, spec.lr, spec,
               f"{name}: pretrain", progress)
        chat_train, chat_val = _conversations(spec.seed, max_conversations)
        sft_tokens = spec.sft_steps * spec.sft_batch * spec.sft_seq_len
        sft_rows = _chat_rows(tokenizer, chat_train, spec.sft_seq_len, sft_tokens)
        _train(model, _row_batches(sft_rows, spec.sft_batch, generator), spec.sft_steps, spec.sft_lr, spec,
               f"{name}: chat SFT", progress)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        val_stream = torch.load(tokenizer_dir / "corpus-validation.pt", weights_only=True)
        quality = _measure(model.eval(), tokenizer, val_stream, chat_val, spec)
    finally:
        torch.set_num_threads(threads_before)
    tokens = spec.pretrain_steps * spec.pretrain_batch * spec.pretrain_seq_len + sft_tokens
    info = BuildInfo(
        name=name, params=sum(p.numel() for p in model.parameters()), pretrain_steps=spec.pretrain_steps,
        sft_steps=spec.sft_steps, tokens_seen=tokens, seconds=round(seconds, 1), cpu_seconds=round(cpu_seconds, 1),
        tokens_per_second=round(tokens / seconds), **quality, spec=asdict(spec),
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "build_info.json").write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info


def _measure(model, tokenizer, val_stream: torch.Tensor, chat_val: list, spec: TinySpec) -> dict:
    """Validation metrics of a trained model (the quality fields of BuildInfo)."""
    val_ids, val_labels = _windows(val_stream, spec.eval_tokens, spec.sft_seq_len)
    val_loss, val_top1 = evaluate(model, val_ids, val_labels)
    val_bytes = sum(len(tokenizer.decode(row, skip_special_tokens=True).encode("utf-8")) for row in val_ids.tolist())
    # Loss covers T-1 predictions per window; bytes/token over whole windows is the same ratio up to 1/T.
    bits_per_byte = val_loss / math.log(2) * val_ids.numel() / val_bytes
    chat_loss, chat_top1 = evaluate(model, *_chat_rows(tokenizer, chat_val, spec.sft_seq_len, spec.eval_tokens // 2))
    prompt, completion = _sample(model, tokenizer, chat_val)
    return dict(
        val_loss=round(val_loss, 4), val_top1=round(val_top1, 4), val_bits_per_byte=round(bits_per_byte, 4),
        chat_val_loss=round(chat_loss, 4), chat_val_top1=round(chat_top1, 4),
        sample_prompt=prompt, sample_completion=completion,
    )


def load_build_info(path: Path) -> BuildInfo:
    return BuildInfo(**json.loads((Path(path) / "build_info.json").read_text()))


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 8
) -> tuple[float, float]:
    """(mean next-token loss, top-1 accuracy) over the tokens whose shifted label is not -100."""
    total_loss, correct, count = 0.0, 0, 0
    for i in range(0, len(input_ids), batch_size):
        logits = model(input_ids=input_ids[i : i + batch_size]).logits[:, :-1].float()  # [B, T-1, V]
        target = labels[i : i + batch_size, 1:]  # [B, T-1]
        mask = target != -100
        total_loss += torch.nn.functional.cross_entropy(logits[mask], target[mask], reduction="sum").item()
        correct += (logits.argmax(-1)[mask] == target[mask]).sum().item()
        count += mask.sum().item()
    return total_loss / max(count, 1), correct / max(count, 1)


def _init_model(spec: TinySpec, tokenizer) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).train()


def _train(model, batches: Iterator, steps: int, lr: float, spec: TinySpec, desc: str, progress: bool) -> None:
    """AdamW (decay on matrices only), linear warmup then cosine to `min_lr_ratio * lr`, grad-norm clip 1."""
    if steps <= 0:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": spec.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = min(spec.warmup_steps, max(steps // 10, 1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, warmup, steps, spec.min_lr_ratio))
    model.train()
    bar = tqdm(range(steps), desc=desc, disable=not progress, dynamic_ncols=True)
    for step in bar:
        input_ids, labels = next(batches)  # [B, T] each
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{loss.item():.3f}")


def _lr_factor(step: int, warmup: int, steps: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _window_batches(stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> Iterator:
    """Endless random contiguous windows of the token stream, labels = inputs (the model shifts)."""
    if len(stream) <= seq_len:
        raise ValueError(f"corpus has {len(stream)} tokens, fewer than seq_len={seq_len}")
    offsets = torch.arange(seq_len)
    while True:
        starts = torch.randint(0, len(stream) - seq_len, (batch_size, 1), generator=generator)
        ids = stream[starts + offsets].long()  # [B, T]
        yield ids, ids


def _pretrain_batches(stream: torch.Tensor, spec: TinySpec, generator: torch.Generator) -> Iterator:
    """Short windows for the first (1 - long_fraction) of pretraining, then long ones at equal tokens per step."""
    short_steps = round(spec.pretrain_steps * (1 - spec.long_fraction))
    long_batch = max(spec.pretrain_batch * spec.pretrain_seq_len // spec.long_seq_len, 1)
    short = _window_batches(stream, spec.pretrain_batch, spec.pretrain_seq_len, generator)
    long = _window_batches(stream, long_batch, spec.long_seq_len, generator)
    return itertools.chain(itertools.islice(short, short_steps), long)


def _row_batches(rows: tuple[torch.Tensor, torch.Tensor], batch_size: int, generator: torch.Generator) -> Iterator:
    """Endless epochs over packed rows in a fresh seeded order, `batch_size` rows at a time."""
    input_ids, labels = rows
    if len(input_ids) < batch_size:
        raise ValueError(f"only {len(input_ids)} packed chat rows, fewer than batch_size={batch_size}")
    while True:
        order = torch.randperm(len(input_ids), generator=generator)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield input_ids[order[i : i + batch_size]], labels[order[i : i + batch_size]]


def _windows(stream: torch.Tensor, max_tokens: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to max_tokens // seq_len non-overlapping windows spread evenly over the stream (so every part of the
    split counts, not just its first files)."""
    n = min(len(stream), max_tokens) // seq_len
    if n == 0:
        raise ValueError(f"validation corpus has {len(stream)} tokens, fewer than seq_len={seq_len}")
    stride = len(stream) // n  # >= seq_len
    starts = torch.arange(n) * stride
    ids = stream[starts[:, None] + torch.arange(seq_len)].long()  # [B, T]
    return ids, ids


def _chat_rows(tokenizer, conversations: list, seq_len: int, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoded conversations (assistant-only labels) packed back to back, stopping at max_tokens, cut into [B, T]
    rows; a conversation may straddle two rows (its tail then trains without its head as context)."""
    ids, labels = [], []
    for messages in conversations:
        encoded = encode_chat(tokenizer, messages, max_length=MAX_CHAT_TOKENS)
        if encoded.num_trained == 0:
            continue
        ids += encoded.input_ids
        labels += encoded.labels
        if len(ids) >= max_tokens:
            break
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"only {len(ids)} chat tokens, fewer than one row of seq_len={seq_len}")
    shape = (n, seq_len)
    return torch.tensor(ids[: n * seq_len]).view(shape), torch.tensor(labels[: n * seq_len]).view(shape)


def _conversations(seed: int, limit: int | None) -> tuple[list, list]:
    """(train conversations in a seeded shuffled order, validation conversations in corpus order)."""
    import random

    train = stdlib_conversations("train", limit=limit)
    random.Random(seed).shuffle(train)
    return train, stdlib_conversations("validation", limit=limit)


@torch.no_grad()
def _sample(model, tokenizer, conversations: list) -> tuple[str, str]:
    """Greedy completion of the first "write" prompt among `conversations` (prompt text, completion text)."""
    messages = next((c for c in conversations if c[0]["content"].startswith("Write")), conversations[0])[:1]
    prompt = torch.tensor([encode_prompt(tokenizer, messages)])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64, do_sample=False)
    return messages[0]["content"], tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)


def _capped(documents: Iterator[str], max_chars: int | None) -> list[str]:
    kept, total = [], 0
    for doc in documents:
        if max_chars is not None and total >= max_chars:
            break
        kept.append(doc)
        total += len(doc)
    return kept
