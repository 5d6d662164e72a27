"""Curation of read records, before the split and encoding: repeats and contaminated train conversations dropped.

dedupe (data.dedupe): a record whose id, or whose conversation (roles and texts after normalisation), an earlier
record had is dropped; the first one stays. It runs before the split, so no repeat straddles train and validation.
decontaminate (data.decontaminate): a train conversation whose first user turn asks an evaluation prompt
(data.eval_sets: MT-bench, GSM8K test, HumanEval) is dropped, so benchmark figures measure unseen prompts.
Both count their drops in the result's RecordStats (`duplicate`, `decontaminated`; `kept` goes down to match).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from data.chat import first_user_turn
from data.eval_sets import EvalPrompts
from data.readers import ReadResult


def dedupe(result: ReadResult) -> ReadResult:
    """The records of `result` minus those repeating an earlier record's id or conversation."""
    seen_ids: set[str] = set()
    seen_conversations: set[bytes] = set()
    keep = []
    for i, (record_id, conversation) in enumerate(zip(result.ids, result.conversations)):
        digest = hashlib.sha256(json.dumps(conversation, ensure_ascii=False).encode("utf-8", "surrogatepass")).digest()
        if record_id in seen_ids or digest in seen_conversations:
            continue
        keep.append(i)
        seen_conversations.add(digest)
        if record_id is not None:
            seen_ids.add(record_id)
    return _dropped(result, keep, "duplicate")


def decontaminate(result: ReadResult, prompts: EvalPrompts) -> ReadResult:
    """The records of `result` minus those whose first user turn asks one of `prompts`."""
    keep = [i for i, conversation in enumerate(result.conversations) if not _asks(conversation, prompts)]
    return _dropped(result, keep, "decontaminated")


def _asks(conversation: list[dict[str, str]], prompts: EvalPrompts) -> bool:
    turn = first_user_turn(conversation)
    return turn is not None and prompts.matches(turn[-1]["content"])


def _dropped(result: ReadResult, keep: list[int], reason: str) -> ReadResult:
    n = len(result.conversations) - len(keep)
    if not n:
        return result
    stats = replace(result.stats, kept=result.stats.kept - n, **{reason: getattr(result.stats, reason) + n})
    return replace(result.select(keep), stats=stats)
