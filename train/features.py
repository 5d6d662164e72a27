"""`python -m train features +model=<name> data=<recipe> output_dir=DIR`: the frozen target's features, cached.

One batched, no-grad, teacher-forced pass of the target over the recipe's encoded conversations (train and validation
splits) writes the cache of data/features.py: the last hidden state, any extra layers (`method.layers`, transformers'
hidden_states numbering) and the target's own next-token distribution as soft labels (top `method.topk`). A drafter
trainer then reads it with `data.features=DIR` and never runs the target forward: epochs cost only the drafter.

Order of work: every setting and the data are checked, the disk it needs is printed and compared with what is free,
an existing cache in DIR is compared with this run (another target, tokenizer, layer set or data is refused in one
line); only then does the target load. Samples are sorted by length and cut into batches of at most
`method.batch_tokens` padded tokens (length-bucketed: little padding), batches into shards of about
`method.shard_tokens` tokens. Shards are written atomically, so a killed run resumes at the first missing shard.
Under torchrun / deepspeed each rank extracts the shards i with i % world == rank; rank 0 writes the manifest and
marks it complete when every shard is there.
Dimension letters: B batch, T time, D hidden, V vocabulary, k soft-label width, N rows.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from data.atomic import write_json
from data.chat import IGNORE_INDEX, encode_prompt, first_user_turn
from data.collate import ChatCollator
from data.datasets import build_datasets
from data.errors import UsageError
from data.features import (
    MANIFEST, PROMPTS, STORAGE_DTYPES, FeatureCacheError, Manifest, remove_partial_shards, shard_name,
    write_shard,
)
from inference.collect.shared import World, rank_device
from models.backbone import padded_position_ids
from models.eagle3 import fused_layers
from models.fingerprint import target_fingerprint, tokenizer_fingerprint
from models.loading import load_target, load_tokenizer, model_config
from train.prompts import first_user_prompts
from train.self_distill import SELF_DISTILL_DIR, chosen_conversations, share_answers, with_distilled_train

log = logging.getLogger("draftsmith")

LOGITS_ROWS = 2048  # rows projected onto the vocabulary at once: [2048, V] fp32 stays small next to the model


@dataclass(frozen=True)
class Batch:
    samples: tuple[int, ...]  # indices into the split's dataset
    tokens: int  # real tokens (no padding)


@dataclass(frozen=True)
class ShardPlan:
    split: str
    index: int
    batches: tuple[Batch, ...]

    @property
    def tokens(self) -> int:
        return sum(b.tokens for b in self.batches)


def plan_shards(split: str, lengths: Sequence[int], batch_tokens: int, shard_tokens: int) -> list[ShardPlan]:
    """Length-bucketed batches (samples sorted by length, longest first; a batch holds at most `batch_tokens` padded
    tokens, or one sample longer than that), grouped in order into shards of about `shard_tokens` tokens.
    Deterministic in the lengths, so a resumed run plans the same shards."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[Batch] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]  # longest first: the first sample sets the width
        if current and width * (len(current) + 1) > batch_tokens:
            batches.append(Batch(tuple(current), sum(lengths[j] for j in current)))
            current = []
        current.append(i)
    if current:
        batches.append(Batch(tuple(current), sum(lengths[j] for j in current)))
    shards: list[ShardPlan] = []
    group: list[Batch] = []
    for batch in batches:
        group.append(batch)
        if sum(b.tokens for b in group) >= shard_tokens:
            shards.append(ShardPlan(split, len(shards), tuple(group)))
            group = []
    if group:
        shards.append(ShardPlan(split, len(shards), tuple(group)))
    return shards


class LayerTaps:
    """Forward hooks that keep transformers' hidden_states[i] for the requested i (0: the embeddings' output, i >= 1:
    decoder layer i's output, the last one after the final norm, as transformers numbers them) during one forward; no
    output_hidden_states, so nothing else is kept."""

    def __init__(self, model: nn.Module, layers: Sequence[int]) -> None:
        decoder = model.get_decoder()
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles = []
        for i in layers:
            # hidden_states[N] (the last) is the final norm's output in transformers, not decoder layer N's
            last = i == len(decoder.layers) and getattr(decoder, "norm", None) is not None
            module = decoder.get_input_embeddings() if i == 0 else decoder.norm if last else decoder.layers[i - 1]
            self.handles.append(module.register_forward_hook(self._keep(i)))

    def _keep(self, i: int):
        def hook(module, args, output):
            self.outputs[i] = output[0] if isinstance(output, tuple) else output
        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def forward_features(model: nn.Module, batch: dict[str, torch.Tensor], taps: LayerTaps, topk: int
                     ) -> dict[str, torch.Tensor]:
    """One teacher-forced pass: input_ids / attention_mask / labels [B, T] -> per-token features of the real tokens,
    flattened row-major to [N, ...] (N = attention_mask.sum()): hidden, layer_<i>, and, with topk > 0, the target's
    top-k next-token probabilities where token t + 1 is a trained label (zero rows elsewhere)."""
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    taps.outputs.clear()
    out = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=padded_position_ids(mask),
                              use_cache=False)
    real = mask.bool()  # [B, T]
    features = {"hidden": out.last_hidden_state[real]}  # [N, D]
    for i, value in sorted(taps.outputs.items()):
        features[f"layer_{i}"] = value[real]
    if topk:
        next_trained = torch.zeros_like(real)
        next_trained[:, :-1] = labels[:, 1:] != IGNORE_INDEX  # [B, T]: the soft label at t is read for token t + 1
        need = next_trained[real]  # [N]
        rows = features["hidden"][need]  # [n, D]
        ids_k = torch.zeros(len(need), topk, dtype=torch.int32, device=rows.device)
        probs_k = torch.zeros(len(need), topk, dtype=torch.float32, device=rows.device)
        rest = torch.zeros(len(need), dtype=torch.float32, device=rows.device)
        lm_head = model.get_output_embeddings()
        top_ids, top_probs, top_rest = [], [], []
        for start in range(0, len(rows), LOGITS_ROWS):
            probs = lm_head(rows[start : start + LOGITS_ROWS]).float().softmax(-1)  # [n', V]
            values, indices = probs.topk(topk, dim=-1)  # [n', k]
            top_ids.append(indices.int())
            top_probs.append(values)
            top_rest.append((1.0 - values.sum(-1)).clamp_min(0.0))
        if top_ids:
            ids_k[need], probs_k[need], rest[need] = torch.cat(top_ids), torch.cat(top_probs), torch.cat(top_rest)
        features.update(topk_ids=ids_k, topk_probs=probs_k, topk_rest=rest)
    return features


def extract_shard(model: nn.Module, dataset: Any, plan: ShardPlan, collate: ChatCollator, taps: LayerTaps, topk: int,
                  storage: torch.dtype, device: torch.device, progress: Any) -> dict[str, torch.Tensor]:
    """The tensors of one shard (data/features.py's layout), on the CPU."""
    parts: dict[str, list[torch.Tensor]] = {}
    lengths: list[int] = []
    for batch in plan.batches:
        items = [dataset[i] for i in batch.samples]
        inputs = {k: v.to(device) for k, v in collate(items).items()}
        features = forward_features(model, inputs, taps, topk)
        real = inputs["attention_mask"].bool()
        features["input_ids"] = inputs["input_ids"][real].int()
        features["loss_mask"] = (inputs["labels"][real] != IGNORE_INDEX).to(torch.uint8)
        for key, value in features.items():
            is_state = key == "hidden" or key.startswith("layer_")
            parts.setdefault(key, []).append(value.to("cpu", storage if is_state else value.dtype))
        lengths.extend(len(item["input_ids"]) for item in items)
        progress.update(batch.tokens)
    tensors = {key: torch.cat(values) for key, values in parts.items()}
    tensors["offsets"] = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    return tensors


def check_disk(folder: Path, need: int) -> None:
    """Refuse to start when the disk under `folder` has less than `need` bytes free."""
    free = shutil.disk_usage(folder).free
    log.info("features: %s needed, %s free in %s", human_bytes(need), human_bytes(free), folder)
    if need > free:
        raise UsageError(f"output_dir={folder}: extraction needs {human_bytes(need)} and only {human_bytes(free)} are "
                         f"free; lower data.max_tokens, drop method.layers, or pick a larger disk")


def world() -> tuple[int, int]:
    """(rank, world size) of a launcher's process group, joined here when the launcher set one up (env://)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def barrier(size: int) -> None:
    """Wait for every rank (nothing to wait for alone)."""
    if size > 1:
        torch.distributed.barrier()


def check_continuable(folder: Path, manifest: Manifest, counts: bool = True) -> Manifest | None:
    """The cache already in `folder` (None: there is none), refused in one line when this run cannot continue it."""
    if not (folder / MANIFEST).is_file():
        return None
    old = Manifest.read(folder)
    problem = old.mismatch(manifest, counts=counts and bool(old.shards))  # no shards: written before the data was built
    if problem:
        raise FeatureCacheError(f"output_dir={folder} holds a feature cache that this run cannot continue: "
                                f"{problem}; choose another output_dir or delete it")
    return old


def self_distill_bound(cfg: DictConfig, tokenizer: Any, chosen: list[tuple[str, Any]]) -> int:
    """Tokens the self-distilled train split can hold at most: each chosen conversation's first prompt plus
    data.self_distill_new_tokens, within data.max_length (data.max_length itself when later turns are answered too),
    once per answer (data.self_distill_answers)."""
    template = cfg.model.chat_template or cfg.data.chat_template
    one_turn = cfg.data.self_distill_turns == 1
    total = 0
    for _, conversation in chosen:
        turn = first_user_turn(conversation)
        if turn is not None:
            prompt = len(encode_prompt(tokenizer, turn, chat_template=template))
            if prompt + cfg.data.self_distill_new_tokens <= cfg.data.max_length:  # longer ones are not answered
                total += prompt + cfg.data.self_distill_new_tokens if one_turn else cfg.data.max_length
    return total * cfg.data.self_distill_answers


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


class Method:
    """The `features` job (a train.method.Standalone method: its own loop, no Trainer)."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.m = cfg.method

    def run(self, cfg: DictConfig) -> dict[str, float]:
        m = self.m
        if cfg.data.get("features"):
            raise UsageError("method=features writes a feature cache to output_dir; data.features (reading one) must "
                             "be null")
        folder = Path(cfg.output_dir)
        rank, size = world()
        tokenizer = load_tokenizer(cfg.model.path, cfg.model.chat_template or cfg.data.chat_template,
                                   cfg.model.trust_remote_code)
        config = model_config(cfg.model.path, cfg.model.trust_remote_code, cfg.model.revision).get_text_config()
        layers = sorted(set(fused_layers(m.layers, config.num_hidden_layers)))  # null: EAGLE-3's for this depth
        bad = [i for i in layers if not 0 <= i <= config.num_hidden_layers]
        if bad:
            raise UsageError(f"method.layers={layers}: {bad} outside [0, {config.num_hidden_layers}] "
                             f"(0: embeddings, i: after decoder layer i)")
        if m.topk > config.vocab_size:
            raise UsageError(f"method.topk={m.topk}: the target's vocabulary has only {config.vocab_size} tokens")
        datasets = build_datasets(cfg.data, tokenizer)  # the data checked before any model loads
        fingerprints = (target_fingerprint(cfg.model.path, cfg.model.trust_remote_code, cfg.model.revision),
                        tokenizer_fingerprint(tokenizer))
        target = None
        if cfg.data.self_distill:  # the target answers the train prompts first; the cache holds its answers
            head = Manifest(target=fingerprints[0], tokenizer=fingerprints[1], hidden_size=config.hidden_size,
                            vocab_size=config.vocab_size, layers=layers, topk=m.topk, dtype=m.dtype,
                            recipe=recipe(cfg, None), shards={})
            old = check_continuable(folder, head, counts=False)
            if old is not None and old.complete:
                log.info("feature cache %s is complete (%s train tokens): nothing to do", folder,
                         old.tokens.get("train"))
                return {}
            folder.mkdir(parents=True, exist_ok=True)
            chosen = chosen_conversations(cfg)  # read once: the disk bound and the answers use the same list
            check_disk(folder, self_distill_bound(cfg, tokenizer, chosen) * head.bytes_per_token())
            if rank == 0 and old is None:
                head.write(folder)  # the answers below belong to this run's data: a rerun with other data is refused
            target = self.load_target(cfg)
            share_answers(cfg, target, tokenizer, chosen, folder, World(rank, size))  # waits for every rank's share
            datasets = with_distilled_train(cfg, tokenizer, folder / SELF_DISTILL_DIR, datasets)
        splits = {"train": datasets.train, "validation": datasets.validation}
        splits = {name: ds for name, ds in splits.items() if ds is not None and len(ds)}
        plans = {name: plan_shards(name, [len(ds[i]["input_ids"]) for i in range(len(ds))], m.batch_tokens,
                                   m.shard_tokens) for name, ds in splits.items()}
        manifest = Manifest(
            target=fingerprints[0],
            tokenizer=fingerprints[1],
            hidden_size=config.hidden_size, vocab_size=config.vocab_size, layers=layers, topk=m.topk, dtype=m.dtype,
            recipe=recipe(cfg, datasets.report),
            shards={name: len(p) for name, p in plans.items()},
            samples={name: len(ds) for name, ds in splits.items()},
            tokens={name: sum(p.tokens for p in ps) for name, ps in plans.items()},
            trained_tokens={name: getattr(datasets.report, name).trained_tokens for name in splits},
        )
        old = check_continuable(folder, manifest)
        if old is not None and old.complete:
            log.info("feature cache %s is complete (%s train tokens): nothing to do", folder, old.tokens.get("train"))
            return {}
        everything = [p for ps in plans.values() for p in ps]
        mine = everything[rank::size]  # round robin over the shards of both splits
        todo = [p for p in mine if not (folder / shard_name(p.split, p.index)).is_file()]
        left = sum(p.tokens for p in todo)
        need = left * manifest.bytes_per_token()
        folder.mkdir(parents=True, exist_ok=True)
        total = sum(manifest.tokens.values())
        log.info("features: %s tokens (%s), %s a token, %s in all; %s left to extract by rank %d%s",
                 f"{total:,}", ", ".join(f"{k} {v:,}" for k, v in manifest.tokens.items()),
                 human_bytes(manifest.bytes_per_token()), human_bytes(total * manifest.bytes_per_token()),
                 human_bytes(need), rank, f" of {size}" if size > 1 else "")
        check_disk(folder, need * size)  # the ranks usually share one disk
        if rank == 0:
            remove_partial_shards(folder)
            manifest.write(folder)
            write_json(folder / PROMPTS, validation_prompts(cfg, tokenizer))
        stats = self.extract(cfg, target or self.load_target(cfg), folder, splits, todo, sum(p.tokens for p in mine),
                             manifest, tokenizer.pad_token_id)
        barrier(size)
        if rank == 0:
            missing = [shard_name(p.split, p.index) for ps in plans.values() for p in ps
                       if not (folder / shard_name(p.split, p.index)).is_file()]
            if missing:
                raise FeatureCacheError(f"{folder}: {len(missing)} shards missing after extraction ({missing[0]}, ...)")
            manifest.complete = True
            manifest.write(folder)
            print(f"feature cache: {folder} ({total:,} tokens, "
                  f"{human_bytes(sum(p.stat().st_size for p in folder.glob('*.safetensors')))} on disk)", flush=True)
        return stats

    def load_target(self, cfg: DictConfig) -> nn.Module:
        target = load_target(cfg.model.path, dtype=cfg.model.dtype, quantization=cfg.model.quantization,
                             double_quant=cfg.model.double_quant, attn_implementation=cfg.model.attn_implementation,
                             trust_remote_code=cfg.model.trust_remote_code, revision=cfg.model.revision)
        if cfg.model.quantization in (None, "none"):
            target = target.to(rank_device())
        return target.eval()

    def extract(self, cfg: DictConfig, target: nn.Module, folder: Path, splits: dict[str, Any], todo: list[ShardPlan],
                mine: int, manifest: Manifest, tokenizer_pad: int) -> dict[str, float]:
        from tqdm.auto import tqdm

        device = rank_device()
        collate = ChatCollator(tokenizer_pad)
        taps = LayerTaps(target, manifest.layers)
        left = sum(p.tokens for p in todo)
        start = time.perf_counter()
        with tqdm(total=mine, initial=mine - left, desc="features", unit="tok", unit_scale=True, file=sys.stderr,
                  mininterval=2.0, smoothing=0.1) as progress:
            for plan in todo:
                tensors = extract_shard(target, splits[plan.split], plan, collate, taps, manifest.topk,
                                        STORAGE_DTYPES[manifest.dtype], device, progress)
                write_shard(folder / shard_name(plan.split, plan.index), tensors)
        taps.close()
        seconds = time.perf_counter() - start
        rate = left / seconds if seconds > 0 and left else 0.0
        if left:
            log.info("features: %s tokens in %.0f s: %.0f tokens/s", f"{left:,}", seconds, rate)
        return {"tokens": float(left), "seconds": seconds, "tokens_per_second": rate}


def recipe(cfg: DictConfig, report: Any) -> dict[str, Any]:
    """What decides the cached tokens: the data config (paths as given), what the data build kept and dropped
    (data.datasets.DataReport), and the settings of the shard plan."""
    data = OmegaConf.to_container(cfg.data, resolve=True, enum_to_str=True)
    return {"data": data, "report": None if report is None else dataclasses.asdict(report),
            "batch_tokens": cfg.method.batch_tokens, "shard_tokens": cfg.method.shard_tokens}


def validation_prompts(cfg: DictConfig, tokenizer: Any) -> list[list[int]]:
    """The greedy-evaluation prompts a trainer reading the cache uses (first user turns of validation conversations)."""
    return first_user_prompts(cfg, tokenizer, "validation", cfg.method.prompts)
