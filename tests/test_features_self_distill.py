"""Self-distilled feature caches (`python -m train features` with data.self_distill=true): the target's own greedy
answers (and further sampled ones) as the train split, resumed where a killed run stopped, shared between two ranks,
and read back as a datastore of its trained tokens. The cache itself and training from it: tests/test_features.py.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from data.errors import UsageError
from data.features import FeatureDataset, Manifest
from models.loading import load_target
from tests.features_support import extract, shard_tensors
from tests.features_support import data_file, full_cache, model_dir  # noqa: F401 (fixtures)
from train.distributed import free_port

SELF_DISTILL = ("data.self_distill=true", "data.self_distill_samples=9", "data.self_distill_new_tokens=5",
                "data.self_distill_batch_size=4", "data.max_length=64")


def answers(folder: Path) -> dict[str, dict]:
    """The self-distilled records under folder/self_distill/, by id."""
    return {r["id"]: r for path in sorted((folder / "self_distill").glob("*.jsonl"))
            for r in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def self_distilled_cache(model_dir, data_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cache") / "self"
    extract(model_dir, data_file, out, *SELF_DISTILL)
    return out


def test_a_cache_is_a_datastore_of_its_trained_tokens(model_dir, self_distilled_cache):
    """The datastore of a self-distilled cache holds the target's answers (each trained run of its train split), read
    without a tokenizer; a tokenizer other than the cache's is refused in one line."""
    from data.chat import IGNORE_INDEX
    from data.datastore import cache_documents
    from inference.drafters.datastore import load_datastore
    from models.loading import load_tokenizer
    from tests.data_support import tiny_tokenizer

    runs = []
    for sample in FeatureDataset(self_distilled_cache, "train"):
        kept = (sample["labels"] != IGNORE_INDEX).tolist() + [False]
        ids = sample["input_ids"].tolist()
        start = None
        for i, trained in enumerate(kept):
            if trained and start is None:
                start = i
            elif not trained and start is not None:
                runs.append(ids[start:i])
                start = None
    documents = cache_documents(self_distilled_cache)
    assert documents == runs and len(documents) == Manifest.read(self_distilled_cache).samples["train"]
    store = load_datastore(self_distilled_cache, load_tokenizer(str(model_dir)))
    assert store.num_tokens == Manifest.read(self_distilled_cache).trained_tokens["train"]
    with pytest.raises(UsageError, match=r"^--datastore=.*: made with another tokenizer or chat template$"):
        load_datastore(self_distilled_cache, tiny_tokenizer(chat_template=None), label="--datastore")


def test_a_self_distilled_cache_holds_the_targets_own_answers(model_dir, self_distilled_cache, full_cache):
    from data.chat import encode_prompt
    from data.config import load_data_config
    from data.datasets import build_datasets
    from inference.api import Engine
    from inference.engine.drafter import NoDrafter
    from models.loading import load_tokenizer

    records = answers(self_distilled_cache)
    assert len(records) == 9 and all(i.startswith("train:") for i in records)
    tokenizer = load_tokenizer(str(model_dir))
    engine = Engine(load_target(str(model_dir), dtype="fp32"), NoDrafter())
    for record in records.values():  # each answer is the target's greedy reply to the first user turn
        human, gpt = record["conversations"]
        tokens = engine.generate(encode_prompt(tokenizer, [{"role": "user", "content": human["value"]}]),
                                 max_new_tokens=5).sequences[0]
        assert gpt["value"] == tokenizer.decode(tokens, skip_special_tokens=True).strip()
    # The cache's train split is those conversations read back by the same recipe; validation keeps the data's text.
    recipe = load_data_config("sharegpt", {"path": str(self_distilled_cache / "self_distill"), "max_length": 64,
                                           "validation_fraction": 0.0})
    expected = sorted(tuple(x["input_ids"]) for x in build_datasets(recipe, tokenizer).train)
    cached = sorted(tuple(x["input_ids"].tolist()) for x in FeatureDataset(self_distilled_cache, "train"))
    assert cached == expected
    manifest = Manifest.read(self_distilled_cache)
    assert manifest.complete and manifest.samples["train"] == 9 and manifest.recipe["data"]["self_distill"]
    assert manifest.samples["validation"] == Manifest.read(full_cache).samples["validation"]  # the data's own text


def test_a_self_distilled_cache_resumes_its_answers(model_dir, data_file, self_distilled_cache, tmp_path):
    """Killed while answering (some answers written, the last line torn): a rerun answers only the rest, and the
    cache equals one made in one go."""
    out = tmp_path / "resumed"
    (out / "self_distill").mkdir(parents=True)
    first = (self_distilled_cache / "self_distill" / "rank000.jsonl").read_text().splitlines(keepends=True)
    (out / "self_distill" / "rank000.jsonl").write_text("".join(first[:4]) + first[4][:20])
    result = extract(model_dir, data_file, out, *SELF_DISTILL)
    assert "5 answers generated, 4 already in" in result.stdout + result.stderr
    assert answers(out) == answers(self_distilled_cache)
    one, resumed = shard_tensors(self_distilled_cache), shard_tensors(out)
    assert one.keys() == resumed.keys()
    for name in one:
        for key in one[name]:
            torch.testing.assert_close(resumed[name][key], one[name][key], rtol=0, atol=0, msg=f"{name}:{key}")
    rerun = extract(model_dir, data_file, out, *SELF_DISTILL)
    assert "nothing to do" in rerun.stdout + rerun.stderr
    other = extract(model_dir, data_file, out, *SELF_DISTILL, "data.self_distill_samples=7", expect_ok=False)
    assert other.returncode == 1 and "made from other data" in other.stderr.strip().splitlines()[-1]
    assert answers(out) == answers(self_distilled_cache)  # refused before answering anything


def test_further_answers_are_sampled_beside_the_greedy_ones(model_dir, data_file, self_distilled_cache, tmp_path):
    """data.self_distill_answers=2: every prompt gets its greedy answer (the same as a one-answer cache's) and a
    sampled one under "<id>_1"; the train split holds both; a rerun resumes the second pass alone."""
    out = tmp_path / "two-answers"
    two = (*SELF_DISTILL, "data.self_distill_answers=2", "data.self_distill_temperature=1.5", "data.self_distill_top_p=1.0")
    (out / "self_distill").mkdir(parents=True)
    first = (self_distilled_cache / "self_distill" / "rank000.jsonl").read_text()
    (out / "self_distill" / "rank000.jsonl").write_text(first)  # the greedy pass done, as by a killed run
    result = extract(model_dir, data_file, out, *two)
    assert "9 answers generated, 0 already in" in result.stdout + result.stderr  # the second pass only
    records = answers(out)
    greedy = answers(self_distilled_cache)
    assert {i: r for i, r in records.items() if not i.endswith("_1")} == greedy
    sampled = {i[: -len("_1")]: r for i, r in records.items() if i.endswith("_1")}
    assert sampled.keys() == greedy.keys()
    assert any(sampled[i]["conversations"][1]["value"] != greedy[i]["conversations"][1]["value"] for i in greedy)
    manifest = Manifest.read(out)
    assert manifest.complete and manifest.recipe["data"]["self_distill_answers"] == 2
    assert manifest.samples["train"] == len(records) == 18  # both answers of each of the 9 prompts


@pytest.mark.distributed
def test_two_ranks_share_the_answers_and_write_the_same_cache(model_dir, data_file, self_distilled_cache, tmp_path):
    """Each rank answers every other conversation into its own file; the records and the cache equal one process's."""
    out = tmp_path / "two"
    launcher = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                "-m", "train")
    extract(model_dir, data_file, out, *SELF_DISTILL, launcher=launcher)
    assert sorted(p.name for p in (out / "self_distill").iterdir()) == ["rank000.jsonl", "rank001.jsonl"]
    assert answers(out) == answers(self_distilled_cache)
    assert Manifest.read(out).samples == Manifest.read(self_distilled_cache).samples
