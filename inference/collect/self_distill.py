"""Self-distillation data: the target's own answers to a dataset's prompts, written as ShareGPT JSONL that
`data=sharegpt` reads (Medusa paper §2.3.3: train Medusa-2 on what the model itself says, so the heads learn its
distribution and the LM loss does not pull the backbone towards another model's answers).

Each conversation keeps its system and user turns; every assistant turn is regenerated in order, turn j seeing the
model's own answers to the turns before it (a trailing user turn gets an answer too). Generation goes through the
draftsmith engine (inference.api.Engine: plain decoding, or lossless speculative decoding with a drafter), batched over
conversations at the same turn (sorted by the length of their first prompt, longest first), left-padded.

Resumable: each finished conversation is appended as one line {"id", "conversations", "finish"}; a restart skips the
ids already in the file (a torn last line from a crash is cut off first). Ids are "<file name>:<record number>", and
"<file name>:<record number>_<n>" for a further sampled answer to the same prompt (`--answer-index n`): data.dedupe
keeps it beside the first, and the validation split puts it where the first one goes (data.datasets.split_key).
Conversations whose regenerated answer is empty are not written (the ShareGPT reader rejects empty turns). A
conversation whose first prompt is over max_prompt_tokens is not answered; one whose later prompt grows over it ends
with the answers made before that turn.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

from data.chat import Conversation, encode_prompt
from data.readers import DataError, read_conversations
from data.templates import ChatTemplateError
from inference.api import load
from inference.collect.shared import RankFiles, World, claim, done_ids, merge, rank_device, share, wait_until_done
from models.backbone import eos_token_ids
from models.checkpoint import CheckpointError
from models.loading import ModelLoadError, load_tokenizer
from models.refs import model_settings

log = logging.getLogger("draftsmith.self_distill")

SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


@dataclass(frozen=True)
class SelfDistillConfig:
    max_new_tokens: int = 512
    batch_size: int = 8
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    max_turns: int | None = None  # regenerate at most this many assistant turns per conversation (None: all)
    max_prompt_tokens: int = 2048  # a first prompt longer drops the conversation; a later one ends it there (counted)
    chat_template: str | None = None  # data.templates name or Jinja string; None: the tokenizer's own
    seed: int = 0


@dataclass(frozen=True)
class DistillStats:
    written: int
    already_done: int
    too_long: int  # conversations whose first prompt is over max_prompt_tokens (not written)
    empty: int
    truncated_turns: int  # answers cut by max_new_tokens (kept, marked "length" in "finish")
    shortened: int = 0  # conversations ended before a later turn whose prompt is over max_prompt_tokens (written)


@dataclass
class _Row:
    id: str
    script: Conversation  # the original without assistant contents: slots to fill, in order
    messages: Conversation  # what has been produced so far
    finish: list[str]  # per answer: "stop" (EOS) or "length" (max_new_tokens)
    next: int = 0  # index into script of the next message to append
    dropped: bool = False  # its first prompt is over max_prompt_tokens: not written


def record_id(source: str) -> str:
    """"<path>:<record>" (data.readers source) -> "<file name>:<record>": stable when the folder moves."""
    where, _, record = source.rpartition(":")
    return f"{Path(where).name}:{record}"


def answer_id(record: str, index: int) -> str:
    """The id of answer `index` to prompt `record`: the record's own id for the first answer (0), else
    "<record>_<index>", which data.datasets.split_key maps back to the record (one split for all its answers)."""
    if index < 0:
        raise ValueError(f"answer index must be >= 0, got {index}")
    return record if index == 0 else f"{record}_{index}"


def script_of(conversation: Conversation, max_turns: int | None = None) -> Conversation:
    """The messages to replay: assistant turns become empty slots; a trailing user turn gets a slot; cut after
    `max_turns` slots."""
    script: Conversation = []
    slots = 0
    for message in conversation:
        if message["role"] == "assistant":
            if not script or script[-1]["role"] == "assistant":
                continue  # an answer without a question before it
            script.append({"role": "assistant", "content": ""})
            slots += 1
            if max_turns is not None and slots >= max_turns:
                return script
        else:
            script.append(dict(message))
    if script and script[-1]["role"] != "assistant" and (max_turns is None or slots < max_turns):
        script.append({"role": "assistant", "content": ""})
    return script


def sharegpt_record(row: _Row) -> dict[str, Any]:
    turns = [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in row.messages]
    return {"id": row.id, "conversations": turns, "finish": row.finish}


def self_distill(
    engine: Any,
    tokenizer: Any,
    conversations: list[tuple[str, Conversation]],
    output: Path,
    config: SelfDistillConfig = SelfDistillConfig(),
    progress: Callable[[int], Any] | None = None,
    on_skip: Callable[[str, str], Any] | None = None,
) -> DistillStats:
    """Regenerate the assistant turns of `conversations` ((id, conversation) pairs) with `engine`
    (an inference.api.Engine) and append them to `output`, skipping ids already there. `progress(n)` is told of
    every n tokens generated, as they come (a tqdm bar's update); `on_skip(id, reason)` of every conversation not
    written (its first prompt too long, an empty answer), once its batch is done."""
    output.parent.mkdir(parents=True, exist_ok=True)
    done = done_ids(output)
    todo = [_Row(id=i, script=script_of(c, config.max_turns), messages=[], finish=[]) for i, c in conversations
            if i not in done]
    todo = by_prompt_length(todo, tokenizer, config.chat_template)
    eos = set(_eos_ids(engine.model, tokenizer))
    written = too_long = empty = truncated = shortened = 0
    with open(output, "a", encoding="utf-8") as out:
        for start in range(0, len(todo), config.batch_size):
            rows = todo[start : start + config.batch_size]
            while True:  # one turn of every row that still has an answer due
                active, prompts = [], []
                for row in rows:
                    if row.dropped or not _advance(row):
                        continue
                    ids = encode_prompt(tokenizer, row.messages, chat_template=config.chat_template)
                    if len(ids) > config.max_prompt_tokens:
                        if row.finish:  # answers made already: the conversation ends after the last of them
                            row.messages = row.messages[: _after_last_answer(row.messages)]
                            row.next = len(row.script)  # nothing left to replay
                            shortened += 1
                        else:
                            row.dropped = True
                            too_long += 1
                        continue
                    active.append(row)
                    prompts.append(ids)
                if not active:
                    break
                result = engine.generate(prompts, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                         top_k=config.top_k, top_p=config.top_p, seed=config.seed + start,
                                         stream=None if progress is None else _counting(progress))
                for row, tokens in zip(active, result.sequences):
                    stopped = bool(tokens) and tokens[-1] in eos
                    truncated += not stopped
                    text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
                    row.messages.append({"role": "assistant", "content": text})
                    row.finish.append("stop" if stopped else "length")
                    row.next += 1
            skipped = []
            for row in rows:
                if row.dropped:
                    skipped.append((row.id, "its first prompt is over max_prompt_tokens"))
                    continue
                if any(m["role"] == "assistant" and not m["content"] for m in row.messages):
                    skipped.append((row.id, "an empty answer"))
                    empty += 1
                    continue
                out.write(json.dumps(sharegpt_record(row), ensure_ascii=False) + "\n")
                written += 1
            out.flush()
            os.fsync(out.fileno())
            for row_id, reason in skipped if on_skip is not None else ():
                on_skip(row_id, reason)
            log.info("%d / %d conversations done", min(start + config.batch_size, len(todo)), len(todo))
    return DistillStats(written=written, already_done=len(conversations) - len(todo), too_long=too_long, empty=empty,
                        truncated_turns=truncated, shortened=shortened)


def by_prompt_length(rows: list[_Row], tokenizer: Any, chat_template: str | None) -> list[_Row]:
    """`rows` sorted by the length of their first prompt, longest first (ties keep their order): a batch then holds
    prompts of about one length, so left padding wastes little, and a batch too long for memory fails first.
    Deterministic, so a resumed run meets the same batches."""
    def first_prompt_length(row: _Row) -> int:
        slot = next((i for i, m in enumerate(row.script) if m["role"] == "assistant"), len(row.script))
        head = row.script[:slot]  # the messages before the first answer
        return len(encode_prompt(tokenizer, head, chat_template=chat_template)) if head else 0

    lengths = [first_prompt_length(row) for row in rows]
    return [rows[i] for i in sorted(range(len(rows)), key=lambda i: (-lengths[i], i))]


def _counting(progress: Callable[[int], Any]) -> Callable[[int, list[int]], None]:
    """An engine stream callback that tells `progress` how many tokens arrived (and never asks to stop)."""
    def stream(row: int, new: list[int]) -> None:
        progress(len(new))
    return stream


def _after_last_answer(messages: Conversation) -> int:
    """The length of `messages` up to and including its last assistant message."""
    return max(i for i, m in enumerate(messages) if m["role"] == "assistant") + 1


def _advance(row: _Row) -> bool:
    """Copy the script's next non-assistant messages into `row.messages`; True when an answer is due."""
    while row.next < len(row.script) and row.script[row.next]["role"] != "assistant":
        row.messages.append(row.script[row.next])
        row.next += 1
    return row.next < len(row.script)


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """The model's EOS ids and the tokenizer's (a chat model may end a turn with either)."""
    return [*eos_token_ids(model), *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python scripts/self_distill.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="conf/model name (e.g. vicuna7b), local directory, hub id or builtin:<name>")
    p.add_argument("--data", required=True, help="prompts: a file / folder / hub dataset (see data.readers)")
    p.add_argument("--format", default="sharegpt", choices=("sharegpt", "alpaca", "gsm8k"))
    p.add_argument("--output", required=True, type=Path, help="ShareGPT JSONL, appended to (resumable)")
    p.add_argument("--drafter", default=None, help="a draftsmith drafter checkpoint: lossless speculative decoding")
    p.add_argument("--max-new-tokens", type=int, default=SelfDistillConfig.max_new_tokens)
    p.add_argument("--batch-size", type=int, default=SelfDistillConfig.batch_size)
    p.add_argument("--temperature", type=float, default=SelfDistillConfig.temperature)
    p.add_argument("--top-k", type=int, default=SelfDistillConfig.top_k)
    p.add_argument("--top-p", type=float, default=SelfDistillConfig.top_p)
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--max-prompt-tokens", type=int, default=SelfDistillConfig.max_prompt_tokens)
    p.add_argument("--max-samples", type=int, default=None, help="only the first N conversations")
    p.add_argument("--chat-template", default=None)
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: the conf/model's, else bf16)")
    p.add_argument("--quantization", default=None, choices=(None, "nf4"))
    p.add_argument("--device", default=None, help="default: the rank's GPU when CUDA is available, else cpu")
    p.add_argument("--on-error", default="raise", choices=("raise", "skip"), help="bad input records")
    p.add_argument("--answer-index", type=int, default=0,
                   help="n > 0: a further sampled answer to every prompt (needs --temperature > 0), written with ids "
                        "'<id>_<n>' beside the first answers' ids: cache both answer files in one folder")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the answer index)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The offline tool. Under a launcher (RANK / WORLD_SIZE) the ranks share the conversations through files beside
    --output (inference.collect.shared): rank r answers into `<stem>.rank{r:03d}.jsonl`, rank 0 merges them into
    --output once every conversation is answered or skipped; resumable under any world size."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.answer_index < 0:
        print(f"error: --answer-index must be >= 0, got {args.answer_index}", file=sys.stderr)
        return 2
    if args.answer_index > 0 and args.temperature <= 0:
        print(f"error: --answer-index {args.answer_index} needs --temperature > 0: a second greedy answer repeats the "
              "first", file=sys.stderr)
        return 2
    settings = model_settings(args.model)
    config = SelfDistillConfig(
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, max_turns=args.max_turns, max_prompt_tokens=args.max_prompt_tokens,
        chat_template=args.chat_template or settings.chat_template,
        seed=args.answer_index if args.seed is None else args.seed,
    )
    try:
        world = World.from_env()
        records = read_conversations(args.data, args.format, on_error=args.on_error)
        conversations = [(answer_id(record_id(s), args.answer_index), c)
                         for s, c in zip(records.sources, records.conversations)][: args.max_samples]
        tokenizer = load_tokenizer(settings.ref, config.chat_template)
        engine = load(args.drafter, base=settings.path, dtype=args.dtype or settings.dtype or "bf16",
                      device=args.device or str(rank_device()), quantization=args.quantization)
        files = RankFiles(args.output.parent, prefix=f"{args.output.stem}.")
        ids = [i for i, _ in conversations]
        done = claim(files, world, also=[args.output])
        mine = [conversations[i] for i in share(ids, world, done)]
        stats = self_distill(engine, tokenizer, mine, files.records(world.rank), config,
                             on_skip=partial(files.skip, world.rank))
        if world.rank == 0:
            wait_until_done(files, ids, also=[args.output])
            merge(files, args.output, ids)
    except (DataError, ChatTemplateError, CheckpointError, ModelLoadError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    where = args.output if world.rank == 0 else files.records(world.rank)
    print(f"{where}: {stats.written} conversations written, {sum(i in done for i in ids)} already done, "
          f"{stats.too_long} over --max-prompt-tokens, {stats.empty} with an empty answer (not written), "
          f"{stats.truncated_turns} answers cut at --max-new-tokens, {stats.shortened} ended before a later turn "
          f"over --max-prompt-tokens", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
