"""`python -m inference generate | bench | build-tree`: the engine from the command line.

Every subcommand loads a `Session` the same way (inference.session: a base model, a drafter and a tokenizer).
`--drafter` is whatever `inference.api.load` serves, so a drafter registered there is on the command line with no
change here:
    a draftsmith checkpoint directory   config.json names the drafter type (registry.DRAFTERS) and the base model
    a plain causal LM (dir, builtin:..)  a draft model for --base; early_exit:<model>:<N> is <model>'s first N layers
    a registered name (registry.DRAFTERS: jacobi, lookahead, prompt_lookup), optionally "name:k=v,...";
                                        --drafter-option KEY=VALUE pairs are appended to that spec
    none (the default)                  plain autoregressive decoding through the same loop

Bad input ends in one line `error: ...` on stderr and exit status 2, with nothing written (DRAFTSMITH_TRACEBACK=1
shows the traceback instead).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from data.errors import UsageError
from inference.bench.run import add_bench_args
from inference.bench.tree_fit import add_build_tree_args
from inference.engine.context import check_context
from inference.engine.loop import TREE_SLOTS
from inference.engine.static import check_slots
from inference.session import (EXIT_USAGE, TRACEBACK_ENV, Parser, add_model_args, add_sampling_args, check_sampling,
                               encode_messages, one_line, open_session)
from inference.textstream import TextStream


def read_chat(value: str) -> list[dict[str, str]]:
    """--chat: a JSON file or a JSON literal; a list of {"role", "content"} messages, {"messages": [...]}, or a
    list of strings (alternating user / assistant turns, starting with the user)."""
    path = Path(value)
    where = f"--chat {value}" if len(value) < 60 else "--chat"
    if not path.is_file() and not value.lstrip().startswith(("[", "{")):  # neither a file nor JSON: a missing file
        raise UsageError(f"--chat {value}: no such file (pass a JSON file, or the JSON list itself)")
    try:
        text = path.read_text(encoding="utf-8-sig") if path.is_file() else value
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: line {e.lineno}: not valid JSON ({e.msg}); pass a file or a JSON list") from None
    if isinstance(data, dict):
        data = data.get("messages")
    if not isinstance(data, list) or not data:
        raise UsageError(f"{where}: expected a non-empty list of messages or strings")
    messages = []
    for i, turn in enumerate(data):
        if isinstance(turn, str):
            turn = {"role": "user" if i % 2 == 0 else "assistant", "content": turn}
        if not isinstance(turn, dict) or turn.get("role") not in ("system", "user", "assistant") \
                or not isinstance(turn.get("content"), str):
            raise UsageError(f"{where}: message {i}: expected {{\"role\": system|user|assistant, \"content\": str}}")
        messages.append({"role": turn["role"], "content": turn["content"]})
    return messages


def build_parser() -> Parser:
    parser = Parser(prog="python -m inference", description="draftsmith inference engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    gen = sub.add_parser("generate", help="generate from a prompt, streaming text to stdout",
                         description="Generate from --prompt or --chat; streams text to stdout, stats to stderr.")
    add_model_args(gen)
    add_sampling_args(gen, max_new_tokens=128)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one user message (chat-formatted unless --raw); '-' reads stdin")
    source.add_argument("--chat", help="a conversation: JSON file or literal (messages or alternating strings)")
    gen.add_argument("--system", help="system message prepended to --prompt")
    gen.add_argument("--raw", action="store_true", help="use --prompt as plain text, without the chat template")
    gen.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")
    gen.set_defaults(func=run_generate)
    add_bench_args(sub.add_parser("bench", help="MT-bench / Spec-Bench style benchmark against plain decoding"))
    add_build_tree_args(sub.add_parser("build-tree", help="measure head accuracy and verify cost, write a tree"))
    return parser


def run_generate(args: argparse.Namespace) -> int:
    check_sampling(args)
    if any(not s for s in args.stop):
        raise UsageError("--stop: a stop string must not be empty")
    if args.raw and args.chat is not None:
        raise UsageError("--raw applies to --prompt, not --chat")
    messages = read_chat(args.chat) if args.chat is not None else None  # bad input fails before loading a model
    session = open_session(args)
    if messages is not None:
        prompt_ids = encode_messages(session, messages, raw_hint=True)
    else:
        text = sys.stdin.read() if args.prompt == "-" else args.prompt
        if args.raw:
            prompt_ids = list(session.tokenizer(text)["input_ids"])
        else:
            system = [{"role": "system", "content": args.system}] if args.system else []
            prompt_ids = encode_messages(session, [*system, {"role": "user", "content": text}], raw_hint=True)
    if not prompt_ids:
        raise UsageError("the prompt encodes to no tokens")
    check_context(session.engine.model.config, len(prompt_ids), args.max_new_tokens, "--max-new-tokens", session.base)
    if session.engine.compile or session.engine.static_cache:
        check_slots(session.engine.cache_slots, len(prompt_ids), args.max_new_tokens, TREE_SLOTS, "--cache-slots ")
    emit = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    stream = TextStream(session.tokenizer, args.stop, emit)
    out = session.engine.generate(
        prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, acceptance=args.acceptance, stop=session.engine.stop_ids(args.stop),
        ignore_eos=args.ignore_eos, stream=stream, seed=args.seed,
    )
    text, token_ids = stream.finish(out.sequences[0])
    stats = stats_dict(out.stats)
    if args.json:
        print(json.dumps({"text": text, "token_ids": token_ids, "prompt_tokens": len(prompt_ids),
                          "drafter": session.drafter_name, "base": session.base, "stats": stats}))
    else:
        sys.stdout.write("\n")
        print(f"[{stats['new_tokens']} tokens, {stats['target_forwards']} target forwards, tau {stats['tau']:.2f}, "
              f"{stats['tokens_per_s']:.1f} tok/s; per step (ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in stats["per_step_ms"].items()) + "]", file=sys.stderr)
    return 0


def stats_dict(stats: Any) -> dict[str, Any]:
    """GenerationStats as JSON: tau = new tokens per target forward (prefill included)."""
    times, per_step = stats.times, stats.per_step()
    phases = ("draft", "forward", "verify", "cache", "other")
    return {
        "new_tokens": stats.new_tokens,
        "target_forwards": stats.target_forwards,
        "steps": stats.steps,
        "tau": stats.new_tokens / max(stats.target_forwards, 1),
        "mean_accepted": stats.mean_accepted,
        "wall_time_s": times.total,
        "tokens_per_s": stats.new_tokens / times.total if times.total > 0 else 0.0,
        "prefill_ms": times.prefill * 1e3,
        "compile_s": times.compile,  # steps that compiled a new shape (--compile), outside wall_time_s
        "per_step_ms": {p: getattr(per_step, p) * 1e3 for p in phases},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as err:  # usage, checkpoint, model, tree, template and data errors are ValueErrors
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return EXIT_USAGE

