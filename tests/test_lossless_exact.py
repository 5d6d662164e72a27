"""The exact rules' output laws, enumerated (tests/lossless_exact.py) rather than sampled, against the target's to
1e-9: the one-hot rule (deterministic drafts: every assignment of tokens, duplicates and fillers included), the p/q
rule on chains, i.i.d. and without-replacement siblings (with fillers), under top-k / top-p; every tree node is
accepted with non-zero probability; and planted verifier mutants are caught."""

from __future__ import annotations

import inspect
import math
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from inference.engine.tree import TreeBuffers, build_tree, chain_choices
import inference.engine.verify
from inference.engine.verify import SamplingParams, TorchDraws
from tests.lossless_exact import ExactStep, StubLM, all_assignments, exact_step, sampled_drafts

pytestmark = pytest.mark.usefixtures("single_thread")
ROOT = 1
TOLERANCE = 1e-9


@dataclass(frozen=True)
class Scenario:
    name: str
    choices: tuple[tuple[int, ...], ...]
    vocab: int
    params: SamplingParams
    scheme: str  # "one-hot" (deterministic drafts), "iid" or "without" (sampled siblings, with / without replacement)
    draft_zero_rate: float = 0.2  # share of zero-q tokens per context (fillers appear when q's support runs out)

    @property
    def tree(self) -> TreeBuffers:
        return build_tree(self.choices, num_heads=max(map(len, self.choices)), topk=1 + max(max(self.choices)))


T1 = SamplingParams(temperature=1.0)
WIDE = ((0,), (1,), (2,), (0, 0), (1, 0))  # three siblings, then one child under the first two
DEEP = ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))
SCENARIOS = {s.name: s for s in [
    Scenario("one-hot-chain", tuple(chain_choices(3)), 5, T1, "one-hot"),
    Scenario("one-hot-tree", WIDE, 4, T1, "one-hot"),
    Scenario("one-hot-topk-topp", ((0,), (1,), (0, 0), (0, 1)), 4,
             SamplingParams(temperature=0.7, top_k=3, top_p=0.9), "one-hot"),
    Scenario("pq-chain", tuple(chain_choices(3)), 5, T1, "iid"),
    Scenario("iid-siblings", WIDE, 5, T1, "iid"),
    Scenario("without-siblings", WIDE, 5, T1, "without"),
    # top-2: q's support is two tokens everywhere, so the third sibling is always a filler (and its child unreachable)
    Scenario("without-top2-fillers", ((0,), (1,), (2,), (0, 0), (2, 0)), 4, SamplingParams(temperature=1.0, top_k=2),
             "without"),
    Scenario("iid-topk-topp", DEEP, 4, SamplingParams(temperature=1.5, top_k=3, top_p=0.9), "iid"),
    Scenario("without-topp", DEEP, 4, SamplingParams(temperature=1.3, top_p=0.8), "without"),
]}


def run(scenario: Scenario, verify: types.ModuleType = inference.engine.verify, seed: int = 0) -> ExactStep:
    """Enumerate one step of `verify`'s rule for `scenario` (target seed `seed`, drafter seed `seed` + 100)."""
    tree, params = scenario.tree, scenario.params
    target = StubLM(scenario.vocab, seed)
    if scenario.scheme == "one-hot":
        cases = all_assignments(tree, ROOT, scenario.vocab)

        def rule(tokens, logits, q, draws):
            return verify.verify_rejection(tokens, logits, tree, params, draws=draws)
    else:
        drafter = StubLM(scenario.vocab, seed + 100, zero_rate=scenario.draft_zero_rate)
        replacement = scenario.scheme == "iid"
        cases = sampled_drafts(tree, ROOT, drafter, params, replacement)

        def rule(tokens, logits, q, draws):
            return verify.verify_speculative(tokens, logits, q, tree, params, replacement=replacement, draws=draws)
    return exact_step(rule, tree, cases, target, params, marginal=scenario.scheme != "one-hot")


def problems(scenario: Scenario, step: ExactStep) -> list[str]:
    """What is wrong with one enumerated step: a law off the target's, a tree node that is a real draft in some case
    but never accepted, or a node that is only ever a q(x) = 0 filler but accepted."""
    found = []
    error = step.error(marginal=scenario.scheme != "one-hot")
    if not error < TOLERANCE:
        found.append(f"committed law off the target's by {error:.3g}")
    ever = step.accepted.sum(0) > 0  # [K]
    if bool((step.proposable & ~ever).any()):
        found.append(f"nodes {(step.proposable & ~ever).nonzero()[:, 0].tolist()} are never accepted")
    if bool((~step.proposable & ever)[1:].any()):
        found.append(f"filler-only nodes {(~step.proposable & ever)[1:].nonzero()[:, 0].add(1).tolist()} accepted")
    return found


# Two stub worlds (target seed s, drafter seed s + 100) in which every node can be accepted. Not every world is one:
# with q's support {a, b} and q(b) >= p(b), once a is rejected the residual norm(max(0, p - q)) has no mass on b, so
# a second sibling b is never accepted (correctly); target seeds 1 and 2 give such worlds for some scenarios.
SEEDS = (0, 3)


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("seed", SEEDS)
def test_exact_law_and_every_node_accepted(name, seed):
    scenario = SCENARIOS[name]
    step = run(scenario, seed=seed)
    assert problems(scenario, step) == []
    if "fillers" in name:
        assert step.filler_mass > 0
    if name == "without-top2-fillers":
        assert step.proposable.tolist() == [False, True, True, False, True, False]
    else:
        assert bool(step.proposable[1:].all())
    if scenario.scheme != "one-hot":
        assert abs(float(step.completed.sum()) - 1) < TOLERANCE  # the draft cases' probabilities sum to 1
        # the laws' zeros differ somewhere near the root: q(x) = 0 < p(x) and p(x) = 0 < q(x) both occur
        target = StubLM(scenario.vocab, seed)
        drafter = StubLM(scenario.vocab, seed + 100, zero_rate=scenario.draft_zero_rate)
        contexts = [(ROOT,)] + [(ROOT, x) for x in range(scenario.vocab)]
        p = torch.stack([target.probs(c, scenario.params) for c in contexts])
        q = torch.stack([drafter.probs(c, scenario.params) for c in contexts])
        assert bool(((q == 0) & (p > 0)).any()) and bool(((p == 0) & (q > 0)).any())


def test_first_draft_acceptance_rates_are_the_textbook_ones():
    """Chain p/q: the first draft is accepted with probability sum_x min(p(x), q(x)) = 1 - TV(p, q) (Leviathan et
    al. 2023, Thm 3.5). One-hot rule: the first child x is accepted with probability p(x), and a later sibling
    repeating an earlier sibling's token (a duplicate: rejected already) with probability 0."""
    chain = SCENARIOS["pq-chain"]
    target, drafter = StubLM(chain.vocab, 0), StubLM(chain.vocab, 100, zero_rate=chain.draft_zero_rate)
    p, q = target.probs((ROOT,), chain.params), drafter.probs((ROOT,), chain.params)
    assert float(run(chain).accepted.sum(0)[1]) == pytest.approx(float(torch.minimum(p, q).sum()), abs=1e-12)

    one_hot = SCENARIOS["one-hot-tree"]
    step = run(one_hot)
    cases = all_assignments(one_hot.tree, ROOT, one_hot.vocab)
    p = StubLM(one_hot.vocab, 0).probs((ROOT,), one_hot.params)
    first = torch.tensor([float(p[c.tokens[1]]) for c in cases], dtype=torch.float64)
    assert torch.allclose(step.accepted[:, 1], first, rtol=0, atol=1e-12)
    duplicate = torch.tensor([c.tokens[2] == c.tokens[1] for c in cases])
    assert bool((step.accepted[duplicate, 2] == 0).all()) and bool((step.accepted[~duplicate, 2] > 0).any())


def test_torch_draws_keep_their_contract():
    """The engine's draws (what the enumeration replaces): accept is Bernoulli(min(1, num/den)) for active rows and
    False elsewhere; pick follows the weights. 200k draws: 6 standard deviations is < 0.007."""
    draws, n = TorchDraws(torch.Generator().manual_seed(0)), 200_000
    num, den = torch.full((n,), 0.3, dtype=torch.float64), torch.full((n,), 0.6, dtype=torch.float64)
    active = torch.arange(n) % 2 == 0
    taken = draws.accept(num, den, active)
    assert not bool(taken[~active].any())
    assert abs(float(taken[active].double().mean()) - 0.5) < 6 * math.sqrt(0.25 / (n / 2))
    assert bool(draws.accept(num, num / 2, torch.ones(n, dtype=torch.bool)).all())  # ratio >= 1: always
    weights = torch.tensor([[0.0, 1.0, 3.0, 0.0]], dtype=torch.float64).expand(n, -1)
    share = torch.bincount(draws.pick(weights), minlength=4).double() / n
    assert share[0] == 0 and share[3] == 0 and abs(float(share[2]) - 0.75) < 6 * math.sqrt(0.75 * 0.25 / n)


# --- planted mutants ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mutant:
    name: str
    old: str  # a line of inference/engine/verify.py, which must occur exactly once
    new: str
    killed_by: str  # the scenario whose enumeration catches it


MUTANTS = [
    Mutant("residual-from-p",  # each later sibling's residual built from p, not from the current residual
           "residual = torch.where(rejected[:, None], _after_rejection(residual, q, x), residual)",
           "residual = torch.where(rejected[:, None], _after_rejection(probs[rows, node], q, x), residual)",
           "iid-siblings"),
    Mutant("residual-from-p-one-hot",  # the same mutant, caught on deterministic drafts
           "residual = torch.where(rejected[:, None], _after_rejection(residual, q, x), residual)",
           "residual = torch.where(rejected[:, None], _after_rejection(probs[rows, node], q, x), residual)",
           "one-hot-tree"),
    Mutant("ratio-q-over-p",  # min(1, q/p) instead of min(1, p/q)
           "take = draws.accept(r_x, q_x, trying & (q_x > 0))",
           "take = draws.accept(q_x, r_x, trying & (q_x > 0))",
           "pq-chain"),
    Mutant("accept-with-p",  # accept with probability p(x), as if the draft were one-hot, but keep the p/q residual
           "take = draws.accept(r_x, q_x, trying & (q_x > 0))",
           "take = draws.accept(r_x, torch.ones_like(q_x), trying & (q_x > 0))",
           "pq-chain"),
    Mutant("no-renormalisation",  # the residual max(0, r - q) left unnormalised
           "return torch.where(mass > 0, leftover / mass.clamp(min=1e-30), residual)",
           "return torch.where(mass > 0, leftover, residual)",
           "iid-siblings"),
    Mutant("resample-from-p",  # after a rejection the next token is sampled from p instead of the residual
           "return make_result(tree, tokens, node, draws.pick(residual))",
           "return make_result(tree, tokens, node, draws.pick(probs[rows, node]))",
           "pq-chain"),
    Mutant("without-keeps-rejected-in-q",  # without replacement, the rejected token is not removed from q
           "q = torch.where(rejected[:, None], _without(q, x), q)",
           "q = q",
           "without-siblings"),
    Mutant("child-q-from-parent",  # off by one level: an accepted child's q read from its parent's row
           "q = torch.where(take[:, None], q_all[rows, child.clamp(min=0)], q)",
           "q = torch.where(take[:, None], q_all[rows, tree.parent[child.clamp(min=0)].clamp(min=0)], q)",
           "pq-chain"),
    Mutant("committed-path-off-by-one",  # the committed drafts read one node up the path (root included)
           "drafts = tokens.gather(1, path[:, 1:].clamp(min=0))",
           "drafts = tokens.gather(1, path[:, :-1].clamp(min=0))",
           "pq-chain"),
    Mutant("fillers-accepted",  # a q(x) = 0 filler no longer guarded: u * 0 < r(x) accepts it
           "take = draws.accept(r_x, q_x, trying & (q_x > 0))",
           "take = draws.accept(r_x, q_x, trying)",
           "without-top2-fillers"),
    Mutant("first-sibling-only",  # lossless but never tries a later sibling: caught by the acceptance check
           "for j in range(kids.shape[1]):",
           "for j in range(min(kids.shape[1], 1)):",
           "iid-siblings"),
]


def mutated_verify(mutant: Mutant, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """inference/engine/verify.py with the mutant's one-line change, loaded as a module of its own."""
    source = inspect.getsource(inference.engine.verify)
    assert source.count(mutant.old) == 1, (
        f"mutant {mutant.name}: {mutant.old!r} no longer occurs exactly once in inference/engine/verify.py; update the mutant")
    name = f"inference._verify_mutant_{mutant.name.replace('-', '_')}"
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up while building the classes
    exec(compile(source.replace(mutant.old, mutant.new), f"<{name}>", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_planted_mutants_are_caught(mutant, monkeypatch):
    scenario = SCENARIOS[mutant.killed_by]
    assert problems(scenario, run(scenario, mutated_verify(mutant, monkeypatch))) != []
