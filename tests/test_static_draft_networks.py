"""Drafter networks over fixed shapes (DecodeConfig.static_cache / compile). EAGLE-3 (inference.drafters.eagle3): the
draft layer's own cache is static, of the target's capacity, its per-step pairs run in node buckets, and its step and
logits compile; every step's drafted tree must equal the growing cache's, token for token and score for score, for a
draft whose attention matters (a random o_proj: the cache, the masks and the bucket padding all change the drafts when
wrong). A draft model (inference.drafters.draft_model): its cache is static and its forward compiles after the
prompt. A drafter network compiles on CUDA by default (DecodeConfig.compile_drafter); these tests ask for it on the
CPU, and check that it is left eager there by default."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from inference.bench.engine_check import lm_head_eagle3
from inference.drafters.draft_model import DraftModelDrafter
from inference.drafters.eagle3 import Eagle3Drafter, eagle3_tree
from inference.engine import static
from inference.engine.compiled import network_call, target_step
from inference.engine.loop import DecodeConfig, generate
from inference.engine.verify import SamplingParams
from tests.conftest import build_tiny_lm
from tests.cpu_kernel_support import needs_compiler
from tests.test_draft_model import left_pad
from tests.test_lookahead import repetitive_prompts

# a 7-deep static tree: 5 or 7 pending pairs run as buckets of 6 and 9 (padding pairs, cropped after)
TREES = {"dynamic": "dynamic:8:3:2", "static": [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0],
                                                [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]]}


class Recorder:
    """A drafter that records every tree it proposes: its rank paths, node tokens [B, K] and path scores [B, K]."""

    def __init__(self, inner: Eagle3Drafter) -> None:
        self.inner = inner
        self.needs_hidden = inner.needs_hidden
        self.feature_layers = inner.feature_layers
        self.drafts: list[tuple[tuple, list]] = []
        self.scores: list[torch.Tensor] = []

    def propose(self, state):
        draft = self.inner.propose(state)
        self.drafts.append((tuple(draft.tree.choices), draft.tokens.tolist()))
        self.scores.append(draft.scores)
        return draft

    def update(self, state, draft, result) -> None:
        self.inner.update(state, draft, result)


def attentive_drafter(model: torch.nn.Module, tree: object) -> Eagle3Drafter:
    """lm_head_eagle3's draft (it proposes the target's next token) with a small random o_proj, so that what the draft
    layer's attention reads from its cache moves every score and some drafts, while deep drafts still get accepted."""
    draft = lm_head_eagle3(model)
    with torch.no_grad():
        o_proj = draft.midlayer.self_attn.o_proj.weight
        o_proj.copy_(0.05 * torch.randn(o_proj.shape, generator=torch.Generator().manual_seed(0)))
    return Eagle3Drafter(draft, eagle3_tree(tree, [], "cpu", draft_vocab=model.config.vocab_size),
                         model.get_input_embeddings())


def decode(model, drafter, temperature: float = 0.0, **options) -> tuple[object, Recorder]:
    ids, mask = left_pad(repetitive_prompts(7, 3))
    recorder = Recorder(drafter)
    config = DecodeConfig(max_new_tokens=20, sampling=SamplingParams(temperature=temperature), **options)
    out = generate(model, ids, recorder, config, attention_mask=mask, generator=torch.Generator().manual_seed(2))
    return out, recorder


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_lm("llama", seed=17)


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_static_draft_cache_drafts_what_the_growing_one_drafts(model, tree, temperature, single_thread):
    """Three left-padded rows: the same trees, tokens and answers on the growing and the static cache."""
    drafter = attentive_drafter(model, TREES[tree])
    growing, grown = decode(model, drafter, temperature)
    fixed, fixed_drafts = decode(model, drafter, temperature, static_cache=True)
    assert fixed_drafts.drafts == grown.drafts
    for a, b in zip(fixed_drafts.scores, grown.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fixed.sequences == growing.sequences and fixed.stats.accepted == growing.stats.accepted
    pending = [max(step) + 1 for step in growing.stats.accepted[:-1]]  # pairs the next step feeds
    assert max(pending) > 1
    if tree == "static" and temperature == 0:
        assert any(p not in static.BUCKETS for p in pending)  # some feed ran padded


@needs_compiler
@pytest.mark.parametrize("tree", TREES)
def test_the_compiled_draft_drafts_what_the_eager_one_drafts_and_each_shape_compiles_once(tree, single_thread):
    """compile=True: the draft's step and logits are compiled graphs (one per shape, pending pairs in node
    buckets, over a cache of the target's capacity), the drafts equal eager's, and a second generation of the same
    shapes compiles nothing (its compile time is 0; the first one's is billed apart from drafting)."""
    model = build_tiny_lm("llama", seed=19)  # its own draft networks
    drafter = attentive_drafter(model, TREES[tree])
    eager, eager_drafts = decode(model, drafter, static_cache=True)
    torch._dynamo.reset()  # graphs of the same shapes compiled by earlier tests would be reused, and not counted
    graphs = counters["stats"]["unique_graphs"]
    compiled, compiled_drafts = decode(model, drafter, compile=True, compile_drafter=True)  # on a CPU too
    assert compiled_drafts.drafts == eager_drafts.drafts and compiled.sequences == eager.sequences
    for a, b in zip(compiled_drafts.scores, eager_drafts.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    step, logits = network_call(drafter.draft, "step"), network_call(drafter.draft, "logits")
    assert step.seen and logits.seen
    assert counters["stats"]["unique_graphs"] - graphs >= len(step.seen) + len(logits.seen)  # none ran eagerly
    widths = {key[0][0][1] for key in step.seen}  # hidden [B, Q, D]: pending pairs (bucketed) or a level's queries
    assert widths <= set(static.BUCKETS)
    target_capacities = {key[2] for key in target_step(model, True).seen}  # (B, bucket, C, ...)
    assert {key[-1] for key in step.seen} == {("cache", c, 3) for c in target_capacities}  # the target's C, 3 rows
    again, _ = decode(model, drafter, compile=True, compile_drafter=True)
    assert again.sequences == compiled.sequences and again.stats.times.compile == 0
    assert compiled.stats.times.compile > 0


@needs_compiler
def test_a_draft_model_drafts_over_its_own_static_cache_through_its_compiled_forward(single_thread):
    """A different small LM drafting for the target, 3 branches: the static and compiled runs accept what the growing
    run accepts at every step; after the prompt the draft model's forward runs as graphs of the pending pair and of
    the branches, over the target's capacity, and a second generation compiles nothing."""
    target, small = build_tiny_lm("llama", seed=23), build_tiny_lm("llama", seed=29)
    ids, mask = left_pad(repetitive_prompts(7, 3))

    def run(**options):
        out = generate(target, ids, DraftModelDrafter(small, 3, branches=3), DecodeConfig(max_new_tokens=16, **options),
                       attention_mask=mask)
        return out.sequences, out.stats.accepted, out.stats.times.compile

    growing = run()
    torch._dynamo.reset()
    assert run(static_cache=True)[:2] == growing[:2]
    compiled = run(compile=True, compile_drafter=True)  # on a CPU too (it defaults to CUDA only)
    assert compiled[:2] == growing[:2] and compiled[2] > 0
    forward = network_call(small, "forward")
    inputs = [dict(key) for key in forward.seen]  # keyword -> its shape key
    assert {shape[0] for shape in (k["input_ids"] for k in inputs)} == {(3, 2), (3, 3)}  # the pending pair, branches
    capacities = {key[2] for key in target_step(target, True).seen}  # (B, bucket, C, ...)
    assert {k["cache"] for k in inputs} == {("cache", c, 3) for c in capacities}
    assert run(compile=True, compile_drafter=True) == (*growing[:2], 0)


@needs_compiler
def test_a_drafter_network_is_left_eager_on_a_cpu_unless_asked(single_thread):
    """compile=True alone on a CPU compiles the target's step, not the draft's (compile_drafter=None: CUDA only,
    where a draft step is bound by kernel launches rather than weight reads)."""
    model = build_tiny_lm("llama", seed=31)
    drafter = attentive_drafter(model, TREES["static"])
    eager, eager_drafts = decode(model, drafter, static_cache=True)
    compiled, compiled_drafts = decode(model, drafter, compile=True)
    assert compiled_drafts.drafts == eager_drafts.drafts and compiled.stats.times.compile > 0  # the target compiled
    assert not network_call(drafter.draft, "step").seen and not network_call(drafter.draft, "logits").seen
