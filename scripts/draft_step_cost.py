"""What an EAGLE-3 draft step costs here, eager, over a static cache and compiled, beside the target's step.

    python scripts/draft_step_cost.py --base smollm2 --dtype fp32 --threads 1
    python scripts/draft_step_cost.py --drafter outputs/eagle3/smollm2-self-2ep --tree chain:3 --dtype bf16

The engine decodes --prompts random prompts of --prompt-len tokens, --new-tokens each, greedy, with an EAGLE-3 drafter
(--drafter, or a random draft over the base's last three fused layers with a --draft-vocab-token vocabulary: a draft
step's cost does not depend on its training), in each mode of --modes, alternating, --rounds times; it prints the
median over rounds of the draft phase's and the target forward's ms a step, each beside the first mode's:
    eager              the engine's default: growing caches
    static             static caches, trees in node buckets (--static-cache)
    compiled           --compile: the target's step compiled; the draft eager on a CPU, compiled on CUDA
    compiled_drafter   --compile with the draft's step and logits compiled on any device
Compilation runs in a warm-up first and is not timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from data.errors import UsageError  # noqa: E402
from inference.engine.loop import DecodeConfig, generate  # noqa: E402
from inference.session import add_model_args, open_session  # noqa: E402

MODES = {  # name -> DecodeConfig settings
    "eager": {},
    "static": {"static_cache": True},
    "compiled": {"compile": True},
    "compiled_drafter": {"compile": True, "compile_drafter": True},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/draft_step_cost.py", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--draft-vocab", type=int, default=8192, help="a random draft's vocabulary (default 8192)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, the first the reference: "
                                                            f"{', '.join(MODES)} (default all)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    return p


def random_drafter(model: torch.nn.Module, draft_vocab: int, tree: str | None) -> object:
    """An untrained EAGLE-3 drafter for `model` (EAGLE-3's default fused layers, a draft vocabulary of at most the
    target's) drafting `tree`."""
    from inference.drafters.eagle3 import Eagle3Drafter, eagle3_tree  # deferred: only without --drafter
    from models.eagle3 import Eagle3Config, Eagle3Draft, default_layers, target_text_config  # deferred: the same

    text = target_text_config(model)
    draft_vocab = min(draft_vocab, text["vocab_size"])
    config = Eagle3Config(target=text, layers=default_layers(text["num_hidden_layers"]), draft_vocab_size=draft_vocab)
    draft = Eagle3Draft(config).eval().requires_grad_(False).to(model.get_input_embeddings().weight)
    return Eagle3Drafter(draft, eagle3_tree(tree or "chain:3", [], model.device, draft_vocab=draft_vocab),
                         model.get_input_embeddings())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        modes = tuple(args.modes.split(","))
        if any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
            raise UsageError(f"--modes takes distinct names among {', '.join(MODES)}, got {args.modes!r}")
        if min(args.prompts, args.prompt_len, args.new_tokens, args.rounds, args.draft_vocab) < 1:
            raise UsageError("--prompts, --prompt-len, --new-tokens, --rounds and --draft-vocab must be >= 1")
        session = open_session(args)  # every model option checked before a model loads
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    engine = session.engine
    model = engine.model
    drafter = engine.drafter if args.drafter else random_drafter(model, args.draft_vocab, args.tree)
    if not hasattr(drafter, "feature_layers"):
        print("error: --drafter must be an EAGLE-3 checkpoint", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, model.config.vocab_size, (1, args.prompt_len), generator=g) for _ in
               range(args.prompts)]
    slots = 256 * -(-(args.prompt_len + args.new_tokens + 64) // 256)  # one capacity: each shape compiles once

    def run(mode: str) -> tuple[float, float]:
        config = DecodeConfig(max_new_tokens=args.new_tokens, cache_slots=slots if mode != "eager" else None,
                              **MODES[mode])
        draft = forward = steps = 0.0
        for ids in prompts:
            out = generate(model, ids.to(engine.device), drafter, config)
            draft, forward, steps = draft + out.stats.times.draft, forward + out.stats.times.forward, \
                steps + out.stats.steps
        return draft / steps * 1e3, forward / steps * 1e3

    for mode in modes:  # the warm-up: every shape compiled before timing
        run(mode)
    timed: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            timed[mode].append(run(mode))
    first = modes[0]
    med = {m: (statistics.median(d for d, _ in t), statistics.median(f for _, f in t)) for m, t in timed.items()}
    print(f"{model.dtype}, {torch.get_num_threads()} thread(s), device {engine.device}; median of {args.rounds} "
          f"rounds of {args.prompts} prompts x {args.new_tokens} tokens")
    print(f"| mode | draft ms a step | × {first} | target forward ms a step | × {first} |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode, (d, f) in med.items():
        print(f"| {mode} | {d:.2f} | {d / med[first][0]:.2f} | {f:.1f} | {f / med[first][1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
