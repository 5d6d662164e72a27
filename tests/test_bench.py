"""`python -m inference bench` additions: named prompt sets."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from inference.cli import UsageError
from inference.prompt_sets import DATA_ENV, HUMANEVAL_TURN, load_questions

MT_BENCH = [{"question_id": 81 + i, "category": c, "turns": [f"{c} question {i}", "follow-up"]}
            for i, c in enumerate(["writing", "roleplay", "math"])]
GSM8K = [{"question": f"Natalia sold {n} clips. How many?", "answer": f"#### {n}"} for n in (48, 12, 7)]
HUMANEVAL = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
              "canonical_solution": f"    return x + {i}\n", "test": "", "entry_point": f"f{i}"} for i in range(2)]


@pytest.fixture
def data_dir(tmp_path, monkeypatch) -> Path:
    """A $DRAFTSMITH_DATA folder with the three sets in their upstream formats (humaneval gzipped)."""
    (tmp_path / "mt_bench").mkdir()
    (tmp_path / "mt_bench" / "question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MT_BENCH))
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    (tmp_path / "humaneval").mkdir()
    with gzip.open(tmp_path / "humaneval" / "HumanEval.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in HUMANEVAL))
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    return tmp_path


# --- prompt sets

def test_prompt_sets_take_the_first_n_of_each(data_dir):
    questions, taken = load_questions("mt_bench,gsm8k:2,humaneval:1")
    assert taken == {"mt_bench": 3, "gsm8k": 2, "humaneval": 1}
    assert [q.question_id for q in questions] == [81, 82, 83, "gsm8k/0", "gsm8k/1", "HumanEval/0"]
    assert [q.category for q in questions] == ["writing", "roleplay", "math", "gsm8k", "gsm8k", "humaneval"]
    assert questions[0].turns == ("writing question 0", "follow-up")
    assert questions[4].turns == (GSM8K[1]["question"],)
    assert questions[5].turns == ("Complete the following Python function:\n```python\n"
                                  "def f0(x):\n    \"\"\"Return x + 0.\"\"\"\n```",)
    assert questions[5].turns[0] == HUMANEVAL_TURN.format(prompt=HUMANEVAL[0]["prompt"])
    assert load_questions("gsm8k")[1] == {"gsm8k": 3}
    file_questions, none = load_questions(str(data_dir / "mt_bench" / "question.jsonl"))
    assert none is None and file_questions == questions[:3]


@pytest.mark.parametrize("spec, needle", [
    ("mt_bnch,gsm8k", "unknown prompt set 'mt_bnch'"),
    ("gsm8k:0", "'gsm8k:0': the count after ':' must be a positive integer"),
    ("gsm8k:x", "'gsm8k:x': the count"),
    ("gsm8k,gsm8k:2", "'gsm8k' is named twice"),
    ("gsm8k:4", "gsm8k:4: {data}/gsm8k/test.jsonl has only 3 questions"),
    ("humaneval", "--questions humaneval: {data}/humaneval/HumanEval.jsonl.gz not found (set DRAFTSMITH_DATA"),
    ("gsm8k", "{data}/gsm8k/test.jsonl:2: expected an object with a non-empty string 'question'"),
    ("humaneval:1", "HumanEval.jsonl.gz: not a readable gzip file"),
    ("missing.jsonl", "missing.jsonl: question file not found"),
])
def test_prompt_set_errors_are_one_line_naming_the_set_or_file(data_dir, spec, needle):
    if spec == "humaneval":
        (data_dir / "humaneval" / "HumanEval.jsonl.gz").unlink()
    elif spec == "gsm8k":
        (data_dir / "gsm8k" / "test.jsonl").write_text(json.dumps(GSM8K[0]) + "\n{\"answer\": \"#### 1\"}\n")
    elif spec == "humaneval:1":
        (data_dir / "humaneval" / "HumanEval.jsonl.gz").write_text("plain text, not gzip\n")
    with pytest.raises(UsageError) as info:
        load_questions(spec)
    assert needle.format(data=data_dir) in str(info.value) and "\n" not in str(info.value)
