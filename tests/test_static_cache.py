"""The static cache, node buckets and the compiled step (inference.engine.static, inference.engine.compiled): the
same greedy answers as the growing cache, in fp32, for every kind of draft."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from inference.bench.engine_check import lm_head_eagle3, lm_head_heads
from inference.drafters.draft_model import DraftModelDrafter
from inference.drafters.eagle3 import Eagle3Drafter, eagle3_tree
from inference.drafters.jacobi import JacobiDrafter
from inference.drafters.lookahead import LookaheadDrafter
from inference.drafters.medusa import MedusaDrafter
from inference.drafters.prompt_lookup import PromptLookupDrafter
from inference.engine import static
from inference.engine.cache import tree_inputs
from inference.engine.compiled import target_step
from inference.engine.loop import DecodeConfig, generate
from inference.engine.tree import build_tree, load_tree
from inference.engine.verify import SamplingParams
from inference.kernels import cpu_linear
from tests.conftest import build_tiny_lm
from tests.cpu_kernel_support import needs_compiler
from tests.test_draft_model import left_pad
from tests.test_lookahead import repetitive_prompts


KINDS = ["plain", "prompt_lookup", "jacobi", "lookahead", "medusa", "eagle3", "draft_model"]


def drafters(model: nn.Module) -> dict[str, object]:
    tree = eagle3_tree("dynamic:8:3:2", [], "cpu", draft_vocab=model.config.vocab_size)
    return {
        "plain": None,
        "prompt_lookup": PromptLookupDrafter(num_draft=5),  # chains of changing length: several buckets
        "jacobi": JacobiDrafter(),
        "lookahead": LookaheadDrafter(),
        "medusa": MedusaDrafter(lm_head_heads(model, 3), load_tree("default", num_heads=3, topk=10)),  # 16 nodes
        "eagle3": Eagle3Drafter(lm_head_eagle3(model), tree, model.get_input_embeddings()),  # trees, features, hidden
        "draft_model": DraftModelDrafter(model, 3),  # its own static cache beside the target's
    }


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_static_cache_answers_equal_the_growing_cache(tiny_lm, name, temperature, single_thread):
    """Three left-padded rows of different lengths: every row's answer and every step's acceptance are the growing
    cache's, greedy and seeded sampling (the same draws: padding nodes draw nothing)."""
    ids, mask = left_pad(repetitive_prompts(7, 3))

    def run(**static_options):  # a fresh drafter each time: lookahead keeps its n-gram pool across generations
        config = DecodeConfig(max_new_tokens=24, sampling=SamplingParams(temperature=temperature), **static_options)
        return generate(tiny_lm, ids, drafters(tiny_lm)[name], config, attention_mask=mask,
                        generator=torch.Generator().manual_seed(3))

    growing, fixed = run(), run(static_cache=True)
    assert fixed.sequences == growing.sequences
    assert fixed.stats.accepted == growing.stats.accepted
    if name != "plain" and temperature == 0:
        assert growing.stats.mean_accepted > 0  # drafts were accepted: the surgery ran


def test_bucket_masks_hide_the_padding_and_match_the_growing_cache_on_real_nodes():
    tree = build_tree([(0,), (1,), (0, 0)], num_heads=2, topk=2)  # K = 4 nodes, run as 4; take a bucket of 8
    valid = torch.tensor([[True, True, True, True, True], [False, False, True, True, True]])  # [B, S]
    next_pos = torch.tensor([5, 3])
    mask, positions = static.tree_inputs(tree, valid, next_pos, torch.float32, slots=16, width=8)
    assert mask.shape == (2, 1, 8, 16) and positions.shape == (2, 8)
    visible = mask[:, 0] == 0  # [B, W, C]
    grown, grown_positions = tree_inputs(tree, valid, next_pos, torch.float32)
    assert torch.equal(visible[:, :4, :9], grown[:, 0] == 0)  # real nodes: the growing cache's mask
    assert torch.equal(positions[:, :4], grown_positions)
    pad_keys = visible[:, :, 9:13]  # [B, W, 4]: the padding nodes' slots, seen by themselves only
    assert torch.equal(pad_keys, torch.eye(8, dtype=torch.bool)[:, 4:].expand(2, 8, 4))
    assert torch.equal(visible[:, 4:, :5], valid[:, None].expand(2, 4, 5))  # padding sees the valid slots ...
    assert not visible[:, 4:, 5:9].any()  # ... and no real node
    assert not visible[:, :, 13:].any()  # slots past the tree: stale, hidden
    assert positions[:, 4:].tolist() == [[5] * 4, [3] * 4]  # padding at the root's position
    assert static.pad_tokens(torch.tensor([[7, 8, 9, 10]]), 8).tolist() == [[7, 8, 9, 10, 7, 7, 7, 7]]


def test_buckets_and_capacities():
    assert [static.bucket(k) for k in (1, 2, 3, 5, 9, 10, 33, 64, 65, 100)] == [1, 2, 3, 6, 9, 12, 48, 64, 65, 100]
    assert all(static.bucket(k) <= 1.5 * k for k in range(1, 65))
    assert static.capacity_for(1) == static.CAPACITY_STEP and static.capacity_for(static.CAPACITY_STEP + 1) == \
        2 * static.CAPACITY_STEP


def test_a_static_layer_grows_keeping_its_entries():
    cache = static.new_static_cache(4)
    keys = torch.randn(1, 2, 3, 8)
    cache.update(keys, -keys, 0)
    assert static.static_layers(cache) and static.capacity(cache) == 4
    static.ensure_capacity(cache, 6)  # rounds up to a multiple of CAPACITY_STEP
    layer = cache.layers[0]
    assert static.capacity(cache) == static.CAPACITY_STEP == layer.keys.shape[2]
    assert torch.equal(layer.keys[:, :, :3], keys) and torch.equal(layer.values[:, :, :3], -keys)
    assert int(layer.get_seq_length()) == 3
    cache.update(keys, keys, 0)  # the next write lands after the kept entries
    assert torch.equal(layer.keys[:, :, 3:6], keys)


@needs_compiler
@pytest.mark.parametrize("name", ["prompt_lookup", "eagle3"])
def test_compiled_step_answers_equal_eager_and_compile_time_is_apart(name, single_thread):
    """One compile per shape: a second generation of the same shapes compiles nothing. EAGLE-3 reads the target's
    hidden states and fused layers out of the compiled forward."""
    model = build_tiny_lm("llama", seed=11)  # its own model: a fresh compiled step, whatever ran before
    ids, mask = left_pad(repetitive_prompts(7, 2))
    drafter = drafters(model)[name]
    eager = generate(model, ids, drafter, DecodeConfig(max_new_tokens=16), attention_mask=mask)
    first = generate(model, ids, drafter, DecodeConfig(max_new_tokens=16, compile=True), attention_mask=mask)
    again = generate(model, ids, drafter, DecodeConfig(max_new_tokens=16, compile=True), attention_mask=mask)
    assert first.sequences == eager.sequences == again.sequences
    assert first.stats.accepted == eager.stats.accepted
    assert first.stats.times.compile > 0 and again.stats.times.compile == 0  # billed by shape, not by timing
    times = first.stats.times
    assert times.total == pytest.approx(times.prefill + times.draft + times.forward + times.verify + times.cache
                                        + times.other)  # compile is not in total


seen_before: defaultdict[int, set] = defaultdict(set)  # shapes a model's compiled step met in earlier tests


@needs_compiler
@pytest.mark.parametrize("name", KINDS)
def test_compiled_seeded_sampling_equals_eager(tiny_lm_factory, name, single_thread):
    """Every drafter kind, a left-padded batch, seeded sampling: the compiled step draws the same tokens (and stays
    compiled: past dynamo's recompile limit it would run eagerly and still pass)."""
    model = tiny_lm_factory("llama")
    ids, mask = left_pad(repetitive_prompts(7, 3))

    def run(**compiled):
        config = DecodeConfig(max_new_tokens=16, sampling=SamplingParams(temperature=0.8), **compiled)
        return generate(model, ids, drafters(model)[name], config, attention_mask=mask,
                        generator=torch.Generator().manual_seed(5))

    eager = run()
    graphs = counters["stats"]["unique_graphs"]
    compiled = run(compile=True)
    assert compiled.sequences == eager.sequences and compiled.stats.accepted == eager.stats.accepted
    new_shapes = sum(1 for key in target_step(model, True).seen if key not in seen_before[id(model)])
    seen_before[id(model)] |= target_step(model, True).seen
    assert counters["stats"]["unique_graphs"] - graphs >= new_shapes  # each new shape compiled (none ran eagerly)


@pytest.mark.skipif(not cpu_linear.cpu_supported() or cpu_linear.load_kernel() is None,
                    reason="the engine's CPU kernel does not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kernel_linear_compiles_into_one_graph_with_the_kernel_in_it(dtype, monkeypatch):
    """No graph break at the kernel (fullgraph=True would raise), and the compiled layer gives the eager kernel's
    result."""
    monkeypatch.setattr(cpu_linear, "fp32_route_supported", lambda: True)
    layer = nn.Linear(64, 48, dtype=dtype).requires_grad_(False)
    cpu_linear.install(layer)
    assert isinstance(layer, cpu_linear.KernelLinear)
    x = torch.randn(1, 64, dtype=dtype)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.inference_mode(), cpu_linear.fast_linears(layer):
        eager = layer(x)
        assert torch.equal(compiled(x), eager)


def test_a_request_past_a_fixed_capacity_is_refused_in_one_line(tiny_lm_factory):
    model = tiny_lm_factory("llama")
    ids = torch.randint(3, 100, (1, 40))
    config = DecodeConfig(max_new_tokens=100, static_cache=True, cache_slots=200)
    with pytest.raises(ValueError, match=r"^cache_slots=200: 40 prompt token\(s\) \+ max_new_tokens=100 \+ 64 tree "
                                         r"slots need 204; at most 96 new tokens fit$"):
        generate(model, ids, None, config)
    fits = generate(model, ids, None, DecodeConfig(max_new_tokens=96, static_cache=True, cache_slots=200))
    plain = generate(model, ids, None, DecodeConfig(max_new_tokens=96))
    assert fits.sequences == plain.sequences


@needs_compiler
def test_load_and_the_command_line_take_compile(tmp_path, capsys, single_thread):
    """`load(..., compile=True, cache_slots=N)` and `python -m inference generate --compile --cache-slots N --json`
    give the eager engine's text and report the compile time apart."""
    from inference import load
    from inference.cli import main
    from tests.model_support import save_tiny_model

    base = str(save_tiny_model(tmp_path / "model", initializer_range=0.2))
    eager = load("prompt_lookup", base=base, dtype="fp32")
    compiled = load("prompt_lookup", base=base, dtype="fp32", compile=True, cache_slots=256)
    assert compiled.compile and compiled.cache_slots == 256
    question = "hello world, what is two plus three?"
    assert compiled.generate(question, max_new_tokens=12) == eager.generate(question, max_new_tokens=12)
    argv = ["generate", "--drafter", "prompt_lookup", "--base", base, "--dtype", "fp32", "--prompt", question,
            "--max-new-tokens", "12", "--json"]
    capsys.readouterr()  # what the loads above printed
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--compile", "--cache-slots", "256"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["text"] == plain["text"] and fast["token_ids"] == plain["token_ids"]
    assert plain["stats"]["compile_s"] == 0 and fast["stats"]["compile_s"] >= 0
