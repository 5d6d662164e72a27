"""scripts/bench_compare.py: the paired-bootstrap interval of two runs' τ difference over the same questions (answer
files in the format `python -m inference bench` writes)."""
import json
import subprocess
import sys

from tests.script_support import ROOT, exit_code, load_script


def record(question_id, category: str, tokens: int, forwards: int) -> dict:
    return {"question_id": question_id, "category": category, "answer_id": "x", "model_id": "m",
            "choices": [{"index": 0, "turns": ["text"], "new_tokens": [tokens], "idxs": [forwards],
                         "wall_time": [1.0], "accept_lengths": [1] * (forwards - 2)}], "tstamp": 0.0}


def write(path, rows: list[tuple[int, str, int, int]]):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record(*row)) + "\n" for row in rows))
    return path


def questions(forwards: list[int]) -> list[tuple[int, str, int, int]]:
    return [(i, "writing" if i % 2 else "math", 128, f) for i, f in enumerate(forwards)]


def test_tau_is_the_ratio_of_sums_and_an_equal_run_gives_an_interval_of_zero(tmp_path):
    script = load_script("bench_compare")
    a = script.read_counts(write(tmp_path / "a.jsonl", questions([64, 100, 128, 80])))
    result = script.compare(a, dict(a), resamples=500)
    assert result.questions == 4
    assert result.tau_a == result.tau_b == 4 * 128 / (64 + 100 + 128 + 80)
    assert (result.low, result.high) == (0.0, 0.0)


def test_a_run_better_on_every_question_has_an_interval_above_zero_and_noise_one_around_zero(tmp_path):
    script = load_script("bench_compare")
    base = [90, 70, 110, 60, 85, 95, 100, 75]
    slower = script.read_counts(write(tmp_path / "b.jsonl", questions(base)))
    faster = script.read_counts(write(tmp_path / "a.jsonl", questions([f - 10 for f in base])))
    clear = script.compare(faster, slower, resamples=2000)
    assert clear.difference > 0 and 0 < clear.low <= clear.difference <= clear.high
    mixed = script.read_counts(write(tmp_path / "c.jsonl", questions([f + (6 if i % 2 else -6)
                                                                       for i, f in enumerate(base)])))
    noise = script.compare(mixed, slower, resamples=2000)
    assert noise.low < 0 < noise.high
    assert script.compare(mixed, slower, resamples=2000, seed=3) == script.compare(mixed, slower, resamples=2000,
                                                                                   seed=3)


def test_a_method_folder_names_its_own_answer_file_and_the_report_says_which_is_higher(tmp_path, capsys):
    script = load_script("bench_compare")
    write(tmp_path / "run" / "ours" / "ar.jsonl", questions([128, 128]))
    write(tmp_path / "run" / "ours" / "ours.jsonl", questions([60, 64]))
    peer = write(tmp_path / "peer.jsonl", questions([80, 90]))
    assert exit_code(script, [str(tmp_path / "run" / "ours"), str(peer), "--resamples", "200"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"τ {256 / 124:.3f} (ours) against {256 / 170:.3f} (peer) over 2 questions")
    assert line.endswith("ours higher")


def test_bad_input_is_one_line_naming_the_file(tmp_path, capsys):
    script = load_script("bench_compare")
    a = write(tmp_path / "a.jsonl", questions([64, 70, 80]))
    short = write(tmp_path / "short.jsonl", questions([64, 70]))
    assert exit_code(script, [str(a), str(short)]) == 2
    assert f"{short}: no answer to question 2 (math), which the other file has" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(record(0, "math", 10, 5)) + "\n{\"question_id\": 1}\n")
    assert exit_code(script, [str(a), str(broken)]) == 2
    assert f"{broken}:2: not a bench answer record" in capsys.readouterr().err
    twice = write(tmp_path / "twice.jsonl", questions([64, 64]) + questions([64]))
    assert exit_code(script, [str(twice), str(a)]) == 2
    assert f"{twice}:3: question 0 (math) appears twice" in capsys.readouterr().err
    assert exit_code(script, [str(tmp_path / "none"), str(a)]) == 2
    assert "no such answer file" in capsys.readouterr().err
    assert exit_code(script, [str(a), str(a), "--level", "95"]) == 2
    assert "--level 95.0: give a coverage between 0 and 1" in capsys.readouterr().err


def test_the_command_line(tmp_path):
    a = write(tmp_path / "a.jsonl", questions([64, 70, 80]))
    result = subprocess.run([sys.executable, "scripts/bench_compare.py", str(a), str(a), "--resamples", "100"],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0 and "difference +0.000" in result.stdout
    assert "not separated by these questions" in result.stdout
