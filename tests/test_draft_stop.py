"""Dynamic draft length: stop features, policies, the stopper's fit/simulation against naive references, exactness of
decoding under every policy, and a `python -m train stopper` run whose checkpoint the engine serves."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference.drafters.draft_model import DraftModelDrafter
from inference.drafters.draft_stop import DraftStop, StopSpecError, StopTrace, parse_stop
from inference.engine.loop import DecodeConfig, generate
from inference.engine.verify import SamplingParams
from models.stopper import FEATURES, StopperModel, stop_features
from tests.conftest import build_tiny_lm
from tests.model_support import save_tiny_model
from tests.test_draft_model import SAMPLES, assert_follows_target_joint, left_pad, noisy_copy, plain_greedy
from train.stopper import Costs, examples, fit, simulate, stacked

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("single_thread")


class DepthRecorder:
    """Delegates to a DraftModelDrafter and records each step's draft depth."""

    def __init__(self, inner: DraftModelDrafter) -> None:
        self.inner, self.needs_hidden, self.depths = inner, inner.needs_hidden, []

    def propose(self, state):
        draft = self.inner.propose(state)
        self.depths.append(draft.tree.max_depth)
        return draft

    def update(self, state, draft, result) -> None:
        self.inner.update(state, draft, result)


def test_stop_features_match_a_naive_computation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    got = stop_features(logits, 3)
    for row, values in enumerate(logits.tolist()):
        z = sum(math.exp(v) for v in values)
        p = sorted((math.exp(v) / z for v in values), reverse=True)
        entropy = -sum(q * math.log(q) for q in p)
        assert got[row].tolist() == pytest.approx([entropy, p[0], p[1], 3.0], rel=1e-5)
    assert got.shape == (2, len(FEATURES))
    one_hot = stop_features(torch.tensor([[0.0, -math.inf, -math.inf]]), 1)  # zero-probability tokens: entropy 0
    assert one_hot[0].tolist() == pytest.approx([0.0, 1.0, 0.0, 1.0])


def test_parse_stop_specs_and_errors():
    model = StopperModel()
    assert parse_stop(None, None, None).kind == "fixed"
    default = parse_stop(None, model, 0.3)
    assert (default.kind, default.threshold, default.model) == ("learned", 0.3, model)
    assert parse_stop("learned:0.7", model, 0.3).threshold == 0.7
    confidence = parse_stop("confidence:0.4", model, 0.3)
    assert (confidence.kind, confidence.threshold, confidence.model) == ("confidence", 0.4, None)
    for spec, stopper, message in [("learned", None, "has no stopper"), ("confidence", None, "give the threshold"),
                                   ("confidence:x", None, "not a number"), ("confidence:1.5", None, "in \\[0, 1\\]"),
                                   ("fixed:2", None, "takes no threshold"), ("greedy", None, "choose fixed")]:
        with pytest.raises(StopSpecError, match=message):
            parse_stop(spec, stopper, 0.5)


def test_examples_label_each_observed_depth():
    f = torch.arange(2 * 3 * 4, dtype=torch.float).reshape(2, 3, 4)  # 2 steps, depth 3
    x, y = examples(f, torch.tensor([1, 3]))
    # step 0: depth 1 accepted, depth 2 rejected, depth 3 unobserved; step 1: all three accepted
    assert torch.equal(x, torch.cat([f[0, :2], f[1]])) and y.tolist() == [1, 0, 1, 1, 1]


def naive_simulation(rows, stop: DraftStop, costs: Costs) -> tuple[float, float, float]:
    tokens = drafts = 0
    for features, accepted in rows:
        depth, score = len(features), None
        for d in range(len(features)):
            score = stop.survival(features[d][None, None], score)
            if d + 1 < len(features) and not stop.keep_drafting(score):
                depth = d + 1
                break
        tokens += min(accepted, depth) + 1
        drafts += depth
    return tokens / len(rows), drafts / len(rows), tokens / (len(rows) * costs.step + drafts * costs.draft)


def test_simulation_equals_a_step_by_step_replay():
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(40):  # 40 steps of depth 5: features of random draft distributions, random accepted counts
        features = torch.stack([stop_features(torch.randn(16, generator=g) * 3, d) for d in range(1, 6)])
        rows.append((features, int(torch.randint(0, 6, (), generator=g))))
    model = StopperModel(mean=torch.tensor([1.0, 0.5, 0.2, 3.0]))
    torch.nn.init.normal_(model.net.weight, generator=g)
    costs = Costs(draft=0.2, step=1.0)
    features, accepted = stacked(rows)
    for stop in (DraftStop(), DraftStop("confidence", 0.4), DraftStop("learned", 0.5, model), DraftStop("learned", 0.1, model)):
        got = simulate(features, accepted, stop, costs)
        assert (got.tokens_per_step, got.drafts_per_step, got.speed) == pytest.approx(naive_simulation(rows, stop, costs))
    assert simulate(features, accepted, DraftStop("confidence", 1.0), costs).drafts_per_step == 1.0  # always stops


def test_fit_learns_a_separable_rule():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(400, len(FEATURES), generator=g)
    y = (x[:, 1] > 0.5).float()  # accepted iff the draft's top-1 probability is above 0.5
    model = fit(x, y, hidden=0, seed=0)
    assert ((model.accept_prob(x) > 0.5).float() == y).float().mean() > 0.97
    mlp = fit(x, y, hidden=8, seed=0)
    assert ((mlp.accept_prob(x) > 0.5).float() == y).float().mean() > 0.97


def confidence_median(draft, target, ids, mask, gamma: int) -> float:
    """The median top-1 draft probability over a traced run: a threshold that stops some steps early, not all."""
    trace = StopTrace()
    out = generate(target, ids, DraftModelDrafter(draft, gamma, trace=trace), DecodeConfig(max_new_tokens=20), mask)
    features, _ = stacked(trace.rows(list(out.stats.accepted)))
    return float(features[..., FEATURES.index("top1")].median())


@pytest.mark.parametrize("kind, branches", [("confidence", 1), ("learned", 1), ("learned", 3)])
def test_greedy_with_a_stop_policy_equals_plain_greedy(tiny_lm_factory, kind, branches):
    """Batch of 3 left-padded prompts: draft depth varies per step and the output still equals plain greedy (the
    draft cache stays in step when a step drafts fewer tokens than the last)."""
    target = tiny_lm_factory("llama", 0)
    draft_lm = noisy_copy(target, 0.01)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(k)] for k in (3, 9, 6)]
    ids, mask = left_pad(prompts)
    threshold = confidence_median(draft_lm, target, ids, mask, 4)
    if kind == "confidence":
        stop = DraftStop("confidence", threshold)
    else:  # a hand-set stopper: P(accept) rises with the top-1 probability, 1/2 at the median
        model = StopperModel()
        with torch.no_grad():
            model.net.weight.zero_()
            model.net.weight[0, FEATURES.index("top1")] = 50.0
            model.net.bias.fill_(-50.0 * threshold)
        stop = DraftStop("learned", 0.5, model)
    drafter = DepthRecorder(DraftModelDrafter(draft_lm, 4, branches, stop=stop))
    out = generate(target, ids, drafter, DecodeConfig(max_new_tokens=20), mask)
    for row, prompt in enumerate(prompts):
        assert out.sequences[row] == plain_greedy(target, prompt, 20)
    assert min(drafter.depths) < 4 and len(set(drafter.depths)) > 1  # steps stop early, at varying depths


def test_sampled_drafts_with_a_stop_policy_match_target():
    """The stop decision reads only the draft, so sampling stays exact: the first 3 tokens of SAMPLES rows follow
    the target's autoregressive joint (vocab 8, enumerated), with drafting cut at depth 1 on some steps."""
    v, params = 8, SamplingParams(temperature=1.0, top_k=6)
    target = build_tiny_lm("llama", seed=0, vocab_size=v)
    draft_lm = build_tiny_lm("llama", seed=3, vocab_size=v)
    prompt = torch.tensor([[3, 5, 4]])
    config = DecodeConfig(max_new_tokens=3, sampling=params)
    with torch.no_grad():
        top1 = torch.softmax(draft_lm(input_ids=prompt).logits[0, -1].float(), -1).max().item()
    drafter = DepthRecorder(DraftModelDrafter(draft_lm, 2, stop=DraftStop("confidence", top1 + 1e-4)))
    out = generate(target, prompt.expand(SAMPLES, -1), drafter, config, generator=torch.Generator().manual_seed(0))
    assert_follows_target_joint(out.sequences, target, prompt[0].tolist(), params)
    assert drafter.depths[0] == 1 and 2 in drafter.depths  # the first step (prompt only) stops, later ones vary


@pytest.fixture(scope="module")
def stopper_run(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("stopper")
    target = save_tiny_model(root / "target", seed=0)
    draft = save_tiny_model(root / "draft", seed=1, hidden_size=16)
    data = root / "chats.json"
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    rng = random.Random(0)
    data.write_text(json.dumps([{"id": str(i), "conversations": [
        {"from": "human", "value": " ".join(rng.choices(words, k=4))},
        {"from": "gpt", "value": " ".join(rng.choices(words, k=6))}]} for i in range(16)]))
    out = root / "run"
    cmd = [sys.executable, "-m", "train", "stopper", "+model=tiny", f"model.path={target}", "model.dtype=fp32",
           f"method.draft={draft}", "data=sharegpt", f"data.path={data}", "data.validation_fraction=0",
           "method.prompts=8", "method.max_new_tokens=12", "method.max_gamma=3", "method.batch_size=4",
           "method.calibration_prompts=1", "logger=none", f"output_dir={out}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    return target, out, result


def test_train_stopper_writes_a_served_checkpoint(stopper_run):
    from inference.api import load

    target, out, result = stopper_run
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "policy (held-out prompts, simulated)" in result.stdout and "fixed:3" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["drafter_type"] == "draft_model" and config["stopper"]["features"] == list(FEATURES)
    metrics = config["training"]["metrics"]
    assert metrics["examples"] > 0 and 0 <= metrics["accept_rate"] <= 1 and metrics["draft_cost_ratio"] > 0
    engine = load(out, dtype="fp32")
    assert engine.drafter.stop.kind == "learned" and engine.drafter.stop.threshold == config["stopper"]["threshold"]
    assert engine.drafter.gamma == config["stopper"]["max_gamma"] == 3  # the draft length it was trained for
    plain = load(base=str(target), dtype="fp32")
    prompt = [5, 6, 7, 8]
    expected = plain.generate(prompt, 12, ignore_eos=True).sequences
    assert engine.generate(prompt, 12, ignore_eos=True).sequences == expected
    for spec in ("fixed", "confidence:0.2", "learned:0.9"):
        assert load(out, dtype="fp32", draft_stop=spec).generate(prompt, 12, ignore_eos=True).sequences == expected


def test_draft_stop_is_refused_where_it_does_not_apply(stopper_run):
    from inference.api import load

    target, out, _ = stopper_run
    with pytest.raises(ValueError, match=r"draft_stop= does not apply to plain decoding \(no drafter\); it applies to draft_model"):
        load(base=str(target), dtype="fp32", draft_stop="fixed")
    with pytest.raises(ValueError, match="draft_stop= does not apply to drafter 'prompt_lookup'"):
        load("prompt_lookup", base=str(target), dtype="fp32", draft_stop="fixed")
    with pytest.raises(StopSpecError, match="has no stopper"):
        load(str(out / "draft"), base=str(target), dtype="fp32", draft_stop="learned")
    with pytest.raises(ValueError, match="head_vocab= does not apply to drafter_type 'draft_model'"):
        load(out, dtype="fp32", head_vocab=8)
