"""CI says what CPU it ran on (scripts/cpu_report.py) before it runs the README's test line verbatim."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_report_names_the_cpu_its_flags_and_torchs_kernels():
    result = subprocess.run([sys.executable, "scripts/cpu_report.py"], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert [line.split(":")[0].split(" ")[0] for line in lines] == ["cpu", "cpu", "torch", "torch", "torch",
                                                                   "bitsandbytes", "draftsmith"], lines
    assert f"CPU capability {torch.backends.cpu.get_cpu_capability()} " in lines[2]
    assert "BLAS_INFO=" in lines[3]
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():  # every AVX-512 / AMX / AVX2 flag of this CPU is in the log
        flags = re.search(r"^flags\s*:\s*(.*)$", cpuinfo.read_text(), re.M).group(1).split()
        wanted = {f for f in flags if f in ("avx2", "fma") or f.startswith(("avx512", "amx"))}
        assert wanted <= set(lines[1].removeprefix("cpu flags: ").split()), lines[1]
        if "avx2" in flags:
            assert "avx2 yes" in lines[4]
        amx = {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags)
        assert ("AMX for 2-32" in lines[6]) == amx
        assert ("AVX-512-BF16 for 2-32" in lines[6]) == (not amx and {"avx512f", "avx512_bf16"} <= set(flags))
        fp32_routed = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AVX512_BF16", "AMX")
        assert ("fp32 layers: AVX2 for 1-32 rows" in lines[6]) == fp32_routed


def test_ci_reports_the_cpu_then_runs_the_readme_test_line_verbatim():
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert quickstart[1] in ci
    assert ci.index("python scripts/cpu_report.py") < ci.index(quickstart[1])
