"""Jacobi trajectories for CLLM (Kou et al. 2024): collection, the JSONL format, the training dataset and collator.

    python -m data.jacobi --model tiny --output traj.jsonl [--data default] [--block-size 16] [data.path=... ...]

One JSONL line per prompt (a `datasets.load_dataset("json", ...)`-loadable file):
    {"id", "prompt_ids", "answer_ids", "answer_labels", "block_size", "init",
     "blocks": [{"states": [[N ids], ...]}, ...],   # every Jacobi state of a block; states[-1] is its fixed point
     "dropped": null | reason}
Block j's prefix is prompt_ids + the fixed points of blocks 0..j-1; the fixed points together are the target's
greedy answer. answer_ids / answer_labels are the dataset's own reply (chat-encoded, labels on assistant tokens;
empty without a reply). Degenerate generations (a run of `max_repeat` identical tokens) keep the blocks before the
run; a record with none left is written with "dropped" set, so a resumed collection skips it too.

Resuming: ids already in the output are skipped; a torn last line (an interrupted write) is cut off first.
Dimension letters: B batch, T time, N block size.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch.utils.data

from data.chat import IGNORE_INDEX
from data.readers import DataError

AR_SOURCES = ("ground_truth", "target_output", "both")  # both: one row of each per item (ground truth first)
RECORD_START = b'{"id": '  # json.dumps of a record dict starts so (its first key is "id")


@dataclass(frozen=True)
class PromptSample:
    id: str
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...] = ()
    answer_labels: tuple[int, ...] = ()


def longest_run(tokens: Sequence[int]) -> int:
    best = run = 0
    for i, t in enumerate(tokens):
        run = run + 1 if i and t == tokens[i - 1] else 1
        best = max(best, run)
    return best


def trajectory_record(sample: PromptSample, blocks: Sequence[Sequence[Sequence[int]]], block_size: int, init: str,
                      max_repeat: int) -> dict[str, Any]:
    """The JSONL record of one prompt; `blocks[j]` lists block j's states (the last one its fixed point)."""
    kept, generated, dropped = [], [], None
    for states in blocks:
        generated += list(states[-1])
        if max_repeat and longest_run(generated) >= max_repeat:
            dropped = f"a run of {max_repeat}+ identical tokens in block {len(kept)}"
            break
        kept.append({"states": [list(s) for s in states]})
    return {
        "id": sample.id, "prompt_ids": list(sample.prompt_ids), "answer_ids": list(sample.answer_ids),
        "answer_labels": list(sample.answer_labels), "block_size": block_size, "init": init, "blocks": kept,
        "dropped": dropped if not kept else None,
    }


def done_ids(path: Path) -> set[str]:
    """Ids already written to `path`. Every complete line must be a record (else ValueError: not our file, left
    untouched); a torn last line (an interrupted record write) is truncated away."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    ids = set()
    for number, line in enumerate(data[:end].splitlines(), 1):
        try:
            ids.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise ValueError(f"{path}: line {number}: not a trajectory record; choose another --output") from None
    if end < len(data):
        tail = data[end:]
        if not (tail.startswith(RECORD_START) or RECORD_START.startswith(tail)):
            raise ValueError(f"{path}: last line is not a trajectory record; choose another --output")
        with open(path, "r+b") as f:
            f.truncate(end)
    return ids


def collect(model: Any, samples: Sequence[PromptSample], output: Path, options: Any, num_blocks: int,
            batch_size: int = 8, pad_token_id: int = 0, eos_token_ids: tuple[int, ...] = (), max_repeat: int = 16,
            progress: bool = True) -> int:
    """Record block-Jacobi trajectories (inference.jacobi.jacobi_blocks) of every sample not yet in `output`,
    `batch_size` prompts per batch (left-padded); appends one line per prompt. Returns the records written."""
    from tqdm.auto import tqdm

    from inference.jacobi import jacobi_blocks

    done = done_ids(output)
    todo = [s for s in samples if s.id not in done]
    device = model.get_input_embeddings().weight.device
    written = 0
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "a") as f, tqdm(total=len(samples), initial=len(samples) - len(todo), desc="jacobi",
                                      unit="prompt", disable=not progress) as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            width = max(len(s.prompt_ids) for s in batch)
            ids = torch.tensor([[pad_token_id] * (width - len(s.prompt_ids)) + list(s.prompt_ids) for s in batch])
            mask = torch.tensor([[0] * (width - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in batch])
            def show(j: int, iterations: int) -> None:  # one line per block: a batch takes minutes on a CPU
                bar.set_postfix_str(f"batch block {j + 1}/{num_blocks}: {iterations} iterations", refresh=True)

            trajectories = jacobi_blocks(model, ids.to(device), mask.to(device), options, num_blocks, pad_token_id,
                                         eos_token_ids, on_block=show)
            for sample, row in zip(batch, trajectories):
                blocks = [block.states for block in row]
                record = trajectory_record(sample, blocks, options.block_size, options.init, max_repeat)
                f.write(json.dumps(record) + "\n")
                written += 1
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
    return written


def prompt_samples(data_cfg: Any, tokenizer: Any, split: str = "train", max_prompts: int | None = None
                   ) -> list[PromptSample]:
    """The first user turn of each conversation of a `data` config as a prompt, with the reply after it (if any)
    chat-encoded as the ground truth. Ids are "<split>:<index>"."""
    from data.chat import encode_chat, encode_prompt
    from data.datasets import load_conversations

    samples = []
    for index, conv in enumerate(load_conversations(data_cfg, split)):
        user = next((i for i, m in enumerate(conv) if m["role"] == "user"), None)
        if user is None:
            continue
        prompt = encode_prompt(tokenizer, conv[: user + 1], chat_template=data_cfg.chat_template)
        answer_ids, answer_labels = (), ()
        if user + 1 < len(conv) and conv[user + 1]["role"] == "assistant":
            encoded = encode_chat(tokenizer, conv[: user + 2], data_cfg.max_length, data_cfg.chat_template)
            answer_ids, answer_labels = tuple(encoded.input_ids), tuple(encoded.labels)
        samples.append(PromptSample(f"{split}:{index}", tuple(prompt), answer_ids, answer_labels))
        if max_prompts is not None and len(samples) == max_prompts:
            break
    return samples


# --- training side -------------------------------------------------------------------------------------------------

def read_records(path: str | Path, vocab_size: int | None = None) -> list[dict[str, Any]]:
    """Trajectory records of `path` (dropped ones excluded). A line that is not a record (malformed JSON, a missing
    or mistyped field, a token id outside [0, vocab_size)) raises DataError "<file>:<line>: <reason>". UTF-8 with or
    without a byte-order mark, LF or CRLF line ends."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: trajectory file not found (write it with `python -m data.jacobi`)")
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    records = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)  # bytes: decoded as UTF-8; a trailing \r is JSON whitespace
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: malformed JSON line: {e.msg} (column {e.colno})") from None
        except UnicodeDecodeError:
            raise DataError(f"{path}:{number}: non-UTF-8 bytes") from None
        problem = record_problem(record, vocab_size)
        if problem:
            raise DataError(f"{path}:{number}: not a trajectory record: {problem}")
        if record["blocks"]:
            records.append(record)
    return records


def record_problem(record: Any, vocab_size: int | None) -> str | None:
    """What makes `record` unusable as a trajectory record (see the module docstring for the format), or None."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    missing = [key for key in ("prompt_ids", "answer_ids", "answer_labels", "blocks") if key not in record]
    if missing:
        return f"missing field {missing[0]!r}"
    if not isinstance(record["blocks"], list):
        return f"'blocks' must be a list, got {type(record['blocks']).__name__}"
    sequences = {key: record[key] for key in ("prompt_ids", "answer_ids", "answer_labels")}
    for j, block in enumerate(record["blocks"]):
        states = block.get("states") if isinstance(block, dict) else None
        if not isinstance(states, list) or not states:
            return f"blocks[{j}] must be an object with a non-empty 'states' list"
        sequences.update({f"blocks[{j}].states[{k}]": state for k, state in enumerate(states)})
    for where, ids in sequences.items():
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return f"{where} must be a list of token ids"
        allowed = (IGNORE_INDEX,) if where == "answer_labels" else ()
        bad = next((t for t in ids if t not in allowed and (t < 0 or (vocab_size is not None and t >= vocab_size))),
                   None)
        if bad is not None:
            span = f"the tokenizer's vocabulary (0..{vocab_size - 1})" if vocab_size is not None else "0.."
            return f"token id {bad} in {where} is outside {span}"
    if not record["prompt_ids"]:
        return "prompt_ids is empty"
    if len(record["answer_ids"]) != len(record["answer_labels"]):
        return "answer_ids and answer_labels differ in length"
    for j, block in enumerate(record["blocks"]):
        if len({len(s) for s in block["states"]}) != 1 or not block["states"][0]:
            return f"blocks[{j}]: states are empty or differ in length"
    return None


class TrajectoryDataset(torch.utils.data.Dataset):
    """One item per (record, block, state before the fixed point): the block's prefix, that state, the next state,
    the fixed point, and the AR sequence (`ar_source`: the dataset's reply, or the target's own greedy answer =
    the concatenated fixed points; labels on the answer only). With `both`, ar_ids/ar_labels hold the reply and
    ar_self_ids/ar_self_labels the target's answer (a record without a reply has only the latter, as ar_ids)."""

    def __init__(self, records: Sequence[dict[str, Any]], ar_source: str = "target_output") -> None:
        if ar_source not in AR_SOURCES:
            raise ValueError(f"ar_source must be one of {', '.join(AR_SOURCES)}, got {ar_source!r}")
        self.records = list(records)
        self.ar_source = ar_source
        self.index = [(r, j, k) for r, rec in enumerate(self.records) for j, block in enumerate(rec["blocks"])
                      for k in range(max(len(block["states"]) - 1, 1))]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        r, j, k = self.index[i]
        record = self.records[r]
        states = record["blocks"][j]["states"]
        fixed = [list(b["states"][-1]) for b in record["blocks"]]
        prefix = record["prompt_ids"] + [t for f in fixed[:j] for t in f]
        answer = [t for f in fixed for t in f]
        own = (record["prompt_ids"] + answer, [IGNORE_INDEX] * len(record["prompt_ids"]) + answer)
        truth = (record["answer_ids"], record["answer_labels"]) if record["answer_ids"] else None
        item = {"prefix": prefix, "state": states[k], "next_state": states[min(k + 1, len(states) - 1)],
                "fixed_point": states[-1]}
        first = own if self.ar_source == "target_output" or truth is None else truth
        item["ar_ids"], item["ar_labels"] = first
        if self.ar_source == "both" and truth is not None:
            item["ar_self_ids"], item["ar_self_labels"] = own
        return item


@dataclass(frozen=True)
class TrajectoryCollator:
    """Right-padded LongTensors: input_ids = prefix + state, next_ids = prefix + next state, fixed_ids = prefix +
    fixed point (all [B, T], sharing attention_mask), block_start [B] = prefix lengths; ar_input_ids /
    ar_attention_mask / ar_labels [B + B', T'] for the AR term: every item's AR row, then the B' second rows
    (ar_source=both)."""

    pad_token_id: int

    def __call__(self, items: Sequence[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        def pad(rows: list[list[int]], value: int) -> torch.Tensor:
            width = max(map(len, rows))
            return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)

        lengths = {len(it["state"]) for it in items}
        if len(lengths) != 1:
            raise ValueError(f"one batch mixes block sizes {sorted(lengths)}; collect with a single --block-size")
        seq = {key: [it["prefix"] + it[key] for it in items] for key in ("state", "next_state", "fixed_point")}
        ar_ids = [it["ar_ids"] for it in items] + [it["ar_self_ids"] for it in items if "ar_self_ids" in it]
        ar_labels = [it["ar_labels"] for it in items] + [it["ar_self_labels"] for it in items if "ar_self_ids" in it]
        return {
            "input_ids": pad(seq["state"], self.pad_token_id),
            "next_ids": pad(seq["next_state"], self.pad_token_id),
            "fixed_ids": pad(seq["fixed_point"], self.pad_token_id),
            "attention_mask": pad([[1] * len(s) for s in seq["state"]], 0),
            "block_start": torch.tensor([len(it["prefix"]) for it in items]),
            "ar_input_ids": pad(ar_ids, self.pad_token_id),
            "ar_attention_mask": pad([[1] * len(ids) for ids in ar_ids], 0),
            "ar_labels": pad(ar_labels, IGNORE_INDEX),
        }


# --- command line --------------------------------------------------------------------------------------------------

def data_config(name: str, overrides: Sequence[str]) -> Any:
    """conf/data/<name>.yaml + `data.key=value` overrides, checked against train.config.DataConfig."""
    from importlib import resources

    from omegaconf import OmegaConf

    from train.config import DataConfig

    path = resources.files("conf").joinpath("data", f"{name}.yaml")
    if not path.is_file():
        raise ValueError(f"--data {name}: no conf/data/{name}.yaml")
    for o in overrides:
        if not o.startswith("data.") or "=" not in o:
            raise ValueError(f"{o!r}: overrides look like data.<key>=<value>")
    dotlist = [o[len("data."):] for o in overrides]
    return OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(str(path)), OmegaConf.from_dotlist(dotlist))


def main(argv: list[str] | None = None) -> int:
    from inference.jacobi import INITS, JacobiOptions

    parser = argparse.ArgumentParser(prog="python -m data.jacobi", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="conf/model name, model directory or builtin:<name>")
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--data", default="default", help="conf/data name; override keys as data.key=value")
    parser.add_argument("--split", default="train", choices=("train", "validation"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--init", default="random", choices=INITS)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="rounded up to whole blocks")
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-repeat", type=int, default=16, help="drop from a run this long of one token (0: off)")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="data.key=value")
    args = parser.parse_args(argv)
    from omegaconf.errors import OmegaConfBaseException

    from data.readers import DataError
    from models.loading import ModelLoadError, load_target, load_tokenizer, model_settings

    try:
        options = JacobiOptions(block_size=args.block_size, init=args.init, seed=args.seed)
        cfg = data_config(args.data, args.overrides)
        path = model_settings(args.model)["path"]
        tokenizer = load_tokenizer(path, cfg.chat_template)
        samples = prompt_samples(cfg, tokenizer, args.split, args.max_prompts)
        model = load_target(path, dtype=args.dtype)
        eos = model.config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        written = collect(model, samples, args.output, options, -(-args.max_new_tokens // args.block_size),
                          args.batch_size, tokenizer.pad_token_id or 0, eos_ids, args.max_repeat)
    except (ValueError, DataError, ModelLoadError, OSError, OmegaConfBaseException) as e:
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    print(f"{written} new records -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
