"""`python -m train stopper`: learn when a draft model should stop drafting (dynamic draft length).

1. Traces: the engine decodes the data's train prompts with chain speculative decoding at the longest draft length
   (`method.max_gamma`) and records, for every draft depth, the draft's confidence features and whether the target
   accepted that token (observed only while every earlier draft was accepted).
2. Fit: a logistic regression (`method.hidden=0`) or a one-layer MLP predicts P(accept | features); full-batch
   L-BFGS on binary cross-entropy.
3. Threshold: decoding stops once the predicted probability that all drafts so far are accepted falls below t. t is
   chosen on the train prompts' traces to maximise simulated tokens per unit time, with the draft/target cost ratio
   measured on this machine (one draft forward ÷ the rest of a step), and reported on held-out prompts next to fixed
   draft lengths and the confidence-threshold rule.
4. Save: a draft_model checkpoint (the draft model plus the stopper), served by `inference.load` with the learned
   stop by default (`draft_stop=` overrides).

No HF Trainer: the model has 5 (or a few hundred) parameters. Dimension letters: N examples, G depth, F features.
"""

from __future__ import annotations

import logging
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from data.errors import UsageError
from inference.api import Engine
from inference.drafters.draft_model import DraftModelDrafter
from inference.drafters.draft_stop import DraftStop, StopTrace
from models.checkpoint import CONFIG_NAME, draft_model_folder, save_draft_model, shared_spec
from models.draft_model import check_vocab, check_vocab_files, is_plain_model
from models.loading import load_target, load_tokenizer
from models.quiet import quiet_transformers
from models.shared_tensors import attach_shared
from models.stopper import FEATURES, StopperModel, stopper_entry
from train.distill import draft_path
from train.prompts import first_user_prompts

log = logging.getLogger(__name__)
THRESHOLDS = (0.0, 0.01, 0.02, *(round(0.05 * i, 2) for i in range(1, 20)))  # 0 (never stop) .. 0.95


@dataclass(frozen=True)
class Costs:
    """Measured seconds: one draft forward, and the rest of a decoding step (target forward, verify, cache, other)."""

    draft: float
    step: float


@dataclass(frozen=True)
class Simulated:
    tokens_per_step: float
    drafts_per_step: float
    speed: float  # tokens per second under the cost model


def simulate(features: torch.Tensor, accepted: torch.Tensor, stop: DraftStop, costs: Costs) -> Simulated:
    """Replay traced steps (features [R, G, F], accepted drafts [R]) one row at a time under a stop policy: drafting
    ends after depth g, the first depth whose score fails the policy (else G), exactly as DraftModelDrafter decides;
    the step then yields min(accepted, g) + 1 tokens and costs `costs.step + g * costs.draft`. Greedy drafts do not
    depend on when drafting stops, so for greedy traces this is what decoding with the policy would do."""
    rows, depth_max = features.shape[:2]
    if rows == 0:
        return Simulated(0.0, 0.0, 0.0)
    score = None
    keep = torch.ones(rows, depth_max - 1, dtype=torch.bool)  # keep[:, d]: draft depth d + 2 after depth d + 1
    for d in range(depth_max - 1):
        score = stop.survival(features[:, d][:, None], score)  # [R, 1]
        keep[:, d] = stop.keeps(score[:, 0])
    depth = 1 + keep.long().cumprod(dim=1).sum(dim=1)  # [R]
    tokens = torch.minimum(accepted, depth).sum().item() + rows
    drafts = depth.sum().item()
    seconds = rows * costs.step + drafts * costs.draft
    return Simulated(tokens / rows, drafts / rows, tokens / seconds if seconds > 0 else 0.0)


def stacked(rows: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Trace rows -> features [R, G, F] and accepted drafts [R] (every row drafted the full depth G)."""
    if not rows:
        return torch.zeros(0, 1, len(FEATURES)), torch.zeros(0, dtype=torch.long)
    return torch.stack([f for f, _ in rows]), torch.tensor([a for _, a in rows])


def examples(features: torch.Tensor, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Labelled examples: depth d of a step is observed when its first d - 1 drafts were accepted; label = draft d
    accepted. [R, G, F], [R] -> features [N, F] and labels [N] (0./1.)."""
    depth = torch.arange(1, features.shape[1] + 1)  # [G]
    observed = depth[None] <= accepted[:, None] + 1  # [R, G]
    return features[observed], (depth[None] <= accepted[:, None]).float()[observed]


def fit(x: torch.Tensor, y: torch.Tensor, hidden: int, seed: int, iterations: int = 200) -> StopperModel:
    """Full-batch L-BFGS on binary cross-entropy over standardised features."""
    torch.manual_seed(seed)
    model = StopperModel(hidden, mean=x.mean(0), std=x.std(0) if len(x) > 1 else None)
    optimizer = torch.optim.LBFGS(model.net.parameters(), max_iter=iterations, line_search_fn="strong_wolfe")
    loss_fn = nn.BCEWithLogitsLoss()

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    optimizer.step(closure)
    return model.eval()


def log_loss(model: StopperModel, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(nn.functional.binary_cross_entropy_with_logits(model(x), y)) if len(x) else float("nan")


def best_threshold(features: torch.Tensor, accepted: torch.Tensor, make, costs: Costs) -> tuple[float, Simulated]:
    """The threshold of THRESHOLDS whose policy `make(t)` simulates fastest on the traced steps."""
    scored = [(t, simulate(features, accepted, make(t), costs)) for t in THRESHOLDS]
    return max(scored, key=lambda item: item[1].speed)


class Method:
    """A standalone method (train.method.Standalone): it runs its own loop instead of the HF Trainer."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        m = cfg.method
        for key, low in (("max_gamma", 2), ("prompts", 2), ("max_new_tokens", 1), ("batch_size", 1), ("hidden", 0),
                         ("calibration_prompts", 1)):
            if m[key] < low:
                raise UsageError(f"method.{key}={m[key]}: must be >= {low}")
        if not 0 < m.validation_fraction < 1:
            raise UsageError(f"method.validation_fraction={m.validation_fraction}: must be in (0, 1)")
        if m.draft_cost is not None and not m.draft_cost >= 0:
            raise UsageError(f"method.draft_cost={m.draft_cost}: must be >= 0 (one draft forward / one target step)")

    def run(self, cfg: DictConfig) -> dict[str, float]:
        m = cfg.method
        tokenizer = load_tokenizer(cfg.model.path, cfg.model.chat_template or cfg.data.chat_template,
                                   cfg.model.trust_remote_code)
        check_vocab_files(resolve_draft(m.draft), cfg.model.path, tokenizer, f"method.draft={m.draft}",
                          cfg.model.trust_remote_code)  # from the files: before the models load
        kwargs = dict(attn_implementation=cfg.model.attn_implementation, trust_remote_code=cfg.model.trust_remote_code)
        target = load_target(cfg.model.path, dtype=cfg.model.dtype, quantization=cfg.model.quantization,
                             double_quant=cfg.model.double_quant, revision=cfg.model.revision, **kwargs)
        shared = draft_shared(m.draft)
        with quiet_transformers(bool(shared)):  # left out of the files on purpose: attached below
            draft = load_target(resolve_draft(m.draft), dtype=cfg.model.dtype, **kwargs).to(target.device)
        attach_shared(draft, target, shared, f"method.draft={m.draft}")
        check_vocab(draft, target)
        prompts = train_prompts(cfg, tokenizer)
        n_val = max(1, round(len(prompts) * m.validation_fraction))
        if len(prompts) - n_val < 1:
            raise ValueError(f"{cfg.data.path or cfg.data.name}: {len(prompts)} prompts; the stopper needs at least 2")
        fit_prompts, val_prompts = prompts[n_val:], prompts[:n_val]

        trace = StopTrace()
        engine = Engine(target.eval(), DraftModelDrafter(draft.eval(), m.max_gamma, trace=trace))
        start = time.perf_counter()
        fit_rows = collect(engine, trace, fit_prompts, m, "traces (fit)")
        val_rows = collect(engine, trace, val_prompts, m, "traces (held out)")
        log.info("traces: %d + %d steps in %.0f s", len(fit_rows), len(val_rows), time.perf_counter() - start)
        costs = measure_costs(target, draft, val_prompts[: m.calibration_prompts], m)
        if m.draft_cost is not None:
            costs = Costs(draft=m.draft_cost * costs.step, step=costs.step)

        fit_f, fit_a = stacked(fit_rows)
        val_f, val_a = stacked(val_rows)
        x, y = examples(fit_f, fit_a)
        xv, yv = examples(val_f, val_a)
        model = fit(x, y, m.hidden, cfg.seed)
        threshold, _ = best_threshold(fit_f, fit_a, lambda t: DraftStop("learned", t, model), costs)
        conf_t, _ = best_threshold(fit_f, fit_a, lambda t: DraftStop("confidence", t), costs)
        table = {f"fixed:{g}": simulate(val_f[:, :g], val_a, DraftStop(), costs) for g in range(1, m.max_gamma + 1)}
        table[f"confidence:{conf_t}"] = simulate(val_f, val_a, DraftStop("confidence", conf_t), costs)
        table[f"learned:{threshold}"] = simulate(val_f, val_a, DraftStop("learned", threshold, model), costs)
        best_fixed = max((k for k in table if k.startswith("fixed:")), key=lambda k: table[k].speed)
        metrics = {
            "examples": float(len(y)), "val_examples": float(len(yv)), "accept_rate": float(y.mean()),
            "val_log_loss": log_loss(model, xv, yv),
            "val_log_loss_constant": float(nn.functional.binary_cross_entropy(yv.mean().expand_as(yv), yv)),
            "threshold": threshold, "confidence_threshold": conf_t, "draft_cost_ratio": costs.draft / costs.step,
            "best_fixed_gamma": float(best_fixed.partition(":")[2]),
            **{f"sim_{k}_{field}": float(getattr(v, field)) for k, v in table.items()
               for field in ("tokens_per_step", "drafts_per_step", "speed")},
        }
        print(report(table, best_fixed, metrics), flush=True)
        extra = {"method": "stopper", "data": cfg.data.path or cfg.data.name, "draft": m.draft, "metrics": metrics,
                 "command": "python -m train " + shlex.join(sys.argv[1:]),
                 "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)}
        entry = stopper_entry(model, threshold, m.max_gamma, {k: metrics[k] for k in ("val_log_loss", "draft_cost_ratio")})
        output_dir = Path(cfg.output_dir)
        save_draft_model(output_dir, draft, cfg.model.path, tokenizer, extra, stopper=model, stopper_config=entry,
                         target=target)
        print(f"checkpoint: {output_dir}", flush=True)
        return metrics


def resolve_draft(draft: str) -> str:
    """method.draft -> the draft causal LM's folder: a conf/model name, hub id, directory, builtin:<name>,
    early_exit:<model>:<layers>, or a draft_model checkpoint (e.g. from `python -m train distill`), whose draft/ folder is used."""
    path = draft_path(draft)
    if (Path(path) / CONFIG_NAME).is_file() and not is_plain_model(path):
        return str(draft_model_folder(path))  # a checkpoint, or CheckpointError naming what is wrong with it
    return path


def draft_shared(draft: str) -> dict:
    """What a draft_model checkpoint named by method.draft takes from its target (models.checkpoint.shared_spec)."""
    path = draft_path(draft)
    return shared_spec(path) if (Path(path) / CONFIG_NAME).is_file() and not is_plain_model(path) else {}


def train_prompts(cfg: DictConfig, tokenizer: Any) -> list[list[int]]:
    """First user turns of the data's train split, shuffled with data.seed, at most method.prompts, each cut to its
    last data.max_length tokens."""
    prompts = first_user_prompts(cfg, tokenizer, "train", cfg.method.prompts, shuffle_seed=cfg.data.seed)
    return [ids[-cfg.data.max_length:] for ids in prompts]


def collect(engine, trace, prompts: list[list[int]], m: DictConfig, desc: str) -> list[tuple[torch.Tensor, int]]:
    """Greedy (or method.temperature) chain decoding of `prompts` in batches; the trace's live rows."""
    from tqdm.auto import tqdm

    rows = []
    for i in tqdm(range(0, len(prompts), m.batch_size), desc=desc, unit="batch"):
        out = engine.generate(prompts[i : i + m.batch_size], m.max_new_tokens, temperature=m.temperature,
                              ignore_eos=True, seed=i)
        rows += trace.rows(list(out.stats.accepted))
    return rows


def measure_costs(target: nn.Module, draft: nn.Module, prompts: list[list[int]], m: DictConfig) -> Costs:
    """Seconds of one draft forward and of the rest of a step, from batch-1 chain decoding at max_gamma (the
    engine's phase clock: draft time / draft forwards; forward + verify + cache + other per step)."""
    engine = Engine(target, DraftModelDrafter(draft, m.max_gamma))
    draft_s = rest_s = 0.0
    steps = 0
    for prompt in prompts:
        engine.generate(prompt, 8, ignore_eos=True)  # warm-up
        stats = engine.generate(prompt, m.max_new_tokens, ignore_eos=True).stats
        t = stats.times
        draft_s += t.draft
        rest_s += t.forward + t.verify + t.cache + t.other
        steps += stats.steps
    return Costs(draft=draft_s / (steps * m.max_gamma), step=rest_s / steps)


def report(table: dict[str, Simulated], best_fixed: str, metrics: dict[str, float]) -> str:
    base = table[best_fixed].speed
    lines = [
        f"stopper: {int(metrics['examples'])} fit examples (accepted {metrics['accept_rate']:.3f}), held-out log loss "
        f"{metrics['val_log_loss']:.4f} (constant predictor {metrics['val_log_loss_constant']:.4f}); "
        f"draft forward = {metrics['draft_cost_ratio']:.3f} x the rest of a step",
        f"{'policy (held-out prompts, simulated)':38} {'tokens/step':>11} {'drafts/step':>11} {'speed vs ' + best_fixed:>18}",
    ]
    for name, sim in table.items():
        lines.append(f"{name:38} {sim.tokens_per_step:11.3f} {sim.drafts_per_step:11.3f} {sim.speed / base:18.3f}")
    return "\n".join(lines)
