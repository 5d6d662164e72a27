"""The generation loop: prefill, then per step draft -> forward -> verify -> accept (cache surgery) -> commit.

Dimension letters: B batch, T prompt length, S cached slots, K tree nodes, V vocab, D hidden.

One target forward per step runs the whole draft tree (tree attention through a 4-D additive mask, explicit
position ids, a stock DynamicCache writing into preallocated slots) and yields the logits of every node. A step
commits the accepted drafts plus the target's own next token, so it always makes progress; with `NoDrafter` it is
plain autoregressive decoding.
Lossless: with acceptance="exact" the output equals (greedy) or is distributed as (sampling) decoding the target
alone with the same `SamplingParams`. acceptance="typical" is lossy. "Equals" is up to floating point: a K-node
forward may round differently from a one-token forward, which can flip a near-tied argmax (rare in fp32, less rare
in bf16), exactly as batching does in plain decoding. On the CPU, the loop runs a bf16 model's few-row linears through
the engine's own kernel (inference.kernels.cpu_linear; `DecodeConfig.cpu_kernel=False` keeps stock PyTorch), which
rounds like stock up to summation order: the same kind of difference. Masked forwards of a grouped-query model on the
CPU skip stock sdpa's key/value copy (inference.kernels.attention; bit-identical outputs; a one-query bf16 forward
runs in fp32, rounding only). The cache's layers write new keys/values into preallocated slots instead of
concatenating (inference.engine.cache.SlotLayer; the same values). With `static_cache` (or `compile`) the cache has a
fixed capacity and trees run in node buckets (inference.engine.static), so every step has one of a few shapes, and
with `compile` the target's forward for those shapes is a compiled graph (inference.engine.compiled); the prefill
stays eager.

Devices (a target split by `device_map`, see inference.engine.devices): the loop's state, the drafts and the masks live
on the input embeddings' device; the cache layers stay on their own layers' devices; logits are turned into tokens
where they come back (`verify_device`) and the resulting tokens are moved to the state's device.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from inference.engine import static
from inference.engine.cache import commit_slots, keep_nodes, new_cache, prefill_inputs, tree_inputs
from inference.engine.compiled import TargetStep, compile_seconds, has_compiled_step, on_cuda, target_step
from inference.engine.context import check_context, check_window, context_length, within_context
from inference.engine.devices import cuda_sync, input_device
from inference.engine.drafter import DecodeState, Draft, Drafter, NoDrafter
from inference.engine.options import check, option
from inference.engine.tree import tree_on
from inference.engine.verify import (
    SamplingParams, VerifyResult, next_token, verify_greedy, verify_rejection, verify_speculative, verify_typical,
)
from inference.kernels.attention import gqa_attention
from inference.kernels.cpu_linear import fast_linears

ACCEPTANCE = ("exact", "typical")  # how drafts are accepted: "exact" lossless, "typical" Medusa's LOSSY rule
TREE_SLOTS = 64  # cache slots reserved beyond the prompt and max_new_tokens for a step's tree (a wider one regrows)


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = option(128, type=int, valid=lambda v: v >= 1, must=">= 1",
                                 help="the most tokens a reply gets (a command's own default)")
    sampling: SamplingParams = SamplingParams()
    acceptance: str = option(
        "exact", choices=ACCEPTANCE,
        help="exact: lossless (greedy at T=0, rejection sampling above); typical: Medusa's typical acceptance, LOSSY "
             "(outputs are not distributed as the target's; same as exact at T=0)")
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    eos_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # generation stops after any of these id sequences
    cpu_kernel: bool = True  # few-row bf16 CPU linears through inference.kernels.cpu_linear (stock where unsupported)
    gqa_attention: bool = True  # masked CPU sdpa without repeat_kv (inference.kernels.attention; same outputs as stock)
    slot_cache: bool = True  # the target's KV cache in preallocated slots (inference.engine.cache.SlotLayer); False:
    # stock DynamicCache concatenation (the same values; a baseline for benchmarks)
    static_cache: bool = False  # a fixed-capacity cache and trees run in node buckets: fixed step shapes
    # (inference.engine.static)
    compile: bool = False  # the target's decode step through torch.compile (inference.engine.compiled); implies
    # static_cache
    cache_slots: int | None = None  # the static cache's capacity (None: each request's own, inference.engine.static)
    # with compile, a drafter's network too (EAGLE-3's draft layer, a draft model). None: on CUDA only, where an eager
    # draft step is bound by kernel launches; on a CPU it is bound by weight reads and each compiled call adds guard
    # checks (docs/design.md: SmolLM2's EAGLE-3 draft step 10.2 ms eager, 11.3 compiled)
    compile_drafter: bool | None = None
    sync_phases: bool = False  # on CUDA, wait for the device at both ends of every timed phase: right per-phase
    # times (benchmarks) for the overlap of one phase's kernels with the next one's launches; off, only totals are right

    @property
    def fixed_shapes(self) -> bool:
        """A static cache and bucketed trees: asked for, or implied by `compile`."""
        return self.static_cache or self.compile

    def __post_init__(self) -> None:
        check(self, error=ValueError)
        if any(len(s) == 0 for s in self.stop_sequences):
            raise ValueError("stop_sequences must not contain an empty sequence")


# A request's sampling parameters, declared once in these groups' fields (max_new_tokens, acceptance; temperature,
# top_k, top_p): Engine.generate's keywords, the command line's flags and their checks read them.
SAMPLING_GROUPS = (DecodeConfig, SamplingParams)


@dataclass(frozen=True)
class StepTimes:
    """Wall-clock seconds per phase, summed over the run; `other` is commit, stop checks and streaming. `compile`: the
    target steps that compiled a new shape (DecodeConfig.compile), apart from the rest and not in `total`."""

    prefill: float
    draft: float
    forward: float
    verify: float
    cache: float
    other: float
    compile: float = 0.0

    @property
    def total(self) -> float:
        """Seconds of generation, compilation excluded."""
        return self.prefill + self.draft + self.forward + self.verify + self.cache + self.other


@dataclass(frozen=True)
class GenerationStats:
    target_forwards: int  # prefill included
    accepted: tuple[tuple[int, ...], ...]  # [step][row] accepted drafts; -1 for rows already finished
    new_tokens: int  # returned tokens, all rows
    times: StepTimes

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def mean_accepted(self) -> float:
        """Mean accepted drafts per step over active rows (tokens per step = this + 1)."""
        live = [a for step in self.accepted for a in step if a >= 0]
        return sum(live) / max(len(live), 1)

    def per_step(self) -> StepTimes:
        """Mean seconds per decoding step for each phase (prefill stays its one-off total)."""
        n = max(self.steps, 1)
        t = self.times
        return StepTimes(t.prefill, t.draft / n, t.forward / n, t.verify / n, t.cache / n, t.other / n, t.compile)


@dataclass(frozen=True)
class GenerationOutput:
    sequences: list[list[int]]  # new tokens per row (prompt excluded), trimmed at EOS / stop / max_new_tokens
    stats: GenerationStats
    texts: list[str] | None = None  # each row's reply, for a text prompt (inference.api.Engine.generate)


@dataclass
class _Clock:
    """Seconds per phase. `sync` (a model on CUDA, see inference.engine.devices.cuda_sync) runs at both ends of every
    phase: kernel launches return before their work is done, so without it each phase would be billed for its
    predecessor's kernels (the tree forward's time showed up under verify, whose host-side walk waits for the logits).
    It costs the overlap of one phase's kernels with the next phase's launches."""

    sync: Callable[[], None] | None = None
    totals: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("prefill", "draft", "forward", "verify", "cache", "compile"), 0.0)
    )

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.sync is not None:
            self.sync()
        start = time.perf_counter()
        yield
        if self.sync is not None:
            self.sync()
        self.totals[phase] += time.perf_counter() - start


def hidden_request(needs_hidden: bool, layers: tuple[int, ...]) -> dict[str, list[int]]:
    """The forward's `output_hidden_states` for what a drafter reads: the final-norm state (index -1) and/or the
    `layers` it fuses (transformers' hidden_states numbering); only those are kept."""
    wanted = [*layers, *([-1] if needs_hidden else [])]
    return {"output_hidden_states": wanted} if wanted else {}


def layer_features(out: Any, layers: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """[B, Q, L*D]: the requested hidden states of a forward's output, concatenated in `layers` order on `device`
    (the state's: a target split by device_map returns each layer's states from its own device)."""
    return torch.cat([out.hidden_states[i].to(device) for i in layers], dim=-1) if layers else None


def prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, pad_mask: torch.Tensor, config: DecodeConfig,
    needs_hidden: bool, generator: torch.Generator | None, layers: tuple[int, ...] = (),
) -> DecodeState:
    """Run the prompt [B, T] through the target; the first committed token becomes the root. `layers`: the hidden
    states a feature drafter reads, kept for every prompt position in `state.features`."""
    dtype = model.get_input_embeddings().weight.dtype
    mask, positions = prefill_inputs(pad_mask, dtype)
    if config.fixed_shapes:
        slots = config.cache_slots or static.capacity_for(input_ids.shape[1] + config.max_new_tokens + TREE_SLOTS)
        cache, mask = static.new_static_cache(slots), static.prefill_mask(pad_mask, dtype, slots)
    else:
        cache = new_cache(reserve=config.max_new_tokens + TREE_SLOTS, slots=config.slot_cache)
    out = model(
        input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
        logits_to_keep=1, **hidden_request(needs_hidden, layers),
    )
    last = out.logits[:, -1]  # [B, V]
    root = next_token(last.to(verify_device(last, config, generator)), config.sampling, generator)  # [B]
    return DecodeState(
        cache=cache,
        valid=pad_mask.clone(),
        next_pos=pad_mask.long().sum(-1),
        root=root.to(input_ids.device),
        hidden=out.hidden_states[-1][:, -1] if needs_hidden else None,
        prompt=input_ids,
        generated=[[t] for t in root.tolist()],
        sampling=config.sampling,
        generator=generator,
        features=layer_features(out, layers, input_ids.device),
        compile_drafter=config.compile and (on_cuda(model) if config.compile_drafter is None
                                            else config.compile_drafter),
    )


def forward_tree(
    model: torch.nn.Module, state: DecodeState, draft: Draft, needs_hidden: bool, layers: tuple[int, ...] = (),
    step: TargetStep | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target forward over the tree: logits [B, K, V] and, when asked, final-norm hidden states [B, K, D].
    Appends K slots to the cache (W = static.bucket(K) over a static cache, the padding dropped from what returns).
    With `layers`, `state.features` becomes those layers at every node [B, K, L*D] (the same forward: no second
    target pass). `step`: how the forward is called (compiled or not; default: the model itself)."""
    dtype = model.get_input_embeddings().weight.dtype
    tokens, k = draft.tokens, draft.tree.num_nodes
    if static.static_layers(state.cache):
        width = static.bucket(k)
        static.ensure_capacity(state.cache, state.valid.shape[1] + width)
        slots = static.capacity(state.cache)
        mask, positions = static.tree_inputs(draft.tree, state.valid, state.next_pos, dtype, slots, width)
        tokens = static.pad_tokens(tokens, width)
    else:
        mask, positions = tree_inputs(draft.tree, state.valid, state.next_pos, dtype)
    positions = within_context(positions, context_length(model.config))
    out = (step or model)(
        input_ids=tokens, attention_mask=mask, position_ids=positions, cache=state.cache, use_cache=True,
        **hidden_request(needs_hidden, layers),
    )
    if layers:
        state.features = layer_features(out, layers, draft.tokens.device)[:, :k]
    return out.logits[:, :k], (out.hidden_states[-1][:, :k] if needs_hidden else None)


def verify_device(logits: torch.Tensor, config: DecodeConfig, generator: torch.Generator | None) -> torch.device:
    """Where target logits become tokens: their own device (a split target may return them from its last device),
    except when sampling draws from a seeded generator on another device (a generator draws only on its own)."""
    if generator is None or config.sampling.greedy:
        return logits.device
    return generator.device


def verify(draft: Draft, logits: torch.Tensor, config: DecodeConfig, generator: torch.Generator | None) -> VerifyResult:
    """Pick the rule: greedy at temperature 0 (whatever `acceptance` says: typical acceptance degenerates to it),
    else rejection sampling (exact; the p/q rule when the drafts were sampled) or typical acceptance (lossy).
    Runs on `verify_device`, moving the draft there (not the [B, K, V] logits, unless a generator asks); the result
    comes back on the draft's device."""
    home = draft.tokens.device
    return _verify_on(_draft_on(draft, verify_device(logits, config, generator)), logits, config, generator).to(home)


def _draft_on(draft: Draft, device: torch.device) -> Draft:
    if draft.tokens.device == device:
        return draft
    probs = None if draft.probs is None else draft.probs.to(device)
    return Draft(tree=tree_on(draft.tree, device), tokens=draft.tokens.to(device), probs=probs,
                 replacement=draft.replacement)


def _verify_on(
    draft: Draft, logits: torch.Tensor, config: DecodeConfig, generator: torch.Generator | None
) -> VerifyResult:
    logits = logits.to(draft.tokens.device)
    if config.sampling.greedy:
        return verify_greedy(draft.tokens, logits, draft.tree)
    if config.acceptance == "typical":
        return verify_typical(
            draft.tokens, logits, draft.tree, config.sampling, config.typical_epsilon, config.typical_delta, generator
        )
    if draft.probs is not None:
        return verify_speculative(
            draft.tokens, logits, draft.probs, draft.tree, config.sampling, generator, draft.replacement
        )
    return verify_rejection(draft.tokens, logits, draft.tree, config.sampling, generator)


def accept(state: DecodeState, result: VerifyResult, hidden: torch.Tensor | None, tree_slots: int | None = None
           ) -> None:
    """Keep the accepted path in the cache (root + accepted drafts per row), advance positions, set the new root.
    `tree_slots`: the slots the tree forward appended (its nodes, padding included; default: read from the cache)."""
    start = state.valid.shape[1]
    width = int(result.num_accepted.max()) + 1
    keep_nodes(state.cache, start, result.path[:, :width].clamp(min=0), tree_slots)
    state.valid = commit_slots(state.valid, result.num_accepted, width)
    state.next_pos = state.next_pos + result.num_accepted + 1
    state.root = result.next_token
    if hidden is not None:
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        state.hidden = hidden[rows, result.node.to(hidden.device)]  # [B, D]
    for row, (toks, n) in enumerate(zip(result.tokens.tolist(), result.num_accepted.tolist())):
        state.generated[row].extend(toks[: n + 1])


def stop_index(tokens: list[int], start: int, config: DecodeConfig) -> int | None:
    """Length to cut `tokens` to if a stop condition fires at or after index `start`, else None."""
    for i in range(start, len(tokens)):
        if i + 1 >= config.max_new_tokens or tokens[i] in config.eos_token_ids:
            return min(i + 1, config.max_new_tokens)
        for seq in config.stop_sequences:
            if i + 1 >= len(seq) and tuple(tokens[i + 1 - len(seq) : i + 1]) == seq:
                return i + 1
    return None


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    drafter: Drafter | None = None,
    config: DecodeConfig = DecodeConfig(),
    attention_mask: torch.Tensor | None = None,
    stream: Callable[[int, list[int]], bool | None] | None = None,
    generator: torch.Generator | None = None,
) -> GenerationOutput:
    """Decode up to `config.max_new_tokens` new tokens per row of `input_ids` [B, T] (left-padded when
    `attention_mask` [B, T] marks padding with 0). `stream(row, tokens)` receives each row's tokens as they are
    committed; returning True stops that row there (e.g. a stop string found in the decoded text). Rows that stop
    early keep riding along in the batch; their extra tokens are discarded."""
    drafter = drafter if drafter is not None else NoDrafter()
    input_ids = input_ids.to(input_device(model))
    pad_mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    pad_mask = pad_mask.to(input_ids.device)
    if not bool(pad_mask[:, -1].all()):
        raise ValueError("attention_mask: prompts must be left-padded (the last column must be all real tokens)")
    check_window(model, input_ids.shape[1] + config.max_new_tokens)
    check_context(model.config, int(pad_mask.sum(-1).max()), config.max_new_tokens)
    if config.fixed_shapes:
        static.check_slots(config.cache_slots, input_ids.shape[1], config.max_new_tokens, TREE_SLOTS)
    modules = drafter_modules(drafter)
    with fast_linears(model, *modules, enabled=config.cpu_kernel), \
            gqa_attention(model, *modules, enabled=config.gqa_attention):
        return _generate(model, input_ids, pad_mask, drafter, config, stream, generator)


def feature_layers(drafter: Drafter) -> tuple[int, ...]:
    """The target hidden states a feature drafter reads (`Drafter.feature_layers`; none for the others)."""
    return tuple(getattr(drafter, "feature_layers", ()))


def drafter_modules(drafter: Drafter) -> list[torch.nn.Module]:
    """The modules a drafter holds as attributes (heads, a draft model, a stopper), and those of the drafters it wraps
    (WithLookup's inner drafter), for `fast_linears` and `gqa_attention`."""
    found = []
    for value in getattr(drafter, "__dict__", {}).values():
        if isinstance(value, torch.nn.Module):
            found.append(value)
        elif value is not drafter and callable(getattr(value, "propose", None)):  # a wrapped drafter
            found += drafter_modules(value)
    return found


def _generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    pad_mask: torch.Tensor,
    drafter: Drafter,
    config: DecodeConfig,
    stream: Callable[[int, list[int]], bool | None] | None,
    generator: torch.Generator | None,
) -> GenerationOutput:
    clock = _Clock(sync=cuda_sync(model) if config.sync_phases else None)
    start = time.perf_counter()
    drafter_compiled = compile_seconds()
    layers = feature_layers(drafter)
    made = config.compile and not has_compiled_step(model)
    with clock("compile") if made else nullcontext():  # the first torch.compile imports inductor (~1 s)
        step = target_step(model, config.compile)
    with clock("prefill"):
        state = prefill(model, input_ids, pad_mask, config, drafter.needs_hidden, generator, layers)
    batch = input_ids.shape[0]
    out: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    accepted: list[tuple[int, ...]] = []
    _commit(state, out, done, config, stream)
    while not all(done):
        with clock("draft"):
            draft = drafter.propose(state)
        with clock("compile" if step.compiles(state, draft, drafter.needs_hidden, layers) else "forward"):
            logits, hidden = forward_tree(model, state, draft, drafter.needs_hidden, layers, step)
        with clock("verify"):
            result = verify(draft, logits, config, generator)
        with clock("cache"):
            accept(state, result, hidden, static.tree_slots(state.cache, draft.tree.num_nodes))
        state.logits = logits  # kept for drafters that iterate on the target's predictions (Jacobi)
        with clock("draft"):
            drafter.update(state, draft, result)
        accepted.append(tuple(-1 if d else n for d, n in zip(done, result.num_accepted.tolist())))
        _commit(state, out, done, config, stream)
    finish = getattr(drafter, "finish", None)
    if finish is not None:
        with clock("draft"):
            finish(out)
    elapsed = time.perf_counter() - start
    compiling = compile_seconds() - drafter_compiled  # a drafter network's new shapes, timed inside "draft"
    clock.totals["draft"] -= compiling
    clock.totals["compile"] += compiling
    times = StepTimes(**clock.totals, other=max(elapsed - sum(clock.totals.values()), 0.0))
    stats = GenerationStats(
        target_forwards=1 + len(accepted), accepted=tuple(accepted), new_tokens=sum(map(len, out)), times=times
    )
    return GenerationOutput(sequences=out, stats=stats)


def _commit(
    state: DecodeState, out: list[list[int]], done: list[bool], config: DecodeConfig,
    stream: Callable[[int, list[int]], bool | None] | None,
) -> None:
    """Move each active row's newly committed tokens into `out`, applying stop conditions."""
    for row, tokens in enumerate(state.generated):
        if done[row]:
            continue
        before = len(out[row])
        out[row].extend(tokens[before:])
        cut = stop_index(out[row], before, config)
        if cut is not None:
            del out[row][cut:]
            done[row] = True
        if stream is not None and len(out[row]) > before and stream(row, out[row][before:]) is True:
            done[row] = True
