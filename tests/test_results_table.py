"""scripts/results_table.py: the README's results table from bench summaries (synthetic ones, in the format
`python -m inference bench` and scripts/bench_suite.py write)."""
import json
import subprocess
import sys

from tests.script_support import ROOT, exit_code, load_script


def summary(main: str, tau: float, tok_s: float, vs_ar: float | None, vs_hf: float | None, **config) -> dict:
    return {"main": main, "tau": tau, "tokens_per_s": tok_s, "speedup_vs_ar": vs_ar, "speedup_vs_hf": vs_hf,
            "methods": {}, "config": {"dtype": "float32", "cpu": "AMD EPYC 7B13", "cpu_capability": "AVX2",
                                      "command": "python scripts/bench_suite.py conf/bench/smollm2.yaml", **config}}


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def test_rows_from_a_suite_folder_and_a_bench_summary(tmp_path, capsys):
    script = load_script("results_table")
    suite = tmp_path / "suite"
    write(suite / "pld8_sg" / "summary.json", summary("pld8_sg", 2.1337, 18.84, 1.3512, 1.9789))
    write(suite / "pld8_sg_labelled" / "summary.json", summary("pld8_sg_labelled", 2.1, 18.8, 1.35, 1.98,
                                                                 label="prompt lookup + datastore"))
    write(suite / "eagle3_16" / "summary.json", summary("eagle3_16", 1.99, 69.0, 1.57, 1.85, gpu="NVIDIA H200"))
    bench = write(tmp_path / "bench" / "summary.json",
                  summary("drafter", 4.17, 255.8, 1.99, None, drafter="outputs/medusa1/tiny", tree_nodes=16,
                          command="python -m inference bench --drafter outputs/medusa1/tiny"))
    assert exit_code(script, [str(suite), str(bench)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| method | τ | tok/s | × plain loop | × HF | host | command |"
    assert lines[2] == ("| eagle3_16 | 1.99 | 69.0 | 1.57 | 1.85 | NVIDIA H200, float32 | "
                        "`python scripts/bench_suite.py conf/bench/smollm2.yaml` |")  # folder order: sorted paths
    assert lines[3] == "| pld8_sg | 2.13 | 18.8 | 1.35 | 1.98 | AMD EPYC 7B13 (AVX2), float32 | same run |"
    assert lines[4].startswith("| prompt lookup + datastore | 2.10 | 18.8 | 1.35 | 1.98 |")  # the plan entry's label
    assert lines[5] == ("| outputs/medusa1/tiny, 16 nodes | 4.17 | 255.8 | 1.99 | — | AMD EPYC 7B13 (AVX2), float32 | "
                        "`python -m inference bench --drafter outputs/medusa1/tiny` |")
    assert len(lines) == 6


def test_a_suite_folder_gives_its_rows_in_the_plan_order(tmp_path, capsys):
    script = load_script("results_table")
    suite = tmp_path / "suite"
    for name in ("zeta", "alpha"):
        write(suite / name / "summary.json", summary(name, 1.5, 10.0, 1.0, 1.0))
    write(suite / "suite.json", {"methods": {"zeta": {}, "alpha": {}}})
    assert exit_code(script, [str(suite)]) == 0
    assert [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines()[2:]] == ["| zeta", "| alpha"]
    write(suite / "suite.json", {"plan": "x"})
    assert exit_code(script, [str(suite)]) == 2
    assert "suite.json: not a bench_suite output (no methods)" in capsys.readouterr().err


def test_refuses_more_rows_than_the_limit_and_files_that_are_no_summary(tmp_path, capsys):
    script = load_script("results_table")
    for i in range(3):
        write(tmp_path / "s" / f"m{i}" / "summary.json", summary(f"m{i}", 1.5, 10.0, 1.0, 1.0))
    assert exit_code(script, [str(tmp_path / "s"), "--max-rows", "2"]) == 2
    assert "3 summaries for at most 2 rows" in capsys.readouterr().err
    other = write(tmp_path / "suite.json", {"plan": "x"})
    assert exit_code(script, [str(other)]) == 2
    assert f"{other}: not a bench summary (no main, tau, tokens_per_s, config)" in capsys.readouterr().err
    assert exit_code(script, [str(tmp_path / "nope")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_the_command_line(tmp_path):
    path = write(tmp_path / "summary.json", summary("lookahead", 1.71, 27.7, 1.37, 2.61))
    result = subprocess.run([sys.executable, "scripts/results_table.py", str(path)], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert result.returncode == 0 and "| lookahead | 1.71 | 27.7 | 1.37 | 2.61 |" in result.stdout
