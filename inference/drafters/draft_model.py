"""A small causal LM as the drafter: chain speculative decoding (Leviathan et al. 2023; Chen et al. 2023), optionally
with several first-token candidates (multi-candidate drafting, SpecInfer / recursive rejection sampling).

Dimension letters: B batch, S draft-cache slots, P pending tokens, T prompt length, k branches, V vocab.

Each step the draft model proposes gamma tokens autoregressively (argmax at temperature 0, else sampled from q, its
logits processed by the same `SamplingParams` as the target's), the target checks the draft in one forward and
`inference.engine.verify.verify_speculative` accepts each draft with min(1, p/q), so the output is distributed exactly
as the target's own sampling. The draft model keeps ITS OWN KV cache, carried in `DecodeState.drafter_state` and kept in
step with acceptance: committed tokens the draft model has not yet read are "pending" and are fed at the next propose.
Loading the draft LM and checking it against the target (from the models or their files) is models.draft_model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from inference.drafters.draft_stop import DraftStop, StopTrace, parse_stop
from inference.engine import static
from inference.engine.cache import additive, keep_nodes, new_cache
from inference.engine.compiled import network_call
from inference.engine.drafter import DecodeState, Draft
from inference.engine.tree import TreeBuffers, TreeError, build_tree, load_tree
from inference.engine.verify import VerifyResult, greedy_argmax, sample, target_probs
from models.draft_limits import MAX_DRAFT_TOKENS
from models.draft_model import checkpoint_stopper, load_draft_model
from models.stopper import stop_features

DEFAULT_GAMMA = 4
MAX_GAMMA = MAX_DRAFT_TOKENS  # the longest draft a step proposes
MAX_BRANCHES = 64
FULL_LOGITS_MAX_BLOCK = 8  # draft blocks up to this long compute all their logits (see DraftModelDrafter._forward)


@dataclass(eq=False)
class DraftCache:
    """The draft model's per-run state. Slot conventions follow inference.engine.cache: `valid` marks real tokens.
    Over a static target cache (fixed step shapes) the draft model's cache is static too, of the target's capacity:
    after the prompt every draft forward has one of a few shapes (the pending pair [B, 2], then [B, k] per depth)."""

    cache: DynamicCache  # draft keys/values of committed tokens, minus `pending`, plus the last step's drafts
    valid: torch.Tensor  # [B, S] bool
    pending: torch.Tensor  # [B, P] committed tokens the draft model has not read; the last column is state.root
    pending_valid: torch.Tensor  # [B, P] bool: False marks a filler slot (a hole)
    step: Callable[..., Any]  # the draft model's forward after the prompt: compiled when DecodeState.compile_drafter
    drafted: int = 0  # draft slots appended by the last propose: (depth - 1) x branches
    depth: int = 0  # draft depth of the last propose (gamma unless the stop policy ended it earlier)


def branch_choices(branches: int, gamma: int) -> list[tuple[int, ...]]:
    """`branches` candidates at depth 1, each continued as a chain to depth `gamma` (1 branch: a plain chain)."""
    return [(i,) + (0,) * j for i in range(branches) for j in range(gamma)]


class DraftModelDrafter:
    """Drafts from a draft causal LM: `branches` candidates for the first token (top-k when greedy; else sampled
    from q, without replacement unless `replacement`), each continued by the draft as a chain to depth `gamma`.
    One branch is classic chain speculative decoding. Sampled drafts carry q in `Draft.probs`.
    `stop` (inference.drafters.draft_stop) may end a step's drafting before depth gamma; the step's tree is then the
    same shape cut at that depth. `trace` (chain only) records every depth's stop features and the accepted count.

    Draft cache layout per step: pending tokens, then the tree nodes of depths 1 .. gamma - 1 in node order (slot
    `start + node - 1`); the deepest level is read at the next propose only if the target accepts it.
    """

    needs_hidden = False

    def __init__(self, model: nn.Module, gamma: int = DEFAULT_GAMMA, branches: int = 1, replacement: bool = False,
                 stop: DraftStop | None = None, trace: StopTrace | None = None) -> None:
        if not 1 <= gamma <= MAX_GAMMA:
            raise ValueError(f"gamma (draft tokens per step) must be in [1, {MAX_GAMMA}], got {gamma}")
        vocab = model.get_output_embeddings().weight.shape[0]
        if not 1 <= branches <= min(vocab, MAX_BRANCHES):
            raise ValueError(f"branches must be in [1, {min(vocab, MAX_BRANCHES)}], got {branches}")
        self.model = model
        self.gamma = gamma
        self.branches = branches
        self.replacement = replacement
        if trace is not None and branches != 1:
            raise ValueError("stop traces are recorded for chain drafting (branches=1) only")
        self.stop = stop if stop is not None else DraftStop()
        self.trace = trace
        device = model.get_input_embeddings().weight.device
        self.trees: list[TreeBuffers] = [build_tree(branch_choices(branches, g), g, branches, device=device)
                                         for g in range(1, gamma + 1)]  # trees[g - 1]: drafting stopped at depth g

    @property
    def tree(self) -> TreeBuffers:
        """The full-depth tree (every step's tree is a prefix of it)."""
        return self.trees[-1]

    def propose(self, state: DecodeState) -> Draft:
        run = state.drafter_state if isinstance(state.drafter_state, DraftCache) else self._start(state)
        state.drafter_state = run
        k, greedy = self.branches, state.sampling.greedy
        after = run.pending_valid.long().flip(-1).cumsum(-1).flip(-1) - run.pending_valid.long()  # valid tokens after
        logits = self._forward(run, run.pending, run.pending_valid, (state.next_pos[:, None] - after).clamp(min=0))
        q = target_probs(logits[:, -1], state.sampling)  # [B, V]; one-hot of the argmax when greedy
        levels, qs = [self._first(logits[:, -1], q, state)], [q[:, None]]  # [B, k] tokens, [B, 1, V]
        watch = self.stop.kind != "fixed" or self.trace is not None
        feats = [stop_features(logits[:, -1:], 1).expand(-1, k, -1)] if watch else []  # [B, k, F] per depth
        score = self.stop.survival(feats[0], None) if watch else None
        ones = torch.ones_like(levels[0], dtype=torch.bool)
        for d in range(1, self.gamma):  # read depth d (k tokens at once), draft depth d + 1
            if not self.stop.keep_drafting(score):
                break
            nodes = torch.arange((d - 1) * k + 1, d * k + 1, device=ones.device)
            cols = None if k == 1 else self.trees[-1].attn[nodes][:, 1 : d * k + 1]  # [k, this step's slots + k]
            logits = self._forward(run, levels[-1], ones, state.next_pos[:, None] + d, cols, keep=k)  # [B, k, V]
            q = target_probs(logits, state.sampling)  # [B, k, V]
            levels.append(greedy_argmax(logits) if greedy else sample(q, state.generator))
            qs.append(q)
            if watch:
                feats.append(stop_features(logits, d + 1))
                score = self.stop.survival(feats[-1], score)
        depth = len(levels)
        run.drafted, run.depth = (depth - 1) * k, depth
        if self.trace is not None:
            self.trace.features.append(torch.cat(feats, dim=1).cpu())  # [B, depth, F] (k = 1)
        tokens = torch.cat([state.root[:, None], *levels], dim=1)  # [B, 1 + depth * k], node order
        probs = None if greedy else torch.cat([*qs, torch.zeros_like(qs[-1][:, :1]).expand(-1, k, -1)], dim=1)
        return Draft(tree=self.trees[depth - 1], tokens=tokens, probs=probs, replacement=self.replacement)

    def _first(self, logits: torch.Tensor, q: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """[B, V] -> [B, k] first-level candidates: top-k when greedy, else k draws from q (Gumbel top-k without
        replacement: Kool et al. 2019; tokens with q = 0 come last and the verifier never accepts them)."""
        k = self.branches
        if state.sampling.greedy:
            return logits.topk(k, dim=-1).indices
        if self.replacement or k == 1:
            return torch.multinomial(q, k, replacement=True, generator=state.generator)
        u = torch.rand(q.shape, generator=state.generator, device=q.device).clamp(min=1e-20)
        return (q.log() - (-u.log()).log()).topk(k, dim=-1).indices

    def update(self, state: DecodeState, draft: Draft, result: VerifyResult) -> None:
        """Keep the accepted path's slots, drop the rest; pending becomes [deepest draft if all accepted, new root]."""
        run: DraftCache = state.drafter_state
        n = result.num_accepted  # [B]
        if self.trace is not None:
            self.trace.accepted.append(n.cpu())
        kept = n.clamp(max=run.depth - 1)  # accepted drafts already in the draft cache
        width = int(kept.max()) if kept.numel() else 0
        start = run.valid.shape[1] - run.drafted
        keep_nodes(run.cache, start, (result.path[:, 1 : 1 + width] - 1).clamp(min=0))  # node i sits at slot i - 1
        col = torch.arange(width, device=n.device)
        run.valid = torch.cat([run.valid[:, :start], col[None, :] < kept[:, None]], dim=1)
        all_in = n == run.depth
        leaf = draft.tokens.gather(1, result.node[:, None])[:, 0]
        run.pending = torch.stack([torch.where(all_in, leaf, state.root), state.root], dim=1)  # [B, 2]
        run.pending_valid = torch.stack([all_in, torch.ones_like(all_in)], dim=1)
        run.drafted = 0

    def _start(self, state: DecodeState) -> DraftCache:
        """The first propose of a run: the whole prompt plus the root are pending."""
        pad_mask = state.valid[:, : state.prompt.shape[1]]  # before any step, state.valid is the prompt's pad mask
        ones = torch.ones_like(state.root[:, None], dtype=torch.bool)
        fixed = static.static_layers(state.cache)
        return DraftCache(
            cache=static.new_static_cache(static.capacity(state.cache)) if fixed else new_cache(),
            step=network_call(self.model, "forward") if state.compile_drafter else self.model,
            valid=pad_mask[:, :0],
            pending=torch.cat([state.prompt, state.root[:, None]], dim=1),
            pending_valid=torch.cat([pad_mask, ones], dim=1),
        )

    def _forward(self, run: DraftCache, ids: torch.Tensor, new_valid: torch.Tensor, positions: torch.Tensor,
                 tree_cols: torch.Tensor | None = None, keep: int = 1) -> torch.Tensor:
        """Feed ids [B, Q] after the cache; returns the last `keep` positions' logits [B, keep, V].

        tree_cols None: the new tokens are causal among themselves (holes where new_valid is False; a hole query
        sees only itself, so no softmax row is empty). tree_cols [Q, W + Q]: what each query sees of this step's W
        draft slots already cached and of the new block (tree attention); earlier slots follow run.valid."""
        b, q = ids.shape
        fixed = static.static_layers(run.cache)
        visible = None
        if tree_cols is not None:
            w = tree_cols.shape[1] - q
            prefix = run.valid[:, None, : run.valid.shape[1] - w].expand(b, q, -1)
            visible = torch.cat([prefix, tree_cols[None].expand(b, -1, -1)], dim=-1)  # [B, Q, S + Q]
        elif fixed or not (bool(run.valid.all()) and bool(new_valid.all())):
            causal = torch.ones(q, q, dtype=torch.bool, device=ids.device).tril()
            new = (causal[None] & new_valid[:, None, :]) | torch.eye(q, dtype=torch.bool, device=ids.device)[None]
            visible = torch.cat([run.valid[:, None, :].expand(b, q, -1), new], dim=-1)  # [B, Q, S + Q]
        if visible is not None and fixed:
            visible = static.over_capacity(run.cache, visible)  # [B, Q, C]
        mask = None if visible is None else additive(visible[:, None], self.model.get_input_embeddings().weight.dtype)
        # A short block keeps every position's logits: HF's logits_to_keep slices the hidden states to a view whose
        # batch stride is not the dense one, and torch's CPU bf16 linear then leaves its fast kernel (a 1-row
        # lm_head took ~30x longer: 450-500 ms instead of 15 ms for 49,152 x 576 on this machine).
        whole = q <= FULL_LOGITS_MAX_BLOCK
        step = run.step if run.valid.shape[1] else self.model  # the prompt: a new length each request, never compiled
        out = step(input_ids=ids, attention_mask=mask, position_ids=positions.expand(b, q), cache=run.cache,
                   use_cache=True, logits_to_keep=0 if whole else keep)
        run.valid = torch.cat([run.valid, new_valid], dim=1)
        return out.logits[:, -keep:] if whole else out.logits


def draft_shape(tree: Any) -> tuple[int, int]:
    """(gamma, branches) from load()'s `tree`: None/"default" (a DEFAULT_GAMMA chain), "chain:<n>",
    "branches:<k>x<n>" (k first-level candidates, each a chain to depth n), or the equivalent choice list
    (`branch_choices`). Other shapes raise TreeError."""
    if tree is None or tree == "default":
        return DEFAULT_GAMMA, 1
    if isinstance(tree, str) and tree.startswith("branches:"):
        k, _, n = tree[len("branches:"):].partition("x")
        if not (k.isdigit() and n.isdigit() and int(k) >= 1 and int(n) >= 1):
            raise TreeError(f"tree {tree!r}: expected 'branches:<k>x<depth>', e.g. 'branches:3x4'")
        return int(n), int(k)
    buffers = load_tree(tree, num_heads=MAX_GAMMA, topk=MAX_BRANCHES)
    branches = int((buffers.depth == 1).sum())
    if sorted(buffers.choices) != sorted(branch_choices(branches, buffers.max_depth)):
        raise TreeError(f"tree {tree!r}: a draft model drafts 'chain:<n>' or 'branches:<k>x<n>' trees")
    return buffers.max_depth, branches


def build_draft_model_drafter(path: Path, model: nn.Module, tree: Any, topk: int, device: torch.device,
                              draft_stop: str | None = None) -> DraftModelDrafter:
    """Behind DRAFTER_BUILDERS["draft_model"]: a draftsmith checkpoint (drafter_type "draft_model") or a plain causal LM
    (a directory, "builtin:<name>" or "early_exit:<model>:<N>") loaded in the target's dtype on `device`, vocabulary
    checked. `draft_stop` (inference.drafters.draft_stop.parse_stop) defaults to the checkpoint's learned stopper when
    it has one, else "fixed"; with a stopper and no `tree`, the draft length is the one it was trained for (its traces'
    max_gamma)."""
    draft = load_draft_model(path, model, device)
    stopper, entry = checkpoint_stopper(path)
    if tree is None and stopper is not None:  # the draft length its stopper was trained for
        tree = f"chain:{entry.get('max_gamma', DEFAULT_GAMMA)}"
    gamma, branches = draft_shape(tree)
    stop = parse_stop(draft_stop, None if stopper is None else stopper.to(device), float(entry.get("threshold", 0.5)))
    return DraftModelDrafter(draft, gamma, branches, stop=stop)
