"""Draft-model speculative decoding: the p/q rule reproduces the target's distribution, greedy equals plain greedy,
the draft model's own KV cache stays in step with acceptance, and load() serves draft models."""

from __future__ import annotations

import copy
import itertools
import math
import random

import pytest
import torch

from inference.api import load
from inference.drafters.draft_model import DraftModelDrafter
from inference.engine.drafter import DecodeState, Draft
from inference.engine.loop import DecodeConfig, generate
from inference.engine.tree import build_tree, chain_choices
from inference.engine.verify import SamplingParams, target_probs, verify_speculative
from models.checkpoint import DrafterMismatchError, save_draft_model
from models.draft_model import check_vocab
from tests.conftest import build_tiny_lm
from tests.model_support import save_tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")
SAMPLES = 20_000


def chi2_bound(cells: int) -> float:
    """Pearson chi-square stays below df + 6 sqrt(2 df) with probability > 1 - 1e-6 for the sizes used here (normal
    approximation; every expected count is >= 5 after pooling). The seed is fixed, so a pass is deterministic."""
    df = cells - 1
    return df + 6 * math.sqrt(2 * df)


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of `counts` against `probs` (flattened); cells with expected count < 5 pooled into one."""
    counts, expected = counts.flatten().double(), probs.flatten().double() * counts.sum()
    small = expected < 5
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    assert bool((counts[~keep] == 0).all()), "samples fell on zero-probability sequences"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return float(stat), int(keep.sum())


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
]


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7-top3", "t1.3-top0.8"])
def test_chain_rule_reproduces_target_joint(params):
    """Stub distributions over V=4, gamma=2: target logits depend on the whole prefix; drafts are sampled from a
    different q. Committed tokens, completed to length 3 by sampling the target itself, must follow p's joint."""
    v, gamma = 4, 2
    g = torch.Generator().manual_seed(0)
    target = [torch.randn(v, generator=g) * 1.5, torch.randn(v, v, generator=g) * 1.5, torch.randn(v, v, v, generator=g) * 1.5]
    drafty = [torch.randn(v, generator=g) * 1.5, torch.randn(v, v, generator=g) * 1.5]
    p = [target_probs(t, params) for t in target]
    q = [target_probs(t, params) for t in drafty]
    tree = build_tree(chain_choices(gamma), gamma, 1)
    n = SAMPLES
    root = torch.zeros(n, dtype=torch.long)  # a fixed committed root: the stub contexts start after it
    d1 = torch.multinomial(q[0].expand(n, v), 1, generator=g)[:, 0]
    d2 = torch.multinomial(q[1][d1], 1, generator=g)[:, 0]
    tokens = torch.stack([root, d1, d2], dim=1)  # [N, 3]
    logits = torch.stack([target[0].expand(n, v), target[1][d1], target[2][d1, d2]], dim=1)  # [N, 3, V]
    probs = torch.stack([q[0].expand(n, v), q[1][d1], torch.zeros(n, v)], dim=1)
    result = verify_speculative(tokens, logits, probs, tree, params, g)
    seq = result.tokens.clone()  # [N, 3] accepted drafts then the next token, -1 padded
    for i in range(1, 3):  # complete short rows from the target itself
        short = seq[:, i] < 0
        dist = p[1][seq[:, 0].clamp(min=0)] if i == 1 else p[2][seq[:, 0], seq[:, 1].clamp(min=0)]
        seq[:, i] = torch.where(short, torch.multinomial(dist, 1, generator=g)[:, 0], seq[:, i])
    counts = torch.zeros(v, v, v).index_put_((seq[:, 0], seq[:, 1], seq[:, 2]), torch.ones(n), accumulate=True)
    joint = p[0][:, None, None] * p[1][:, :, None] * p[2]
    stat, cells = chi2(counts, joint)
    assert stat < chi2_bound(cells), (stat, cells)
    # Power check: the drafts' own joint (what accepting every draft would give) is far outside the bound.
    draft_joint = q[0][:, None, None] * q[1][:, :, None] * p[2]
    empirical = counts / n
    assert (empirical - draft_joint).abs().sum() > 5 * (empirical - joint).abs().sum()
    # The first draft is accepted with probability sum_x min(p, q) = 1 - TV(p, q) (Leviathan et al., Thm 3.5); the
    # one-hot rule (exact too, but blind to q) would give sum_x q(x) p(x). Bound: 6 binomial standard deviations.
    alpha = torch.minimum(p[0], q[0]).sum()
    rate = (result.num_accepted >= 1).float().mean()
    assert abs(rate - alpha) < 6 * math.sqrt(alpha * (1 - alpha) / n), (rate, alpha)


@torch.no_grad()
def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def noisy_copy(model: torch.nn.Module, scale: float, seed: int = 0) -> torch.nn.Module:
    """A draft close to `model`: its weights plus N(0, scale^2) noise."""
    g = torch.Generator().manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=g) * scale)
    return draft


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


class Recording:
    """Delegates to a drafter and records what each propose saw and proposed (for recompute checks)."""

    def __init__(self, inner: DraftModelDrafter) -> None:
        self.inner, self.needs_hidden, self.log, self.nodes = inner, inner.needs_hidden, [], []

    def propose(self, state: DecodeState) -> Draft:
        draft = self.inner.propose(state)
        self.log.append(([list(g) for g in state.generated], draft.tokens.clone()))
        return draft

    def update(self, state, draft, result) -> None:
        self.nodes += result.node.tolist()
        self.inner.update(state, draft, result)


@pytest.mark.parametrize("gamma, branches", [(1, 1), (3, 1), (3, 3)])
def test_greedy_equals_plain_greedy_and_drafts_match_recompute(tiny_lm_factory, gamma, branches):
    """Batch of 3 left-padded prompts, draft != target (partial, per-row acceptance). Output equals plain greedy;
    every proposed branch (the draft's rank-i first token, then its greedy chain) equals a recompute without a
    cache: the draft model's own KV cache (tree slots, surgery, pending tokens) stays in step."""
    target = tiny_lm_factory("llama", 0)
    draft_lm = noisy_copy(target, 0.01)  # agrees often but not always: every depth and branch gets accepted
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(k)] for k in (3, 9, 6)]
    ids, mask = left_pad(prompts)
    drafter = Recording(DraftModelDrafter(draft_lm, gamma, branches))
    out = generate(target, ids, drafter, DecodeConfig(max_new_tokens=20), mask)
    for row, prompt in enumerate(prompts):
        assert out.sequences[row] == plain_greedy(target, prompt, 20)
    for generated, tokens in drafter.log:
        for row, prompt in enumerate(prompts):
            context = prompt + generated[row]
            with torch.no_grad():
                firsts = draft_lm(input_ids=torch.tensor([context])).logits[0, -1].topk(branches).indices.tolist()
            for i, first in enumerate(firsts):
                nodes = [d * branches + i + 1 for d in range(gamma)]  # branch i, depths 1 .. gamma
                assert tokens[row, nodes].tolist() == [first] + plain_greedy(draft_lm, context + [first], gamma - 1)
    accepted = {a for step in out.stats.accepted for a in step if a >= 0}
    assert {0, min(2, gamma), gamma} <= accepted  # partial and full acceptance, differing per row and step
    assert {(n - 1) % branches for n in drafter.nodes if n > 0} == set(range(branches))  # every branch won once


def test_self_draft_accepts_every_token(tiny_lm_factory):
    target = tiny_lm_factory("qwen2", 0)
    ids, mask = left_pad([[5, 6, 7], [9, 10, 11, 12, 13]])
    out = generate(target, ids, DraftModelDrafter(target, 4), DecodeConfig(max_new_tokens=16), mask)
    assert all(a == 4 for step in out.stats.accepted[:-1] for a in step if a >= 0)


@pytest.mark.parametrize("branches", [1, 3])
def test_sampled_drafts_through_the_loop_match_target(tiny_lm_factory, branches):
    """End to end through generate (draft KV cache, holes, bonus tokens; 3 first-level candidates drawn without
    replacement) on SAMPLES rows of a tiny vocab-8 model: the first 3 new tokens follow the target's
    autoregressive joint, computed exactly by enumeration."""
    v, params = 8, SamplingParams(temperature=1.0, top_k=6)
    target = build_tiny_lm("llama", seed=0, vocab_size=v)
    draft_lm = build_tiny_lm("llama", seed=3, vocab_size=v)
    prompt = torch.tensor([[3, 5, 4]])
    config = DecodeConfig(max_new_tokens=3, sampling=params)
    out = generate(target, prompt.expand(SAMPLES, -1), DraftModelDrafter(draft_lm, 2, branches), config,
                   generator=torch.Generator().manual_seed(0))
    assert_follows_target_joint(out.sequences, target, prompt[0].tolist(), params)
    assert 0 < out.stats.mean_accepted < 2


@torch.no_grad()
def assert_follows_target_joint(sequences: list[list[int]], target, prompt: list[int], params: SamplingParams) -> None:
    """Chi-square test: the 3-token samples follow the target's autoregressive joint after `prompt`, enumerated
    exactly over its (tiny) vocabulary."""
    v = target.get_output_embeddings().weight.shape[0]
    prefixes = [list(p) for n in range(3) for p in itertools.product(range(v), repeat=n)]
    cond = {tuple(p): target_probs(target(input_ids=torch.tensor([[*prompt, *p]])).logits[0, -1], params)
            for p in prefixes}
    joint = torch.zeros(v, v, v)
    for a, b in itertools.product(range(v), repeat=2):
        joint[a, b] = cond[()][a] * cond[(a,)][b] * cond[(a, b)]
    seqs = torch.tensor(sequences)  # [N, 3]
    counts = torch.zeros(v, v, v).index_put_(tuple(seqs.T), torch.ones(len(seqs)), accumulate=True)
    stat, cells = chi2(counts, joint)
    assert stat < chi2_bound(cells), (stat, cells)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dm")
    return save_tiny_model(root / "target", seed=0), save_tiny_model(root / "draft", seed=1, hidden_size=32)


def test_load_plain_draft_model_and_checkpoint(model_dirs, tmp_path):
    target_dir, draft_dir = model_dirs
    engine = load(drafter_path=draft_dir, base=str(target_dir), dtype="fp32", tree="chain:3")
    assert isinstance(engine.drafter, DraftModelDrafter) and engine.drafter.gamma == 3
    branched = load(drafter_path=draft_dir, base=str(target_dir), dtype="fp32", tree="branches:2x3")
    assert (branched.drafter.gamma, branched.drafter.branches) == (3, 2)
    plain = load(base=str(target_dir), dtype="fp32")
    prompt = [5, 6, 7, 8]
    assert engine.generate(prompt, 12, ignore_eos=True).sequences == plain.generate(prompt, 12, ignore_eos=True).sequences
    assert branched.generate(prompt, 12, ignore_eos=True).sequences == plain.generate(prompt, 12, ignore_eos=True).sequences
    ckpt = save_draft_model(tmp_path / "ckpt", engine.drafter.model, str(target_dir))
    again = load(ckpt, dtype="fp32")
    assert again.drafter_config["drafter_type"] == "draft_model"
    assert again.generate(prompt, 12, ignore_eos=True).sequences == plain.generate(prompt, 12, ignore_eos=True).sequences


def test_plain_draft_model_needs_base(model_dirs):
    with pytest.raises(ValueError, match="pass base="):
        load(drafter_path=model_dirs[1], dtype="fp32")


def test_vocabulary_mismatch_is_one_clear_line():
    with pytest.raises(DrafterMismatchError, match="vocabulary of 64 tokens .* has 128") as info:
        check_vocab(build_tiny_lm("llama", vocab_size=64), build_tiny_lm("llama"))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("replacement", [True, False], ids=["with-replacement", "without-replacement"])
def test_multi_candidate_rule_reproduces_target_joint(replacement):
    """k=3 sampled candidates at depth 1 (i.i.d. or without replacement), one sampled child each at depth 2: the
    recursive rejection rule keeps the target's joint and accepts depth 1 more often than a single candidate."""
    v, k, params = 4, 3, SamplingParams(temperature=0.9, top_p=0.95)
    g = torch.Generator().manual_seed(1)
    target = [torch.randn(v, generator=g) * 1.5, torch.randn(v, v, generator=g) * 1.5, torch.randn(v, v, v, generator=g) * 1.5]
    drafty = [torch.randn(v, generator=g) * 1.5, torch.randn(v, v, generator=g) * 1.5]
    p = [target_probs(t, params) for t in target]
    q = [target_probs(t, params) for t in drafty]
    tree = build_tree([(i,) for i in range(k)] + [(i, 0) for i in range(k)], 2, k)
    n = SAMPLES
    first = torch.multinomial(q[0].expand(n, v), k, replacement=replacement, generator=g)  # [N, k]
    second = torch.multinomial(q[1][first.flatten()], 1, generator=g).view(n, k)  # [N, k]
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), first, second], dim=1)  # [N, 1 + 2k]
    logits = torch.cat([target[0].expand(n, 1, v), target[1][first], target[2][first, second]], dim=1)
    probs = torch.cat([q[0].expand(n, 1, v), q[1][first], torch.zeros(n, k, v)], dim=1)
    result = verify_speculative(tokens, logits, probs, tree, params, g, replacement=replacement)
    seq = result.tokens.clone()
    for i in range(1, 3):
        short = seq[:, i] < 0
        dist = p[1][seq[:, 0].clamp(min=0)] if i == 1 else p[2][seq[:, 0], seq[:, 1].clamp(min=0)]
        seq[:, i] = torch.where(short, torch.multinomial(dist, 1, generator=g)[:, 0], seq[:, i])
    counts = torch.zeros(v, v, v).index_put_((seq[:, 0], seq[:, 1], seq[:, 2]), torch.ones(n), accumulate=True)
    joint = p[0][:, None, None] * p[1][:, :, None] * p[2]
    stat, cells = chi2(counts, joint)
    assert stat < chi2_bound(cells), (stat, cells)
    alpha_one = float(torch.minimum(p[0], q[0]).sum())
    assert (result.num_accepted >= 1).float().mean() > alpha_one + 0.02


def test_draft_shape_specs():
    from inference.drafters.draft_model import branch_choices, draft_shape
    from inference.engine.tree import TreeError

    assert draft_shape(None) == (4, 1) and draft_shape("chain:5") == (5, 1) and draft_shape("branches:3x2") == (2, 3)
    assert draft_shape(branch_choices(2, 3)) == (3, 2)
    for bad in ("branches:3", "branches:0x2", [(0,), (1,), (0, 0), (0, 1)]):
        with pytest.raises(TreeError):
            draft_shape(bad)
