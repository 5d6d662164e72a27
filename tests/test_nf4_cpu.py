"""NF4 on any x86 CPU: bitsandbytes' CPU backend has two 4-bit code paths, and both must compute x·Wᵀ with W the
dequantised NF4 weight.

- packed: on CPUs with AVX-512-bf16 (`has_avx512bf16()`), a Linear4bit repacks its weight into a CPU layout on its
  first no-grad forward in eval mode and runs a fused kernel; this needs in_features % 64 == 0 (the quantisation
  block) and out_features % 32 == 0, so the loader refuses other shapes on every CPU (models.loading.check_nf4_on_cpu).
- dequantise-then-matmul: everywhere else. `has_avx512bf16` is read when a Linear4bit is built, so patching
  `bitsandbytes.nn.modules.has_avx512bf16` to False before loading forces this path on an AVX-512 machine too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.loading import ModelLoadError, load_target, nf4_cpu_path
from tests.model_support import save_tiny_model

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes.functional import dequantize_4bit, has_avx512bf16  # noqa: E402

NO_AVX512BF16 = pytest.mark.skipif(not has_avx512bf16(), reason="this CPU has no AVX-512-bf16")
PATHS = {"packed": pytest.param("packed", marks=NO_AVX512BF16), "dequantise": "dequantise"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("nf4")
    return {hidden: save_tiny_model(root / f"hidden{hidden}", hidden_size=hidden) for hidden in (32, 64)}


def load_nf4(path: Path, path_kind: str, monkeypatch) -> torch.nn.Module:
    if path_kind == "dequantise":
        monkeypatch.setattr("bitsandbytes.nn.modules.has_avx512bf16", lambda: False)
    return load_target(str(path), dtype="bf16", quantization="nf4", device_map="cpu")


@pytest.mark.parametrize("path_kind", PATHS.values())
def test_each_cpu_path_computes_the_dequantised_product(path_kind, model_dirs, monkeypatch):
    model = load_nf4(model_dirs[64], path_kind, monkeypatch)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down per layer; lm_head stays unquantised
    assert nf4_cpu_path(model).startswith("packed" if path_kind == "packed" else "dequantise")
    # The dequantised weights, read before the first forward (which may repack them).
    weights = {name: dequantize_4bit(m.weight.data, m.weight.quant_state).float() for name, m in layers.items()}
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(name: str):
        def hook(module, args, out) -> None:
            seen[name] = (args[0], out)
        return hook

    for name, layer in layers.items():
        layer.register_forward_hook(record(name))
    ids = torch.tensor([[1, 5, 6, 7, 8, 9], [1, 10, 11, 12, 13, 14]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    assert sorted(seen) == sorted(layers)
    for name, (x, out) in seen.items():
        expected = x.float() @ weights[name].T
        assert torch.allclose(out.float(), expected, rtol=0.02, atol=0.02 * expected.abs().max().item()), name
    packed = [bool(getattr(m.weight.quant_state, "packing_format_for_cpu", False)) for m in layers.values()]
    assert packed == [path_kind == "packed"] * len(layers)


def test_packed_and_dequantised_paths_agree(model_dirs, monkeypatch):
    if not has_avx512bf16():
        pytest.skip("this CPU has no AVX-512-bf16: only the dequantise path exists here")
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        packed = load_nf4(model_dirs[64], "packed", monkeypatch)(input_ids=ids).logits.float()
        plain = load_nf4(model_dirs[64], "dequantise", monkeypatch)(input_ids=ids).logits.float()
    assert torch.allclose(packed, plain, rtol=0.05, atol=0.05 * plain.abs().max().item())
    assert (packed.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("path_kind", PATHS.values())
def test_layer_narrower_than_the_block_is_refused_on_every_path(path_kind, model_dirs, monkeypatch):
    with pytest.raises(ModelLoadError) as info:
        load_nf4(model_dirs[32], path_kind, monkeypatch)
    assert str(info.value) == (
        f"model.quantization=nf4: {model_dirs[32]}: layer model.layers.0.self_attn.q_proj has in_features=32, not a "
        f"multiple of the 64-value quantisation block; bitsandbytes' CPU backend needs in_features in multiples of 64 "
        f"and out_features in multiples of 32: load this model unquantised (model.quantization=none)")
