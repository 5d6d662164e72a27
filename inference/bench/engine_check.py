"""The engine on one target, measured end to end (scripts/gpu_check.py runs it on a random 7B-shaped Llama).

Dimension letters: K tree nodes (root included), H heads, R top-k ranks per head, V vocab, D hidden.

1. Cost curve: t(K), the engine's forward over a K-node tree on a cache of `context` tokens plus greedy verification
   (inference.bench.tree_fit.measure_forward_cost, synchronised on CUDA); t(1) is a plain step. The heads' draft time
   with the first d heads (measure_head_cost).
2. Decoding: every prompt greedily through our loop without a drafter ("ar"), Hugging Face `generate` ("hf") and
   Medusa heads on K-node trees ("tree<K>"), with the loop's per-phase timers; inference.bench.stats.summarize turns
   them into tau, tokens/s, speedups, per-step phase times and the engine efficiency (speedup over ar / (tau x
   t_AR_step / t_tree_forward)). The K-node trees are the greedy Medusa trees
   (inference.engine.tree.greedy_tree_choices) for the heads' rank accuracy measured on the ar outputs.
3. Greedy identity: each pair of methods' outputs per prompt is identical, a verified near tie or a real mismatch
   (inference.bench.greedy_ties, re-run in `hi_dtype`; this casts the model, so it comes last). In a pair (left, right)
   the right side is the reference and the left's later tokens are checked too: the engine methods come first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from inference.api import Engine
from inference.bench.greedy_ties import TIE_ULPS, classify, first_divergence
from inference.bench.methods import EngineRunner, HFRunner, Runner, Sampling
from inference.bench.run import WARMUP_TOKENS
from inference.bench.stats import Answer, Totals, summarize
from inference.bench.tree_fit import RankCounter, measure_forward_cost, measure_head_cost, score_heads
from inference.drafters.medusa import MedusaDrafter
from inference.drafters.options import MEDUSA_TOPK
from inference.engine.devices import input_device
from inference.engine.drafter import NoDrafter
from inference.engine.tree import greedy_tree_choices, load_tree
from models.backbone import final_hidden
from models.eagle3 import Eagle3Config, Eagle3Draft, target_text_config
from models.medusa import MedusaConfig, MedusaHeads

GREEDY = Sampling(temperature=0.0, top_k=0, top_p=1.0, acceptance="exact")


@dataclass(frozen=True)
class EngineSetup:
    prompts: list[list[int]]
    new_tokens: int
    tree_sizes: tuple[int, ...]  # K, root included
    context: int  # cached tokens under the timed tree forwards
    reps: int  # timed repetitions per cost point (median kept)
    hi_dtype: torch.dtype  # for re-running divergences: fp32 on a GPU, fp64 on a CPU
    seed: int = 0


def lm_head_heads(model: torch.nn.Module, num_heads: int) -> MedusaHeads:
    """Medusa heads as medusa1 initialises them (identity residual blocks, projections copied from the lm_head), in
    the target's dtype on its lm_head's device: on a random target they propose its next token at every depth, which
    is right wherever its greedy output repeats a token."""
    lm_head = model.get_output_embeddings()
    vocab, hidden = lm_head.weight.shape
    with torch.device(lm_head.weight.device):
        heads = MedusaHeads(MedusaConfig(num_heads=num_heads, num_layers=1, hidden_size=hidden, vocab_size=vocab))
    heads.init_from_base(lm_head)
    return heads.to(lm_head.weight.dtype).eval().requires_grad_(False)


def lm_head_eagle3(model: torch.nn.Module) -> Eagle3Draft:
    """An untrained EAGLE-3 draft that proposes the target's own next token from its last layer's features at every
    depth (fc = identity over that one layer, the decoder layer adds nothing, lm_head and a unit norm = the target's),
    in fp32 on the CPU (a drafter checkpoint's form): right wherever the target's greedy output repeats a token, so
    drafts get accepted and the accepted-path cache surgery runs."""
    text = target_text_config(model)
    config = Eagle3Config(target=text, layers=(text["num_hidden_layers"],), draft_vocab_size=text["vocab_size"])
    draft = Eagle3Draft(config).eval().requires_grad_(False)
    with torch.no_grad():
        draft.fc.weight.copy_(torch.eye(text["hidden_size"]))
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
        draft.lm_head.weight.copy_(model.get_output_embeddings().weight)
        draft.norm.weight.fill_(1.0)
    return draft


def decode_all(runner: Runner, prompts: Sequence[list[int]], new_tokens: int, seed: int) -> list[Answer]:
    runner(list(prompts[0]), min(WARMUP_TOKENS, new_tokens), seed)  # warm-up: first-call allocations, kernel choice
    return [Answer(i, "random", (runner(list(p), new_tokens, seed),)) for i, p in enumerate(prompts)]


@torch.no_grad()
def rank_accuracy(model: torch.nn.Module, heads: MedusaHeads, prompts: Sequence[list[int]], answers: list[Answer],
                  topk: int) -> list[list[float]]:
    """accuracy[h][r]: how often head h+1's rank-r candidate is the token the target decoded greedily."""
    counter = RankCounter(len(heads.heads), topk)
    device = input_device(model)
    for prompt, answer in zip(prompts, answers):
        new = list(answer.turns[0].tokens)
        ids = torch.tensor([list(prompt) + new], device=device)
        labels = torch.tensor([[-100] * len(prompt) + new], device=device)
        score_heads(counter, heads, final_hidden(model, ids), labels, None)
    return counter.accuracy()


def totals(answers: list[Answer]) -> dict[str, Any]:
    """One method's tokens/s and (engine methods) mean per-step phase times, as bench.stats reports them."""
    t = Totals()
    for answer in answers:
        for turn in answer.turns:
            t.add(turn)
    return t.as_dict()


def tree_row(summary: dict[str, Any], nodes: int, depth: int) -> dict[str, Any]:
    drafter = summary["methods"]["drafter"]
    keys = ("tau", "tokens_per_s", "speedup_vs_ar", "speedup_vs_hf", "ideal_speedup", "engine_efficiency",
            "t_ar_step_ms", "t_tree_forward_ms")
    return {"nodes": nodes, "depth": depth, **{k: summary.get(k) for k in keys},
            "per_step_ms": drafter["per_step_ms"], "prefill_ms": drafter["prefill_ms"]}


def greedy_identity(model: torch.nn.Module, prompts: Sequence[list[int]], outputs: dict[str, list[Answer]],
                    pairs: Sequence[tuple[str, str]], hi_dtype: torch.dtype) -> dict[str, Any]:
    """Per pair of methods (left under test, right the reference): prompts whose outputs are identical, part at a
    verified near tie, or part for real."""
    cases = []
    run_dtype = model.dtype
    for left, right in pairs:
        for i, prompt in enumerate(prompts):
            d = first_divergence(prompt, outputs[right][i].turns[0].tokens, outputs[left][i].turns[0].tokens)
            if d is not None:
                cases.append((f"{left}_vs_{right}", i, d))
    verdicts = classify(model, [d for _, _, d in cases], hi_dtype)
    counts = {f"{l}_vs_{r}": {"identical": len(prompts), "near_tie": 0, "mismatch": 0} for l, r in pairs}
    details = []
    for (pair, i, d), v in zip(cases, verdicts):
        counts[pair]["identical"] -= 1
        counts[pair]["near_tie" if v.near_tie else "mismatch"] += 1
        details.append({"pair": pair, "prompt": i, "index": d.index, "left": d.right, "right": d.left,
                        "margin": v.margin, "tolerance": v.tolerance, "hi_argmax": v.hi_argmax,
                        "failed_at": v.failed_at, "failed_by": v.failed_by, "near_tie": v.near_tie})
    hi = str(hi_dtype).removeprefix("torch.")
    rule = (f"re-run prompt + the tested output teacher-forced in {hi}, from the first differing token on: near tie "
            f"if there both tokens, and after it every token of the tested output, lie within "
            f"{TIE_ULPS[run_dtype]:g} x the {str(run_dtype).removeprefix('torch.')} unit roundoff x max|logit| of "
            f"the {hi} argmax (inference.bench.greedy_ties)")
    return {"rule": rule, "pairs": counts, "divergences": details}


def check_engine(model: torch.nn.Module, heads: MedusaHeads, setup: EngineSetup,
                 say: Callable[[str], None] = print) -> dict[str, Any]:
    """Sections 1-3 of the module docstring on `model` (left in setup.hi_dtype afterwards when any outputs differ)."""
    device, run_dtype = input_device(model), model.dtype  # the identity check may leave the model in hi_dtype
    topk = min(MEDUSA_TOPK, heads.config.vocab_size)
    num_heads = len(heads.heads)
    sizes = (1, *setup.tree_sizes)
    say(f"engine: tree forward + verify cost for K = {', '.join(map(str, sizes))} ({setup.reps} reps each)")
    curve = measure_forward_cost(model, setup.context, sizes, setup.reps, seed=setup.seed)
    probe = MedusaDrafter(heads, load_tree("default", num_heads, topk, device))
    head_s = measure_head_cost(probe, topk, setup.reps, device)
    del probe
    outputs: dict[str, list[Answer]] = {}
    pad = model.config.pad_token_id
    for name, runner in (("ar", EngineRunner(Engine(model, NoDrafter()), GREEDY)), ("hf", HFRunner(model, (), pad, GREEDY))):
        say(f"engine: {name}, {len(setup.prompts)} prompts x {setup.new_tokens} tokens")
        outputs[name] = decode_all(runner, setup.prompts, setup.new_tokens, setup.seed)
    accuracy = rank_accuracy(model, heads, setup.prompts, outputs["ar"], topk)
    trees = {}
    for k in setup.tree_sizes:
        tree = load_tree(greedy_tree_choices(accuracy, k - 1), num_heads, topk, device)
        say(f"engine: {k}-node tree (depth {tree.max_depth})")
        runner = EngineRunner(Engine(model, MedusaDrafter(heads, tree)), GREEDY)
        outputs[f"tree{k}"] = decode_all(runner, setup.prompts, setup.new_tokens, setup.seed)
        summary = summarize({"drafter": outputs[f"tree{k}"], "ar": outputs["ar"], "hf": outputs["hf"]}, "drafter",
                            greedy=True)
        trees[str(k)] = tree_row(summary, tree.num_nodes, tree.max_depth)
    plain = {name: totals(outputs[name]) for name in ("ar", "hf")}
    pairs = [(f"tree{k}", base) for k in setup.tree_sizes for base in ("ar", "hf")] + [("ar", "hf")]
    say("engine: greedy identity (divergences re-run in high precision)")
    identity = greedy_identity(model, setup.prompts, outputs, pairs, setup.hi_dtype)
    return {
        "dtype": str(run_dtype).removeprefix("torch."), "context": setup.context,
        "prompts": len(setup.prompts), "prompt_tokens": [len(p) for p in setup.prompts],
        "new_tokens": setup.new_tokens,
        "cost_ms": {str(k): s * 1e3 for k, s in zip(curve.sizes, curve.seconds)},
        "head_ms": [s * 1e3 for s in head_s],
        "head_rank_accuracy": [[round(a, 4) for a in row] for row in accuracy],
        "plain": {k: plain["ar"][k] for k in ("tokens_per_s", "per_step_ms", "prefill_ms")},
        "hf": {"tokens_per_s": plain["hf"]["tokens_per_s"]},
        "trees": trees,
        "greedy_identity": identity,
    }
