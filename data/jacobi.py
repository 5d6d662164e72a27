"""Jacobi trajectories for CLLM (Kou et al. 2024): the JSONL format, the prompts, the training dataset and collator.

    python scripts/collect_jacobi.py --model tiny --output traj.jsonl [--data default] [--block-size 16] [data.path=...]

The collector that runs the target is inference.collect.jacobi_trajectories (beside inference.collect.self_distill, the
other collector); data/ imports no model code, so the command line lives there.

One JSONL line per prompt (a `datasets.load_dataset("json", ...)`-loadable file):
    {"id", "prompt_ids", "answer_ids", "answer_labels", "block_size", "init",
     "blocks": [{"states": [[N ids], ...]}, ...],   # every Jacobi state of a block; states[-1] is its fixed point
     "dropped": null | reason}
Block j's prefix is prompt_ids + the fixed points of blocks 0..j-1; the fixed points together are the target's
greedy answer. answer_ids / answer_labels are the dataset's own reply (chat-encoded, labels on assistant tokens;
empty without a reply). Degenerate generations (a run of `max_repeat` identical tokens) keep the blocks before the
run; a record with none left is written with "dropped" set, so a resumed collection skips it too.

Resuming (the collector's, through inference.collect.shared): ids already written are skipped; a torn last line (an
interrupted write) is cut off first.
Dimension letters: B batch, T time, N block size.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch.utils.data

from data.chat import IGNORE_INDEX, encode_chat, encode_prompt, first_user_turn
from data.datasets import load_conversations
from data.readers import DataError

AR_SOURCES = ("ground_truth", "target_output", "both")  # both: one row of each per item (ground truth first)


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


def prompt_samples(data_cfg: Any, tokenizer: Any, split: str = "train", max_prompts: int | None = None
                   ) -> list[PromptSample]:
    """The first user turn of each conversation of a `data` config as a prompt, with the reply after it (if any)
    chat-encoded as the ground truth. Ids are "<split>:<index>"."""
    samples = []
    for index, conv in enumerate(load_conversations(data_cfg, split)):
        turn = first_user_turn(conv)
        if turn is None:
            continue
        user = len(turn) - 1
        prompt = encode_prompt(tokenizer, turn, chat_template=data_cfg.chat_template)
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
        raise FileNotFoundError(f"{path}: trajectory file not found (write it with `python scripts/collect_jacobi.py`)")
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


def draws(block: dict[str, Any]) -> int:
    """A block's training states: those before its fixed point, or the fixed point alone (converged at once)."""
    return max(len(block["states"]) - 1, 1)


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
                      for k in range(draws(block))]

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


# --- packed training rows: one forward per (record, draw) instead of one per state -------------------------------

class PackedTrajectoryDataset(torch.utils.data.Dataset):
    """One item per (record, draw d): the prompt, the target's greedy answer (the concatenated fixed points) and one
    state of EVERY block, block j's state d mod n_j (n_j = its states before the fixed point, at least 1), so the
    record's draws together show every state at least once. PackedTrajectoryCollator lays an item out as one row.
    ar_source as TrajectoryDataset: target_output trains the AR term on the answer inside the packed row,
    ground_truth on an extra row with the dataset's reply (a record without one falls back to the answer), both on
    the two."""

    def __init__(self, records: Sequence[dict[str, Any]], ar_source: str = "target_output") -> None:
        if ar_source not in AR_SOURCES:
            raise ValueError(f"ar_source must be one of {', '.join(AR_SOURCES)}, got {ar_source!r}")
        self.records = list(records)
        self.ar_source = ar_source
        self.index = [(r, d) for r, rec in enumerate(self.records)
                      for d in range(max(draws(b) for b in rec["blocks"]))]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        r, d = self.index[i]
        record = self.records[r]
        states = [list(b["states"][d % draws(b)]) for b in record["blocks"]]
        answer = [t for b in record["blocks"] for t in b["states"][-1]]
        has_truth = bool(record["answer_ids"])
        item = {"prompt_ids": list(record["prompt_ids"]), "answer_ids": answer, "states": states,
                "ar_on_answer": self.ar_source != "ground_truth" or not has_truth}
        if self.ar_source != "target_output" and has_truth:
            item["truth_ids"], item["truth_labels"] = list(record["answer_ids"]), list(record["answer_labels"])
        return item


@dataclass(frozen=True)
class PackedTrajectoryCollator:
    """PackedTrajectoryDataset items -> right-padded rows sharing one forward. A packed row (prompt length P, J
    blocks of N, answer length L = J·N) is

        prompt + answer | state_0[:N-1] | state_1[:N-1] | ... | state_{J-1}[:N-1]

    The first P + L tokens are causal; block j's state tokens sit at the positions of block j (P + jN + m) and see
    the prompt, the answer before block j (its fixed-point prefix) and the earlier tokens of their own state. The
    state's last token predicts nothing inside the block, so it is left out. Then one forward gives
      - the global-consistency teacher, the logits predicting block j given the fixed points before it
        (teacher_index: P + jN - 1 + i), and the student, the logits predicting it from the state (student_index:
        token 0 from the prefix, as the teacher; token i > 0 from state token i - 1),
      - the AR term on the answer (ar_targets, the token each position predicts; IGNORE_INDEX elsewhere),
    exactly as the unpacked rows prefix + state / prefix + fixed point / prompt + answer would. Reply rows
    (ar_source ground_truth / both) follow the packed rows, causal, with no blocks.

    Tensors: input_ids, position_ids, ar_targets [R, T]; visible [R, T, T] bool (query, key); teacher_index and
    student_index [R, J, N] into T; block_valid [R, J]. Padded queries see only themselves."""

    pad_token_id: int

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sizes = {len(s) for it in items for s in it["states"]}
        if len(sizes) != 1:
            raise ValueError(f"one batch mixes block sizes {sorted(sizes)}; collect with a single --block-size")
        n = sizes.pop()
        rows = [self.packed_row(it, n) for it in items]
        rows += [self.reply_row(it["truth_ids"], it["truth_labels"]) for it in items if "truth_ids" in it]
        width = max(len(r["ids"]) for r in rows)
        blocks = max(len(r["teacher"]) for r in rows) or 1
        batch = {
            "input_ids": torch.full((len(rows), width), self.pad_token_id, dtype=torch.long),
            "position_ids": torch.zeros(len(rows), width, dtype=torch.long),
            "ar_targets": torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long),
            "visible": torch.eye(width, dtype=torch.bool).repeat(len(rows), 1, 1),
            "teacher_index": torch.zeros(len(rows), blocks, n, dtype=torch.long),
            "student_index": torch.zeros(len(rows), blocks, n, dtype=torch.long),
            "block_valid": torch.zeros(len(rows), blocks, dtype=torch.bool),
        }
        for b, row in enumerate(rows):
            t, j = len(row["ids"]), len(row["teacher"])
            batch["input_ids"][b, :t] = torch.tensor(row["ids"])
            batch["position_ids"][b, :t] = torch.tensor(row["positions"])
            batch["ar_targets"][b, :t] = torch.tensor(row["targets"])
            batch["visible"][b, :t, :t] = row["visible"]
            if j:
                batch["teacher_index"][b, :j] = torch.tensor(row["teacher"])
                batch["student_index"][b, :j] = torch.tensor(row["student"])
                batch["block_valid"][b, :j] = True
        return batch

    @staticmethod
    def packed_row(item: dict[str, Any], n: int) -> dict[str, Any]:
        prompt, answer, states = item["prompt_ids"], item["answer_ids"], item["states"]
        p, length, blocks = len(prompt), len(answer), len(states)
        head = p + length  # prompt + answer: the causal part
        ids = prompt + answer + [t for s in states for t in s[: n - 1]]
        positions = list(range(head)) + [p + j * n + m for j in range(blocks) for m in range(n - 1)]
        targets = [IGNORE_INDEX] * len(ids)
        if item["ar_on_answer"]:
            targets[p - 1 : head - 1] = answer
        visible = torch.zeros(len(ids), len(ids), dtype=torch.bool)
        visible[:head, :head] = torch.ones(head, head, dtype=torch.bool).tril()
        own = torch.ones(n - 1, n - 1, dtype=torch.bool).tril()
        teacher, student = [], []
        for j in range(blocks):
            start, base = p + j * n, head + j * (n - 1)  # block j's first position; its state's first row
            visible[base : base + n - 1, :start] = True
            visible[base : base + n - 1, base : base + n - 1] = own
            teacher.append([start - 1 + i for i in range(n)])
            student.append([start - 1] + [base + i - 1 for i in range(1, n)])
        return {"ids": ids, "positions": positions, "targets": targets, "visible": visible, "teacher": teacher,
                "student": student}

    @staticmethod
    def reply_row(ids: list[int], labels: list[int]) -> dict[str, Any]:
        return {"ids": ids, "positions": list(range(len(ids))), "targets": labels[1:] + [IGNORE_INDEX],
                "visible": torch.ones(len(ids), len(ids), dtype=torch.bool).tril(), "teacher": [], "student": []}


if __name__ == "__main__":  # the collector runs the target, and data/ imports no model code: say where it is
    raise SystemExit("python -m data.jacobi: this module is the trajectory format; collect with "
                     "`python scripts/collect_jacobi.py --model <name> --output traj.jsonl ...` "
                     "(the same as `python -m inference.collect.jacobi_trajectories ...`)")
