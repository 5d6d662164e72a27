"""What CPU this is, as the figures and the 4-bit code paths depend on it: prints a few lines for CI logs.

    python scripts/cpu_report.py

The CPU model and its vector/matrix flags (lscpu, else /proc/cpuinfo), torch's choice of kernels (its ATen CPU
capability, BLAS/oneDNN build, what it detects), which of bitsandbytes' two CPU 4-bit paths NF4 layers take, and which
paths of the engine's own linear (inference/kernels/cpu_linear.py; bf16, and fp32 on AVX2) this CPU can take (nothing
is built here).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.kernels import cpu_linear  # noqa: E402

RELEVANT_PREFIXES = ("avx512", "amx")
RELEVANT_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni")


def cpu_fields() -> tuple[str, list[str]]:
    """(model name, flags) from `lscpu`, else /proc/cpuinfo; ("unknown", []) when neither says."""
    text = ""
    if shutil.which("lscpu"):
        text = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}).stdout
    fields = dict(re.findall(r"^(Model name|Flags):\s*(.*)$", text, re.M))
    if not fields and Path("/proc/cpuinfo").is_file():
        cpuinfo = Path("/proc/cpuinfo").read_text()
        found = dict(re.findall(r"^(model name|flags)\s*:\s*(.*)$", cpuinfo, re.M))
        fields = {"Model name": found.get("model name", ""), "Flags": found.get("flags", "")}
    return fields.get("Model name") or "unknown", fields.get("Flags", "").split()


def relevant(flags: list[str]) -> list[str]:
    return [f for f in flags if f in RELEVANT_FLAGS or f.startswith(RELEVANT_PREFIXES)]


def torch_lines() -> list[str]:
    import torch

    build = torch.__config__.show()
    settings = dict(re.findall(r"(BLAS_INFO|LAPACK_INFO|USE_MKLDNN|USE_OPENMP)=([^,\s]+)", build))
    onednn = re.search(r"MKL-DNN (v[\d.]+)", build)
    detected = {name: getattr(torch.cpu, f"_is_{name}_supported", lambda: None)()
                for name in ("avx2", "avx512", "avx512_bf16", "vnni", "amx_tile", "amx_fp16")}
    return [
        f"torch {torch.__version__}: CPU capability {torch.backends.cpu.get_cpu_capability()} (ATen's vectorised "
        f"kernels), {torch.get_num_threads()} threads",
        "torch build: " + ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
        + (f", oneDNN {onednn.group(1)}" if onednn else ""),
        "torch detects: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in detected.items() if v is not None),
    ]


def bitsandbytes_line() -> str:
    try:
        import bitsandbytes
        from bitsandbytes.functional import has_avx512bf16
    except ImportError:
        return "bitsandbytes: not installed (model.quantization=nf4 unavailable)"
    path = ("packed AVX-512-bf16 kernels" if has_avx512bf16() else "dequantise-then-matmul (no AVX-512-bf16)")
    return f"bitsandbytes {bitsandbytes.__version__}: CPU 4-bit layers take the {path} path"


def engine_kernel_line(flags: list[str]) -> str:
    if not cpu_linear.cpu_supported():
        return "draftsmith CPU kernel: not on this CPU (needs AVX2 + FMA): stock PyTorch linears"
    isa = "AVX-512" if cpu_linear.avx512_supported() else "AVX2"
    rows = f"{isa} for 1-{cpu_linear.FMA_ROWS} rows"
    if cpu_linear.amx_supported():
        rows += f", AMX for 2-{cpu_linear.AMX_ROWS}"
    elif cpu_linear.avx512_supported() and "avx512_bf16" in flags:
        rows += f", AVX-512-BF16 for 2-{cpu_linear.DP_ROWS}"
    fp32 = (f"; fp32 layers: AVX2 for 1-{cpu_linear.FP32_ROWS} rows (2-{cpu_linear.FP32_MM_ROWS} as weight @ x^T "
            f"where the kernel does not build)" if cpu_linear.fp32_route_supported() else "; fp32 layers: stock")
    return f"draftsmith CPU kernel: bf16 {rows} (built on first use; --no-cpu-kernel for stock){fp32}"


def report() -> list[str]:
    model, flags = cpu_fields()
    return [
        f"cpu: {model}, {os.cpu_count()} logical CPUs",
        "cpu flags: " + (" ".join(relevant(flags)) or "none of " + ", ".join(RELEVANT_FLAGS)),
        *torch_lines(),
        bitsandbytes_line(),
        engine_kernel_line(flags),
    ]


if __name__ == "__main__":
    print("\n".join(report()), flush=True)
