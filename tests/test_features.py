"""The feature cache (`python -m train features`, data/features.py) and Medusa-1 trained from it (data.features).

Equivalences: the cached hidden states equal the target's own forward; a batch read from an fp32 cache with k = V soft
labels gives the online Medusa loss (values and gradients, 1e-5), with and without a draft vocabulary; two ranks write
the same cache as one process. Then the contract around it: resume at the first missing shard, refusal of another
target / layer set, the disk check, the planner's bounds. Self-distilled caches (the target's own answers) are in
tests/test_features_self_distill.py; the shared fixtures and helpers in tests/features_support.py.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from data.features import FeatureCacheError, FeatureCollator, FeatureDataset, Manifest, check_cache
from models.backbone import final_hidden
from models.loading import load_target
from models.medusa import MedusaConfig, MedusaHeads
from tests.features_support import extract, run, shard_tensors
from tests.features_support import data_file, full_cache, model_dir  # noqa: F401 (fixtures)
from tests.model_support import save_tiny_model
from tests.script_support import load_script
from train.distributed import free_port
from train.features import check_disk, plan_shards
from train.medusa1 import CachedSoftLabels, medusa_loss


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / "other", seed=1)


def test_manifest_counts_every_sample_and_token(full_cache):
    manifest = check_cache(full_cache, need_layers=[1, 2], need_topk=True)
    assert manifest.complete and manifest.topk == 400 and manifest.layers == [1, 2]
    for split in ("train", "validation"):
        dataset = FeatureDataset(full_cache, split)
        assert len(dataset) == manifest.samples[split]
        assert sum(len(dataset[i]["input_ids"]) for i in range(len(dataset))) == manifest.tokens[split]
        assert sum(int((labels != -100).sum()) for labels in dataset.labels()) == manifest.trained_tokens[split]
    on_disk = sum(p.stat().st_size for p in full_cache.glob("*.safetensors"))
    assert on_disk >= sum(manifest.tokens.values()) * manifest.bytes_per_token()


def test_cached_states_equal_the_targets_forward(full_cache, model_dir):
    target = load_target(str(model_dir), dtype="fp32")
    dataset = FeatureDataset(full_cache, "train", layers=[1, 2], topk=True)
    for i in range(0, len(dataset), 5):
        item = dataset[i]
        ids = item["input_ids"][None]
        out = target(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(item["hidden"], final_hidden(target, ids)[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(item["layer_1"], out.hidden_states[1][0], rtol=0, atol=1e-5)
        torch.testing.assert_close(item["layer_2"], out.hidden_states[2][0], rtol=0, atol=1e-5)  # post-norm, as HF
        probs = out.logits[0].float().softmax(-1)  # [T, V]
        trained_next = torch.zeros(len(ids[0]), dtype=torch.bool)
        trained_next[:-1] = item["labels"][1:] != -100
        dense = torch.zeros_like(probs).scatter_(1, item["topk_ids"], item["topk_probs"])
        torch.testing.assert_close(dense[trained_next], probs[trained_next], rtol=0, atol=1e-6)
        assert not dense[~trained_next].any()  # soft labels only where a loss reads them


@pytest.mark.parametrize("draft_vocab", [None, 60])
def test_loss_from_the_cache_equals_the_online_loss(full_cache, model_dir, draft_vocab):
    target = load_target(str(model_dir), dtype="fp32")
    lm_head = target.get_output_embeddings()
    dataset = FeatureDataset(full_cache, "train", topk=True)
    batch = FeatureCollator(pad_token_id=0)([dataset[i] for i in range(6)])
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=1, hidden_size=32, vocab_size=400,
                                     draft_vocab_size=draft_vocab))
    if draft_vocab:
        heads.set_draft_vocab(torch.randperm(400)[:draft_vocab])
    heads.init_from_base(lm_head)
    for p in heads.parameters():  # a trained-looking head, not the identity
        p.data.add_(0.05 * torch.randn_like(p))
    online_hidden = final_hidden(target, batch["input_ids"], batch["attention_mask"])
    for weight in (0.0, 0.5, 1.0):
        online = medusa_loss(heads, online_hidden, batch["labels"], 0.8, soft_weight=weight, base_lm_head=lm_head)
        grads_online = torch.autograd.grad(online.loss, list(heads.parameters()))
        cached = medusa_loss(heads, batch["hidden"], batch["labels"], 0.8, soft_weight=weight,
                             soft=CachedSoftLabels(heads, batch["topk_ids"], batch["topk_probs"]))
        grads_cached = torch.autograd.grad(cached.loss, list(heads.parameters()))
        torch.testing.assert_close(cached.loss, online.loss, rtol=0, atol=1e-5)
        for a, b in zip(grads_cached, grads_online):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_rerun_resumes_at_the_first_missing_shard(model_dir, data_file, tmp_path):
    out = tmp_path / "cache"
    extract(model_dir, data_file, out)
    shards = sorted(out.glob("train-*.safetensors"))
    assert len(shards) >= 3
    before = shard_tensors(out)
    kept = {p.name: p.stat().st_mtime_ns for p in shards[:-2]}
    for p in shards[-2:]:
        p.unlink()
    (out / ".train-00000.safetensors.tmp-123").write_bytes(b"torn")  # a killed write
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(FeatureCacheError, match="incomplete"):
        check_cache(out)
    result = extract(model_dir, data_file, out)
    assert {p.name: p.stat().st_mtime_ns for p in shards[:-2]} == kept  # finished shards are not redone
    assert not list(out.glob(".*tmp-*"))
    after = shard_tensors(out)
    assert after.keys() == before.keys()
    for name in before:
        for key in before[name]:
            assert torch.equal(after[name][key], before[name][key]), (name, key)
    assert check_cache(out).complete
    again = extract(model_dir, data_file, out)
    assert "nothing to do" in again.stdout + again.stderr
    assert result.returncode == 0


def test_a_cache_for_another_layer_set_or_target_is_refused(model_dir, other_model_dir, data_file, full_cache, tmp_path):
    result = extract(model_dir, data_file, full_cache, "method.topk=400", "method.layers=[2]", expect_ok=False)
    assert result.returncode == 1
    assert "features.layers=[1, 2], this run asks for [2]" in result.stderr.strip().splitlines()[-1]
    result = run([sys.executable, "-m", "train", "medusa1", "+model=tiny", f"model.path={other_model_dir}",
                  "model.dtype=fp32", "data=sharegpt", "data.self_distill=false", f"data.features={full_cache}",
                  "logger=none", f"output_dir={tmp_path / 'heads'}"], expect_ok=False)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data.features=") and "another target" in last
    assert "Loading weights" not in result.stderr  # refused from the files, before the target loads
    with pytest.raises(FeatureCacheError, match="layers"):
        check_cache(full_cache, need_layers=[0])


def test_medusa1_trains_from_the_cache(model_dir, data_file, full_cache, tmp_path):
    out = tmp_path / "heads"
    run([sys.executable, "-m", "train", "medusa1", "+model=tiny", f"model.path={model_dir}", "model.dtype=fp32",
         "data=sharegpt", "data.self_distill=false", f"data.features={full_cache}", "training.max_steps=3",
         "training.per_device_train_batch_size=4", "method.num_heads=2", "method.soft_labels=0.5",
         "method.draft_vocab=50", "eval.greedy_prompts=2", "eval.greedy_new_tokens=4", "logger=none",
         f"output_dir={out}"])
    config = json.loads((out / "config.json").read_text())
    assert config["training"]["global_step"] == 3
    assert "eval_greedy_head1_top1" in config["training"]["metrics"]


@pytest.mark.parametrize("source", ["cache", "online"])
def test_eagle3_trains_and_serves_losslessly(model_dir, data_file, full_cache, tmp_path, source):
    """`train eagle3` from the cache and online (the target's forward each step), then the checkpoint through
    `load`: greedy output equal to plain greedy decoding, the measured acceptance table stored. Online, the draft
    layer's MLP is wider than the target's (method.intermediate_size)."""
    from inference import load

    out = tmp_path / "eagle3"
    data = [f"data.features={full_cache}"] if source == "cache" else [f"data.path={data_file}",
                                                                       "method.intermediate_size=200"]
    run([sys.executable, "-m", "train", "eagle3", "+model=tiny", f"model.path={model_dir}", "model.dtype=fp32",
         "data=sharegpt", "data.self_distill=false", *data, "training.max_steps=3",
         "training.per_device_train_batch_size=4", "method.ttt_steps=2", "method.eval_depth=3", "method.draft_vocab=50",
         "eval.greedy_prompts=2", "eval.greedy_new_tokens=6", "logger=none", f"output_dir={out}"])
    config = json.loads((out / "config.json").read_text())
    assert config["drafter_type"] == "eagle3" and config["training"]["global_step"] == 3
    assert config["eagle3"]["layers"] == [1, 2] and len(config["eagle3"]["acceptance"]) == 3
    assert config["eagle3"]["intermediate_size"] == (200 if source == "online" else None)
    walk = config["training"]["metrics"]["eval_greedy_tau_walk_tree"]  # the engine-walk estimate of its default tree
    assert 1.0 <= walk <= 1 + 3  # at most one draft a depth accepted a step
    assert "eval_greedy_step1_top1" in config["training"]["metrics"]
    engine = load(str(out), base=str(model_dir), dtype="fp32")
    plain = load(None, base=str(model_dir), dtype="fp32")
    prompt = [[5, 9, 12, 7, 30]]
    assert engine.generate(prompt, max_new_tokens=12).sequences == plain.generate(prompt, max_new_tokens=12).sequences


def test_eagle3_refuses_a_cache_without_its_layers(model_dir, data_file, tmp_path):
    cache = tmp_path / "cache"
    extract(model_dir, data_file, cache, "method.topk=5", "method.layers=[1]")
    result = run([sys.executable, "-m", "train", "eagle3", "+model=tiny", f"model.path={model_dir}",
                  "data=sharegpt", "data.self_distill=false", f"data.features={cache}", "logger=none",
                  f"output_dir={tmp_path / 'out'}"], expect_ok=False)
    assert result.returncode != 0
    assert "holds layers [1], this run needs [2]" in result.stderr.strip().splitlines()[-1]


def test_bad_feature_settings_are_one_line(model_dir, data_file, tmp_path):
    base = [sys.executable, "-m", "train", "medusa2", "+model=tiny", f"model.path={model_dir}", "data=sharegpt",
            "data.self_distill=false", f"data.features={tmp_path}", "logger=none", f"output_dir={tmp_path / 'x'}"]
    result = run(base, expect_ok=False)
    assert result.returncode == 2 and "medusa2 trains from the target's own forward" in result.stderr
    base[3] = "medusa1"
    base[base.index(f"data.features={tmp_path}")] = f"data.features={tmp_path / 'missing'}"
    result = run(base, expect_ok=False)
    assert result.returncode == 2 and "no such directory" in result.stderr
    result = extract(model_dir, data_file, tmp_path / "c", "method.layers=[9]", expect_ok=False)
    assert result.returncode == 1 and "method.layers=[9]" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_disk_check_refuses_before_extraction(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100, 90, 10))
    with pytest.raises(Exception, match="needs 11 B and only 10 B are free"):
        check_disk(tmp_path, 11)
    check_disk(tmp_path, 10)


def test_shard_plan_covers_every_sample_once_within_the_batch_budget():
    lengths = [5, 40, 7, 7, 300, 12, 3, 90, 64, 64, 1]
    plans = plan_shards("train", lengths, batch_tokens=128, shard_tokens=150)
    samples = [i for p in plans for b in p.batches for i in b.samples]
    assert sorted(samples) == list(range(len(lengths)))
    for p in plans:
        for b in p.batches:
            width = max(lengths[i] for i in b.samples)
            assert width * len(b.samples) <= 128 or len(b.samples) == 1
            assert b.tokens == sum(lengths[i] for i in b.samples)
    assert [p.index for p in plans] == list(range(len(plans)))
    assert plans == plan_shards("train", lengths, batch_tokens=128, shard_tokens=150)


@pytest.mark.distributed
def test_two_ranks_write_the_cache_one_process_writes(model_dir, data_file, full_cache, tmp_path):
    out = tmp_path / "two"
    launcher = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                "-m", "train")
    extract(model_dir, data_file, out, "method.topk=400", "method.layers=[1,2]", launcher=launcher)
    assert Manifest.read(out).complete
    one, two = shard_tensors(full_cache), shard_tensors(out)
    assert one.keys() == two.keys()
    for name in one:
        for key in one[name]:
            torch.testing.assert_close(two[name][key], one[name][key], rtol=0, atol=1e-6, msg=f"{name}:{key}")


@pytest.mark.parametrize("method, experiment", [("features", "sharegpt_features"), ("medusa1", "sharegpt_medusa1"),
                                                ("eagle3", "sharegpt_eagle3")])
def test_the_sharegpt_recipes_compose_over_a_models_data_recipe(method, experiment, tmp_path):
    from hydra import compose, initialize_config_module

    from train.cli import check_overrides, register_configs

    register_configs()
    overrides = [f"method={method}", "+model=smollm2", f"+experiment={experiment}", f"output_dir={tmp_path / 'out'}"]
    if method != "features":
        overrides.append(f"data.features={tmp_path}")
    check_overrides(overrides)
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    assert cfg.data.name == "sharegpt_v3" and not cfg.data.self_distill  # the experiment wins over smollm2's recipe


def test_an_unknown_experiment_is_one_line(tmp_path):
    from train.cli import check_overrides, register_configs
    from data.errors import UsageError

    register_configs()
    with pytest.raises(UsageError, match=r"^unknown experiment 'nope'; available: selfdistill_eagle3, selfdistill_features, "
                       r"sharegpt_eagle3, sharegpt_features, sharegpt_medusa1"):
        check_overrides(["method=medusa1", "+model=tiny", "+experiment=nope", f"output_dir={tmp_path}"])


def test_the_features_benchmark_names_its_baselines(capsys):
    """scripts/bench_features.py --baselines: known names parse; an unknown one is one line, exit 2."""
    script = load_script("bench_features")
    assert script.parse_args(["--baselines", "stock-cache"]).baselines == ["stock-cache"]
    assert script.parse_args([]).baselines == []
    with pytest.raises(SystemExit) as err:
        script.parse_args(["--baselines", "stock-cache,fast"])
    assert err.value.code == 2
    assert "--baselines: unknown fast (known: stock-cache)" in capsys.readouterr().err
