"""A corpus of bad inputs, each refused with one exact line (the files live in tests/bad_inputs/).

Every case names the call that must refuse the input, the error type, and a regex for the WHOLE message ({cases}:
the bad_inputs folder, {tmp}: the test's temporary folder). Training-side errors must be of a type the CLI reports
as one line: `train.cli.UsageError` (exit 2, before the run) or one of `train.cli.user_errors()` (exit 1).
The real entry points (a subprocess per command line) and the storage tests (a failed save leaves no half-written
output) are in tests/test_bad_inputs_entry_points.py.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from transformers import LlamaConfig

from data.datasets import build_datasets
from data.readers import DataError
from inference.drafters.medusa import MedusaDrafter
from inference.engine.tree import TreeError, load_tree
from inference.engine.verify import SamplingParams
from models.checkpoint import CheckpointError, DrafterMismatchError, check_compatible, load_drafter, save_drafter
from models.interop import load_heads
from models.loading import ModelLoadError, load_target, load_tokenizer
from tests.bad_inputs_support import CASES_DIR, Workspace, composed, tiny_heads, two_head_run
from tests.bad_inputs_support import saved_model  # noqa: F401 (a fixture)
from tests.data_support import DataCfg, tiny_tokenizer
from tests.model_support import tiny_config
from train.cli import UsageError, parse, user_errors
from train.config import register_configs
from train.resume import resolve_resume

SHAREGPT = DataCfg(name="sharegpt", format="sharegpt", validation_fraction=0.0)


@dataclass(frozen=True)
class Case:
    id: str
    run: Callable[[Workspace], Any]  # makes the bad input and calls what must refuse it
    error: type[BaseException]
    message: str  # regex for the whole message


@cache
def tokenizer():
    return tiny_tokenizer()


def data(file: str, cfg: DataCfg = SHAREGPT, **changes: Any) -> Callable[[Workspace], Any]:
    path = str(CASES_DIR / file) if file else None
    return lambda ws: build_datasets(replace(cfg, path=path, **changes), tokenizer())


def cli(*overrides: str, method: str = "medusa1") -> Callable[[Workspace], Any]:
    def call(ws: Workspace):
        register_configs()
        return parse([method, "+model=tiny", *(o.format(tmp=ws.tmp) for o in overrides)])

    return call


def sources(*overrides: str, method: str = "medusa1") -> Callable[[Workspace], Any]:
    """What the run checks first when it starts (train.cli.run_task): the data files its config names."""
    def call(ws: Workspace):
        from train.checks import check_data_sources

        return check_data_sources(composed(method, *(o.format(tmp=ws.tmp) for o in overrides)))

    return call


def trajectories(file: str) -> Callable[[Workspace], Any]:
    """What `python -m train cllm` checks before the target loads: every trajectory record, against the tokenizer."""
    def call(ws: Workspace):
        from train.cllm import Method

        return Method(composed("cllm", f"method.trajectories={CASES_DIR / file}")).datasets(tokenizer())

    return call


def copied_model(ws: Workspace) -> Path:
    return Path(shutil.copytree(ws.model, ws.tmp / "model"))


def unmakeable(ws: Workspace, override: str):
    """The command line with `override`, where no folder can be made under the test's folder though its permission
    bits allow it (a read-only mount; root on a pseudo filesystem)."""
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    original = tempfile.mkdtemp
    tempfile.mkdtemp = read_only
    try:
        return cli(override)(ws)
    finally:
        tempfile.mkdtemp = original


def resume_with_other_heads(ws: Workspace):
    """A run resumed (training.resume_from_checkpoint=auto) into an output_dir whose checkpoint has 2 heads, with
    method.num_heads=3: refused from the checkpoint's config.json, before any model loads."""
    from train.resume import check_resume

    out = two_head_run(ws.tmp / "run")
    cfg = composed("medusa1", "method.num_heads=3", f"output_dir={out}", "training.resume_from_checkpoint=auto")
    return check_resume(cfg, Path(resolve_resume("auto", out / "checkpoints")))


def draft_files(make: Callable[[Path], None]) -> Callable[[Workspace], Any]:
    """`python -m train distill` with a draft whose files `make` writes: checked against the target's files before
    any model loads or the target self-distils."""
    def call(ws: Workspace):
        from train.distill import Method

        draft = ws.tmp / "draft"
        make(draft)
        cfg = composed("distill", f"model.path={copied_model(ws)}", f"method.draft={draft}", "data.self_distill=true")
        return Method(cfg).check_inputs(tokenizer())

    return call


def heads_for_another_base(ws: Workspace):
    from train.medusa2 import Method

    heads = save_drafter(ws.tmp / "h", tiny_heads(vocab_size=50), "base-a")
    return Method(composed("medusa2", f"model.path={copied_model(ws)}", f"method.init_heads={heads}")).check_inputs(
        tokenizer())


def damaged_model(damage: Callable[[Path], None], load: Callable = load_target) -> Callable[[Workspace], Any]:
    def call(ws: Workspace):
        path = ws.tmp / "model"
        shutil.copytree(ws.model, path)
        damage(path)
        return load(str(path), dtype="fp32") if load is load_target else load(str(path))

    return call


def truncate(path: Path, keep: float = 0.5) -> None:
    data_ = path.read_bytes()
    path.write_bytes(data_[: int(len(data_) * keep)])


def damaged_heads(damage: Callable[[Path], None]) -> Callable[[Workspace], Any]:
    def call(ws: Workspace):
        path = save_drafter(ws.tmp / "heads", tiny_heads(), "tiny-base")
        damage(path)
        return load_drafter(path)

    return call


def edit_json(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def evil_pickle(ws: Workspace):
    """An original-Medusa .pt whose unpickling would run a command: it must be refused, the command never run."""

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {ws.tmp / 'pwned'}",)

    folder = ws.tmp / "medusa"
    folder.mkdir()
    (folder / "medusa_lm_head.pt").write_bytes(pickle.dumps({"0.0.linear.weight": Payload()}, protocol=2))
    try:
        return load_heads(folder)  # the reader of original-Medusa directories
    finally:
        assert not (ws.tmp / "pwned").exists()


def torn_checkpoint(trainer_state: str | None) -> Callable[[Workspace], Any]:
    def call(ws: Workspace):
        path = save_drafter(ws.tmp / "checkpoints" / "checkpoint-4", tiny_heads(), "tiny-base")
        if trainer_state is not None:
            (path / "trainer_state.json").write_text(trainer_state)
        return resolve_resume(str(path), ws.tmp / "checkpoints")

    return call


def drafter_on_tree(tree: Any, vocab_size: int = 50, topk: int = 10) -> Callable[[Workspace], Any]:
    def call(ws: Workspace):
        heads = tiny_heads(vocab_size=vocab_size)
        return MedusaDrafter(heads, load_tree(tree, num_heads=heads.config.num_heads, topk=topk))

    return call


MAX_LEN_TEXT = "no sample has a trained token (data.max_length=16)"
CASES = [
    # --- data files (exit 1 during the run) ---
    Case("malformed-json-line", data("malformed_line.jsonl"), DataError,
         r"{cases}/malformed_line.jsonl:2: malformed JSON line: Expecting ',' delimiter \(column 52\)"),
    Case("malformed-json-list", data("malformed_list.json"), DataError,
         r"{cases}/malformed_list.json:14: malformed JSON: Expecting value \(column 20\)"),
    Case("missing-role", data("missing_role.jsonl"), DataError,
         r"{cases}/missing_role.jsonl:2: turn 2: missing field 'from' or 'role'"),
    Case("unknown-role", data("unknown_role.jsonl"), DataError, r"{cases}/unknown_role.jsonl:1: turn 2: unknown role 'tool'"),
    Case("empty-assistant-turn", data("empty_assistant.jsonl"), DataError,
         r"{cases}/empty_assistant.jsonl:1: turn 2: empty assistant turn"),
    Case("no-assistant-turn", data("no_assistant.jsonl"), DataError, r"{cases}/no_assistant.jsonl:1: no assistant turn"),
    Case("non-utf8-jsonl", data("non_utf8.jsonl"), DataError, r"{cases}/non_utf8.jsonl:2: non-UTF-8 bytes"),
    Case("non-utf8-json-list", data("non_utf8_list.json"), DataError, r"{cases}/non_utf8_list.json:1: non-UTF-8 bytes"),
    Case("record-not-object", data("not_object.jsonl"), DataError,
         r"{cases}/not_object.jsonl:2: expected a JSON object, got list"),
    Case("content-not-string", data("content_not_string.jsonl"), DataError,
         r"{cases}/content_not_string.jsonl:1: turn 1: content must be a string, got int"),
    Case("turns-not-list", data("turns_not_list.jsonl"), DataError,
         r"{cases}/turns_not_list.jsonl:1: 'conversations' must be a list, got dict"),
    Case("alpaca-missing-output", data("alpaca_missing_output.json", replace(SHAREGPT, format="alpaca")), DataError,
         r"{cases}/alpaca_missing_output.json:2: missing field 'output'"),
    Case("alpaca-bad-history", data("alpaca_bad_history.json", replace(SHAREGPT, format="alpaca")), DataError,
         r"{cases}/alpaca_bad_history.json:1: history entry 1 must be a \[user, assistant\] pair"),
    Case("gsm8k-answer-not-string", data("gsm8k_answer_not_string.jsonl", replace(SHAREGPT, format="gsm8k")), DataError,
         r"{cases}/gsm8k_answer_not_string.jsonl:1: 'answer' must be a string, got int"),
    Case("text-empty", data("text_empty.jsonl", replace(SHAREGPT, format="text")), DataError,
         r"{cases}/text_empty.jsonl:2: empty 'text'"),
    Case("empty-file", data("empty.jsonl"), DataError, r"{cases}/empty.jsonl: empty dataset \(no records\)"),
    Case("blank-lines-only", data("blank_lines.jsonl"), DataError, r"{cases}/blank_lines.jsonl: empty dataset \(no records\)"),
    Case("all-records-bad-skipped", data("all_bad.jsonl", on_error="skip"), DataError,
         r"{cases}/all_bad.jsonl: no usable records \(2 bad records skipped; first: {cases}/all_bad.jsonl:1: "
         r"no assistant turn\)"),
    # Truncation to data.max_length is documented; a sample left without a trained token is dropped and counted
    # (test_overlong_sample_is_dropped_and_counted); when that leaves nothing, the run stops.
    Case("every-sample-too-long", data("prompt_too_long.jsonl", max_length=16), DataError,
         r"{cases}/prompt_too_long.jsonl: " + re.escape(MAX_LEN_TEXT)),
    Case("data-file-missing", lambda ws: build_datasets(replace(SHAREGPT, path=str(ws.tmp / "nope.jsonl")), tokenizer()),
         DataError, r"{tmp}/nope.jsonl: no such file or directory"),
    Case("data-dir-without-json", lambda ws: build_datasets(replace(SHAREGPT, path=str(ws.tmp)), tokenizer()),
         DataError, r"{tmp}: directory holds no .json or .jsonl file"),
    Case("data-path-unset", data(""), DataError, r"data.path is required for data.format='sharegpt' \(config data='sharegpt'\)"),
    Case("unknown-chat-template", data("one_too_long.jsonl", chat_template="vicuna_v9"), DataError,
         r"data.chat_template: unknown chat template 'vicuna_v9'; shipped templates: .*vicuna_v1.1.*"),
    Case("max-length-zero", data("one_too_long.jsonl", max_length=0), DataError, r"data.max_length must be >= 1, got 0"),
    Case("validation-fraction-one", data("one_too_long.jsonl", validation_fraction=1.0), DataError,
         r"data.validation_fraction must be in \[0, 1\), got 1.0"),
    # --- command line and config (exit 2 before the run) ---
    Case("unknown-config-key", cli("training.lerning_rate=1e-3"), UsageError,
         r"unknown config key 'training.lerning_rate'; did you mean 'training.learning_rate'\?"),
    Case("added-unknown-key", cli("+method.num_head=3"), UsageError,
         r"unknown config key 'method.num_head'; did you mean 'method.num_heads'\?"),
    Case("unknown-method", lambda ws: parse(["medusa9", "+model=tiny"]), UsageError,
         r"unknown method 'medusa9'; available: .*medusa1.*"),
    Case("unknown-model", cli("+model=gpt5"), UsageError, r"unknown model 'gpt5'; available: .*tiny.*"),
    Case("no-model", lambda ws: parse(["medusa1"]), UsageError, r"no model chosen: add \+model=<name>; available: .*"),
    Case("wrong-type", cli("training.max_steps=ten"), UsageError,
         r"Error merging override training.max_steps=ten: Value 'ten' of type 'str' could not be converted to Integer"),
    Case("unknown-dtype", cli("model.dtype=fp8"), UsageError, r"model.dtype=fp8: choose one of bf16, fp16, fp32, fp64"),
    Case("unknown-quantization", cli("model.quantization=int8"), UsageError,
         r"model.quantization=int8: choose one of null, none, nf4"),
    Case("unknown-on-nonfinite", cli("training.on_nonfinite=ignore"), UsageError,
         r"training.on_nonfinite=ignore: choose one of stop, skip"),
    Case("zero-heads", cli("method.num_heads=0"), UsageError, r"method.num_heads=0: must be >= 1"),
    # every numeric key has a range (train.config.RANGES); these are the issue's
    Case("negative-medusa-decay", cli("method.decay=-1"), UsageError, r"method.decay=-1.0: must be in \(0, 1\]"),
    Case("negative-max-steps", cli("training.max_steps=-5"), UsageError,
         r"training.max_steps=-5: must be >= 1, or -1 to train for training.num_train_epochs"),
    Case("nan-learning-rate", cli("training.learning_rate=nan"), UsageError,
         r"training.learning_rate=nan: must be > 0"),
    Case("negative-seed", cli("seed=-1"), UsageError, r"seed=-1: must be in \[0, 4294967295\]"),
    Case("zero-self-distill-tokens", cli("data.self_distill_new_tokens=0"), UsageError,
         r"data.self_distill_new_tokens=0: must be >= 1"),
    Case("distill-beta-one", cli("method.jsd_beta=1", method="distill"), UsageError,
         r"method.jsd_beta=1.0: must be in \(0, 1\)"),
    Case("stopper-draft-too-long", cli("method.max_gamma=64", method="stopper"), UsageError,
         r"method.max_gamma=64: must be in \[2, 32\]"),
    Case("output-dir-under-a-file", lambda ws: (ws.tmp / "file").write_text("x") and cli("output_dir={tmp}/file/run")(ws),
         UsageError, r"output_dir={tmp}/file/run: {tmp}/file is a file, not a directory"),
    Case("output-dir-cannot-hold-a-folder", lambda ws: unmakeable(ws, "output_dir={tmp}/run"), UsageError,
         r"output_dir={tmp}/run: cannot create a folder in {tmp} \(Read-only file system\)"),
    Case("data-path-missing", sources("data=sharegpt", "data.path={tmp}/nope.json"), UsageError,
         r"data.path={tmp}/nope.json: no such file or directory"),
    Case("validation-path-missing", sources("data=sharegpt", f"data.path={CASES_DIR / 'one_too_long.jsonl'}",
                                            "data.validation_path={tmp}/val"), UsageError,
         r"data.validation_path={tmp}/val: no such file or directory"),
    Case("features-missing-before-self-distill", cli("data.features={tmp}/cache"), UsageError,
         r"data.features={tmp}/cache: no such directory \(make it with .*\)"),
    # --- CLLM trajectories (exit 1, before the target loads) ---
    Case("trajectory-malformed-json", trajectories("trajectory_malformed.jsonl"), DataError,
         r"{cases}/trajectory_malformed.jsonl:2: malformed JSON line: Expecting ',' delimiter \(column 162\)"),
    Case("trajectory-missing-field", trajectories("trajectory_missing_field.jsonl"), DataError,
         r"{cases}/trajectory_missing_field.jsonl:2: not a trajectory record: missing field 'prompt_ids'"),
    Case("trajectory-token-out-of-vocab", trajectories("trajectory_token_out_of_vocab.jsonl"), DataError,
         r"{cases}/trajectory_token_out_of_vocab.jsonl:3: not a trajectory record: token id 4000 in "
         r"blocks\[0\].states\[1\] is outside the tokenizer's vocabulary \(0..399\)"),
    # --- cross-file checks (exit 1, before any model loads) ---
    Case("resume-with-another-head-count", resume_with_other_heads, CheckpointError,
         r"{tmp}/run/checkpoints/checkpoint-4 was trained with method.num_heads=2, this run has method.num_heads=3: "
         r"pass method.num_heads=2 to resume it, or choose another output_dir"),
    Case("draft-with-another-vocab-size",
         draft_files(lambda p: tiny_config(vocab_size=512).save_pretrained(p)), DrafterMismatchError,
         r"method.draft={tmp}/draft: the draft model has a vocabulary of 512 tokens but the target {tmp}/model has "
         r"400; a draft model must share the target's tokenizer"),
    Case("draft-with-another-tokenizer",
         draft_files(lambda p: (tiny_config(vocab_size=400).save_pretrained(p),
                                tiny_tokenizer(metaspace=True).save_pretrained(p))), DrafterMismatchError,
         r"method.draft={tmp}/draft: the draft model's tokenizer differs from the target's \(token '\\n': id 8 in the "
         r"draft's, absent in the target's\); a draft model must share the target's tokenizer"),
    Case("init-heads-for-another-base", heads_for_another_base, DrafterMismatchError,
         r"method.init_heads={tmp}/h: drafter vocab_size=50 does not match {tmp}/model vocab_size=400; the heads were "
         r"trained for base-a"),
    # --- target model (exit 1) ---
    Case("model-path-missing", lambda ws: load_target(str(ws.tmp / "nope")), ModelLoadError,
         r"model path '{tmp}/nope' does not exist"),
    Case("model-without-config", damaged_model(lambda p: (p / "config.json").unlink()), ModelLoadError,
         r"model path '{tmp}/model' has no config.json or adapter_config.json"),
    Case("model-config-truncated", damaged_model(lambda p: truncate(p / "config.json")), ModelLoadError,
         r"cannot load model '{tmp}/model': It looks like the config file at '{tmp}/model/config.json' is not a valid "
         r"JSON file."),
    Case("model-weights-truncated", damaged_model(lambda p: truncate(p / "model.safetensors")), ModelLoadError,
         r"cannot load model '{tmp}/model': corrupted safetensors weights \(Error while deserializing header: .*\)"),
    Case("model-without-tokenizer",
         damaged_model(lambda p: [f.unlink() for f in p.glob("tokenizer*")], load=load_tokenizer), ModelLoadError,
         r"model path '{tmp}/model' has no tokenizer.json or tokenizer_config.json or tokenizer.model or vocab.json"),
    Case("nf4-layer-narrower-than-block",
         lambda ws: load_target(str(shutil.copytree(ws.model, ws.tmp / "model")), dtype="bf16", quantization="nf4",
                                device_map="cpu"), ModelLoadError,
         r"model.quantization=nf4: {tmp}/model: layer model.layers.0.self_attn.q_proj has in_features=32, not a "
         r"multiple of the 64-value quantisation block; bitsandbytes' CPU backend needs in_features in multiples of "
         r"64 and out_features in multiples of 32: load this model unquantised \(model.quantization=none\)"),
    # --- drafter checkpoints ---
    Case("heads-config-truncated", damaged_heads(lambda p: truncate(p / "config.json")), CheckpointError,
         r"{tmp}/heads/config.json: not valid JSON \(.*\)"),
    Case("heads-weights-corrupted", damaged_heads(lambda p: truncate(p / "drafter.safetensors", 0.7)), CheckpointError,
         r"{tmp}/heads/drafter.safetensors: unreadable safetensors \(.*\)"),
    Case("heads-weights-missing", damaged_heads(lambda p: (p / "drafter.safetensors").unlink()), CheckpointError,
         r"{tmp}/heads/drafter.safetensors: missing"),
    Case("heads-config-not-draftsmith", damaged_heads(lambda p: (p / "config.json").write_text('{"model_type": "llama"}')),
         CheckpointError, r"{tmp}/heads/config.json: no 'drafter_type' key; not a draftsmith checkpoint"),
    Case("heads-weights-disagree-with-config", damaged_heads(lambda p: edit_json(p / "config.json", num_heads=3)),
         CheckpointError, r"{tmp}/heads/drafter.safetensors: weights do not match config.json \(.*\)"),
    Case("heads-for-another-hidden-size",
         lambda ws: check_compatible(load_drafter(save_drafter(ws.tmp / "h", tiny_heads(), "base-a")).config,
                                     LlamaConfig(hidden_size=64, vocab_size=50, name_or_path="base-b")),
         DrafterMismatchError,
         r"drafter hidden_size=32 does not match base-b hidden_size=64; the heads were trained for base-a"),
    Case("heads-for-another-vocab",
         lambda ws: check_compatible(load_drafter(save_drafter(ws.tmp / "h", tiny_heads(), "base-a")).config,
                                     LlamaConfig(hidden_size=32, vocab_size=51, name_or_path="base-b")),
         DrafterMismatchError,
         r"drafter vocab_size=50 does not match base-b vocab_size=51; the heads were trained for base-a"),
    Case("pickle-that-runs-code", evil_pickle, CheckpointError,
         r"{tmp}/medusa/medusa_lm_head.pt: unreadable \(Weights only load failed.*\)"),
    Case("non-finite-heads", lambda ws: save_drafter(ws.tmp / "nan", tiny_heads().apply(
        lambda m: torch.nn.init.constant_(m.weight, float("nan")) if isinstance(m, torch.nn.Linear) else None), "b"),
         CheckpointError, r"{tmp}/nan: refusing to save non-finite weights \(.*\)"),
    Case("resume-from-torn-checkpoint", torn_checkpoint(None), CheckpointError,
         r"training.resume_from_checkpoint={tmp}/checkpoints/checkpoint-4: not a complete checkpoint "
         r"\(no trainer_state.json \(the checkpoint was not completely written\)\)"),
    Case("resume-from-truncated-state", torn_checkpoint('{"global_step": 4, "log_hi'), CheckpointError,
         r"training.resume_from_checkpoint={tmp}/checkpoints/checkpoint-4: not a complete checkpoint "
         r"\(trainer_state.json is unreadable \(.*\)\)"),
    # --- inference ---
    Case("tree-deeper-than-heads", drafter_on_tree([[0], [0, 0], [0, 0, 0]]), TreeError,
         r"tree: entry 2 \[0, 0, 0\]: depth 3 exceeds the drafter's 2 head\(s\)"),
    Case("tree-rank-beyond-topk", drafter_on_tree([[0], [12]]), TreeError,
         r"tree: entry 1 \[12\]: ranks must be in \[0, 10\) \(topk=10\)"),
    Case("tree-topk-beyond-vocab", drafter_on_tree([[0], [1], [7]], vocab_size=6), TreeError,
         r"tree uses top-8 candidates per head, but the vocabulary has only 6 tokens"),
    Case("tree-file-truncated", drafter_on_tree(CASES_DIR / "tree_truncated.json"), TreeError,
         r"{cases}/tree_truncated.json: line 1: not valid JSON \(Expecting value\)"),
    Case("negative-temperature", lambda ws: SamplingParams(temperature=-0.5), ValueError,
         r"temperature must be a finite number >= 0, got -0.5"),
    Case("nan-temperature", lambda ws: SamplingParams(temperature=float("nan")), ValueError,
         r"temperature must be a finite number >= 0, got nan"),
    Case("top-p-zero", lambda ws: SamplingParams(top_p=0.0), ValueError, r"top_p must be in \(0, 1\], got 0.0"),
]


def expected(pattern: str, tmp: Path) -> str:
    return pattern.replace("{cases}", re.escape(str(CASES_DIR))).replace("{tmp}", re.escape(str(tmp)))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_with_one_line(case: Case, saved_model: Path, tmp_path: Path):
    with pytest.raises(case.error) as info:
        case.run(Workspace(tmp=tmp_path, model=saved_model))
    message = str(info.value)
    assert "\n" not in message, message
    assert re.fullmatch(expected(case.message, tmp_path), message), message
    training_side = case.error not in (TreeError, ValueError)  # inference errors surface through the Python API
    if training_side:
        assert isinstance(info.value, user_errors()), f"{type(info.value).__name__} would print a traceback"


def test_corpus_is_large_and_every_file_is_used():
    assert len(CASES) >= 25
    source = Path(__file__).read_text()
    assert [p.name for p in CASES_DIR.iterdir() if f'"{p.name}"' not in source] == []


def test_overlong_sample_is_dropped_and_counted(caplog):
    datasets = build_datasets(replace(SHAREGPT, path=str(CASES_DIR / "one_too_long.jsonl"), max_length=16), tokenizer())
    assert len(datasets.train) == 1
    assert "dropped 1 samples with no assistant token within data.max_length=16" in caplog.text
