"""Exact output laws of the exact verification rules, by enumeration instead of sampling.

Dimension letters: N verifier input rows, K tree nodes (root included), V vocab (4-6 here), L = max_depth + 1.

A stub target and a stub drafter assign a random conditional law to every context (a tuple of token ids starting with
the root), with zero-probability tokens sprinkled in. For one verification step this module enumerates
  - every draft outcome: the tokens of every tree node, each with its probability under the drafter's scheme
    (children of a node drawn i.i.d. from its q, or without replacement with fillers once q's support is used up),
    or, for deterministic drafts, every assignment of tokens to the nodes (duplicates and fillers included);
  - every outcome of the rule's random decisions: the rule runs with a `ForkingDraws` (inference.engine.verify.Draws)
    that replays a script of decisions per row and, at the first decision whose outcome is uncertain, forks the row
    into one child per outcome, weighted by its exact probability; rows are re-run until every script is complete.
The committed block (accepted drafts then the next token), completed to L tokens by the target's own conditionals,
must then have exactly the target's joint law over L tokens. Everything runs in float64, so "exactly" means 1e-9.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from inference.engine.tree import TreeBuffers
from inference.engine.verify import SamplingParams, VerifyResult, target_probs

Context = tuple[int, ...]
# (tokens [N, K], logits [N, K, V], draft probs [N, K, V] or None, draws) -> the rule's result
Rule = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", "ForkingDraws"], VerifyResult]


@dataclass
class StubLM:
    """A random conditional law over `vocab` tokens for every context: logits scale * N(0, 1), each token set to
    -inf with probability `zero_rate` (at least two tokens always stay finite). Deterministic in (seed, context)."""

    vocab: int
    seed: int
    scale: float = 1.5
    zero_rate: float = 0.2
    _cache: dict[Context, torch.Tensor] = field(default_factory=dict)

    def logits(self, context: Context) -> torch.Tensor:
        """[V] float64 logits of the token after `context`."""
        if context not in self._cache:
            code = sum(t * self.vocab**i for i, t in enumerate(context)) * 64 + len(context)  # unique per context
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + code)
            logits = torch.randn(self.vocab, generator=gen, dtype=torch.float64) * self.scale
            zero = torch.rand(self.vocab, generator=gen, dtype=torch.float64) < self.zero_rate
            keep = torch.randperm(self.vocab, generator=gen)[:2]  # never fewer than two finite tokens
            zero[keep] = False
            self._cache[context] = logits.masked_fill(zero, -math.inf)
        return self._cache[context]

    def probs(self, context: Context, params: SamplingParams) -> torch.Tensor:
        """[V] float64: the law of the next token after sampling-parameter processing."""
        return target_probs(self.logits(context), params)


def node_paths(tree: TreeBuffers) -> list[list[int]]:
    """The node ids from the root to each node, both included."""
    return [[n for n in row if n >= 0] for row in tree.node_path.tolist()]


# --- draft outcomes -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DraftCase:
    """One draft outcome: the token at each node, q at each node (None: deterministic drafts), its probability."""

    tokens: tuple[int, ...]  # [K]
    q: torch.Tensor | None  # [K, V] float64; leaf rows zero
    prob: float


def sibling_outcomes(q: torch.Tensor, count: int, replacement: bool) -> Iterator[tuple[tuple[int, ...], float]]:
    """Every ordered tuple of `count` siblings drawn from q [V] and its probability: i.i.d., or without replacement
    (sequential draws renormalised over the tokens not yet drawn, which is the law of Gumbel top-k); once q's support
    is used up, the remaining siblings are fillers: distinct zero-q tokens, each choice equally likely (which one a
    sampler returns is arbitrary; the rule must not care)."""
    values = q.tolist()
    vocab = len(values)
    if replacement:
        for sibs in itertools.product(range(vocab), repeat=count):
            prob = math.prod(values[x] for x in sibs)
            if prob > 0:
                yield sibs, prob
        return

    def draw(prefix: tuple[int, ...], prob: float) -> Iterator[tuple[tuple[int, ...], float]]:
        if len(prefix) == count:
            yield prefix, prob
            return
        left = [x for x in range(vocab) if x not in prefix]
        mass = sum(values[x] for x in left)
        if mass > 0:
            for x in left:
                if values[x] > 0:
                    yield from draw(prefix + (x,), prob * values[x] / mass)
        else:
            for x in left:
                yield from draw(prefix + (x,), prob / len(left))

    yield from draw((), 1.0)


def sampled_drafts(
    tree: TreeBuffers, root: int, drafter: StubLM, params: SamplingParams, replacement: bool
) -> list[DraftCase]:
    """Every draft outcome of a drafter that draws each node's children from q(node context) = the drafter's
    processed law there (as inference.drafters.draft_model does), with its probability."""
    k, vocab = tree.num_nodes, drafter.vocab
    children = [[c for c in row if c >= 0] for row in tree.child_table.tolist()]
    internal = [n for n in range(k) if children[n]]
    paths = node_paths(tree)
    cases: list[DraftCase] = []

    def expand(i: int, tokens: list[int], q: torch.Tensor, prob: float) -> None:
        if i == len(internal):
            cases.append(DraftCase(tuple(tokens), q.clone(), prob))
            return
        n = internal[i]
        q_n = drafter.probs(tuple(tokens[m] for m in paths[n]), params)
        q[n] = q_n
        for sibs, p in sibling_outcomes(q_n, len(children[n]), replacement):
            for c, x in zip(children[n], sibs):
                tokens[c] = x
            expand(i + 1, tokens, q, prob * p)
        q[n] = 0.0

    expand(0, [root] + [0] * (k - 1), torch.zeros(k, vocab, dtype=torch.float64), 1.0)
    return cases


def all_assignments(tree: TreeBuffers, root: int, vocab: int) -> list[DraftCase]:
    """Every deterministic draft: each non-root node any of the V tokens (duplicate siblings, zero-p tokens and
    parent-copying fillers included), each a case of its own (probability 1: the rule must be exact for each)."""
    return [DraftCase((root,) + rest, None, 1.0) for rest in itertools.product(range(vocab), repeat=tree.num_nodes - 1)]


# --- decision outcomes --------------------------------------------------------------------------------------------

class ForkingDraws:
    """An `inference.engine.verify.Draws` that replays one script of decisions per row. A decision whose outcome is
    certain (probability 0 or 1) is taken without a script entry; the first uncertain one past the end of a row's script
    records the row's fork (every outcome with its exact probability) and the rest of that run is ignored for it."""

    def __init__(self, scripts: list[tuple[int, ...]]) -> None:
        self.scripts = scripts
        self.position = [0] * len(scripts)
        self.forks: list[list[tuple[int, float]] | None] = [None] * len(scripts)

    def _decide(self, row: int, outcomes: list[tuple[int, float]]) -> int:
        if len(outcomes) == 1 or self.forks[row] is not None:
            return outcomes[0][0]
        at = self.position[row]
        if at < len(self.scripts[row]):
            self.position[row] += 1
            return self.scripts[row][at]
        self.forks[row] = outcomes
        return outcomes[0][0]

    def accept(self, num: torch.Tensor, den: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        out = []
        for row, (n, d, a) in enumerate(zip(num.tolist(), den.tolist(), active.tolist())):
            if not a:
                out.append(False)
                continue
            # P(u * den < num) for u ~ U[0, 1), the contract of Draws.accept
            prob = (1.0 if n > 0 else 0.0) if d <= 0 else min(1.0, max(0.0, n / d))
            outcomes = [(o, p) for o, p in ((1, prob), (0, 1.0 - prob)) if p > 0]
            out.append(bool(self._decide(row, outcomes)))
        return torch.tensor(out, dtype=torch.bool, device=num.device)

    def pick(self, weights: torch.Tensor) -> torch.Tensor:
        out = []
        for row, w in enumerate(weights.tolist()):
            total = sum(w)
            assert total > 0, "the rule sampled from an all-zero residual"
            out.append(self._decide(row, [(v, x / total) for v, x in enumerate(w) if x > 0]))
        return torch.tensor(out, dtype=torch.long, device=weights.device)


@dataclass(frozen=True)
class Outcome:
    case: int  # index of the draft case
    committed: tuple[int, ...]  # accepted drafts then the next token
    node: int  # deepest accepted node
    prob: float  # probability of the decisions leading here (the draft case's probability not included)


def decision_outcomes(rule: Rule, cases: list[DraftCase], logits: torch.Tensor, max_passes: int = 64) -> list[Outcome]:
    """Run `rule` on every case (logits [N, K, V]: the target's at each case's nodes) under every sequence of its
    random decisions, each once, with its probability."""
    tokens = torch.tensor([c.tokens for c in cases])  # [N, K]
    q = None if cases[0].q is None else torch.stack([c.q for c in cases])  # [N, K, V]
    live: list[tuple[int, tuple[int, ...], float]] = [(i, (), 1.0) for i in range(len(cases))]
    done: list[Outcome] = []
    for _ in range(max_passes):
        if not live:
            return done
        index = torch.tensor([i for i, _, _ in live])
        draws = ForkingDraws([s for _, s, _ in live])
        result = rule(tokens[index], logits[index], None if q is None else q[index], draws)
        committed, accepted, nodes = result.tokens.tolist(), result.num_accepted.tolist(), result.node.tolist()
        forked = []
        for row, (case, script, prob) in enumerate(live):
            fork = draws.forks[row]
            if fork is None:
                done.append(Outcome(case, tuple(committed[row][: accepted[row] + 1]), nodes[row], prob))
            else:
                forked += [(case, script + (o,), prob * p) for o, p in fork]
        live = forked
    raise AssertionError(f"the rule still had undecided rows after {max_passes} passes")


# --- laws ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExactStep:
    """What enumeration says about one step: per draft case, the law of the committed block completed to L tokens,
    and the probability that each node is on the accepted path."""

    completed: torch.Tensor  # [N, V ** L] float64 (one row per case; marginalised rows sum the cases' shares)
    target: torch.Tensor  # [V ** L] the target's own joint law of the next L tokens
    accepted: torch.Tensor  # [N, K] probability that each node is accepted, per case (weighted by its probability)
    proposable: torch.Tensor  # [K] bool: in some case the node and its ancestors are real drafts (q(x) > 0)
    filler_mass: float  # probability of the draft cases holding a q(x) = 0 filler
    impossible: float  # mass committed on blocks the target gives probability 0

    def error(self, marginal: bool) -> float:
        """Largest deviation from the target's law: of the mixture over cases (sampled drafts) or of each case."""
        laws = self.completed.sum(0, keepdim=True) if marginal else self.completed
        return float((laws - self.target).abs().max()) + self.impossible


def exact_step(rule: Rule, tree: TreeBuffers, cases: list[DraftCase], target: StubLM, params: SamplingParams,
               marginal: bool) -> ExactStep:
    """Enumerate `rule` over `cases` and complete each committed block with the target's conditionals. With
    `marginal`, rows of `completed` are weighted by the case probabilities (their sum is the mixture's law);
    otherwise each row is a law of its own."""
    vocab, length = target.vocab, tree.max_depth + 1
    root, paths = cases[0].tokens[0], node_paths(tree)
    table: dict[tuple[int, ...], int] = {}  # each distinct context -> its row in the stacked logits
    index = [[table.setdefault(tuple(c.tokens[n] for n in path), len(table)) for path in paths] for c in cases]
    logits = torch.stack([target.logits(ctx) for ctx in table])[torch.tensor(index)]  # [N, K, V]
    joint = torch.ones((), dtype=torch.float64)
    prefix_laws = [joint.reshape(1)]  # prefix_laws[m]: the target's joint law of the first m tokens, flat [V ** m]
    for m in range(length):
        cond = torch.stack([target.probs((root, *prefix), params)
                            for prefix in itertools.product(range(vocab), repeat=m)])  # [V ** m, V]
        joint = (joint.reshape(-1, 1) * cond).reshape(-1)
        prefix_laws.append(joint)
    accepted = [[0.0] * tree.num_nodes for _ in cases]
    by_length: dict[int, list[tuple[int, int, float]]] = {}  # block length -> (case, flat index of the block, weight)
    for out in decision_outcomes(rule, cases, logits):
        weight = out.prob * (cases[out.case].prob if marginal else 1.0)
        for n in paths[out.node]:
            accepted[out.case][n] += weight
        flat = sum(t * vocab ** (len(out.committed) - 1 - i) for i, t in enumerate(out.committed))
        by_length.setdefault(len(out.committed), []).append((out.case, flat, weight))
    # A block b of m tokens with weight w adds w * P(x) / P(b) to every L-token sequence x that starts with b: the
    # target completes it. Those x are the V ** (L - m) consecutive flat cells from b's index times V ** (L - m).
    completed = torch.zeros(len(cases) * vocab**length, dtype=torch.float64)
    impossible = 0.0
    for m, rows in by_length.items():
        case, flat, weight = (torch.tensor(c, dtype=d) for c, d in zip(zip(*rows), (torch.long, torch.long,
                                                                                     torch.float64)))
        before = prefix_laws[m][flat]  # [n] the target's probability of each block
        possible = before > 0
        impossible += float(weight[~possible].sum())
        span = vocab ** (length - m)
        cells = flat[possible, None] * span + torch.arange(span)  # [n, span]
        values = (weight / before)[possible, None] * prefix_laws[length][cells]
        completed.index_put_((case[possible, None] * vocab**length + cells,), values, accumulate=True)
    real = torch.tensor([drafted(c, tree) for c in cases])  # [N, K]
    proposable = torch.stack([real[:, path].all(-1) for path in paths], dim=1).any(0) & (tree.depth > 0)
    filler_mass = sum(c.prob for c, r in zip(cases, real.tolist()) if not all(r))
    return ExactStep(completed.view(len(cases), -1), joint, torch.tensor(accepted, dtype=torch.float64), proposable,
                     filler_mass, impossible)


def drafted(case: DraftCase, tree: TreeBuffers) -> list[bool]:
    """[K] per node: False for a filler (a token its parent's q gives probability 0); the root and every
    deterministic draft count as drafted."""
    parent = tree.parent.tolist()
    return [n == 0 or case.q is None or float(case.q[parent[n], case.tokens[n]]) > 0 for n in range(tree.num_nodes)]
