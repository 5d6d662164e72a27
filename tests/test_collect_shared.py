"""Work shared across ranks through files (inference.collect.shared), as self-distillation in a trainer and Jacobi
collection use it: every item answered exactly once over the ranks, resumable under another world size, no
collective; the trainer's answers are made on its training device."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from data.datasets import SplitDatasets
from inference.collect.jacobi_trajectories import main as collect_main, placement
from inference.collect.self_distill import DistillStats
from inference.collect.shared import IdScan, RankFiles, World, claim, done_ids, merge, share, wait_until_done
from tests.model_support import save_tiny_model
from tests.data_support import random_chats, write_sharegpt

ROOT = Path(__file__).resolve().parents[1]
RECORD_A = {"id": "a", "blocks": [[1, 2]]}
RECORD_B = {"id": "b", "blocks": [[3]]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_records(path: Path, ids: list[str]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps({"id": i, "value": i.upper()}) + "\n" for i in ids)


# --- the mechanism --------------------------------------------------------------------------------------------------

def test_done_ids_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "traj.jsonl"
    path.write_text(json.dumps(RECORD_A) + "\n" + json.dumps(RECORD_B)[:12])
    assert done_ids(path) == {"a"}
    assert path.read_text() == json.dumps(RECORD_A) + "\n"


@pytest.mark.parametrize("text", ['[{"id": "x"}]', '{"id": "a"}\nnot json\n', 'plain words', '{"id": 3}\n'])
def test_done_ids_refuses_other_files_and_leaves_them_alone(tmp_path, text):
    path = tmp_path / "data.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="not a record"):
        done_ids(path)
    assert path.read_text() == text


@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_the_shares_cover_what_is_left_exactly_once(size):
    ids = [f"p{i}" for i in range(23)]
    done = {"p0", "p5", "p6", "p22"}
    shares = [share(ids, World(rank, size), done) for rank in range(size)]
    taken = [ids[i] for s in shares for i in s]
    assert sorted(taken) == sorted(set(ids) - done) and len(taken) == len(set(taken))
    # The split ignores what is done, so a rank that read `done` later (others appending) takes no one else's item.
    later = done | {ids[i] for i in shares[0]}
    assert all(set(share(ids, World(r, size), later)) <= set(shares[r]) for r in range(size))


def test_id_scan_reads_only_what_was_appended_and_rereads_a_replaced_file(tmp_path):
    path = tmp_path / "x.rank000.jsonl"
    scan = IdScan()
    write_records(path, ["a", "b"])
    with open(path, "a") as f:
        f.write('{"id": "c", "val')  # being written: not counted yet
    assert scan.update([path, tmp_path / "missing.jsonl"]) == {"a", "b"}
    with open(path, "a") as f:
        f.write('ue": 1}\n')
    assert scan.update([path]) == {"a", "b", "c"}
    replaced = tmp_path / "new.jsonl"
    write_records(replaced, ["d"])
    os.replace(replaced, path)  # a merge replaces a file: read again from its start
    assert scan.update([path]) == {"a", "b", "c", "d"}


def test_claim_cuts_only_torn_lines_nobody_writes_now(tmp_path):
    files = RankFiles(tmp_path, "traj.")
    for rank, ids in ((0, ["a"]), (1, ["b"]), (2, ["c"])):
        write_records(files.records(rank), ids)
        with open(files.records(rank), "a") as f:
            f.write('{"id": "torn')
    files.skip(1, "d", "too long")
    assert claim(files, World(1, 2)) == {"a", "b", "c", "d"}
    assert files.records(1).read_text().endswith("\n")  # its own
    assert not files.records(0).read_text().endswith("\n")  # rank 0's: rank 0 is alive and owns it
    assert not files.records(2).read_text().endswith("\n")  # outside the world: rank 0 cuts it
    claim(files, World(0, 2))
    assert all(files.records(r).read_text().endswith("\n") for r in (0, 2))


def test_wait_polls_until_every_id_is_there(tmp_path):
    """The waiting rank sleeps on the files; the other rank's answers and skips arrive between two looks."""
    files = RankFiles(tmp_path)
    write_records(files.records(0), ["a"])
    arrivals = [lambda: write_records(files.records(1), ["b"]), lambda: files.skip(1, "c", "an empty answer")]
    slept = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        arrivals.pop(0)()

    wait_until_done(files, ["a", "b", "c"], poll=0.5, sleep=sleep)
    assert slept == [0.5, 0.5] and not arrivals


def test_merge_keeps_the_output_and_adds_the_rest_in_list_order(tmp_path):
    output = tmp_path / "traj.jsonl"
    files = RankFiles(tmp_path, "traj.")
    write_records(output, ["c"])
    write_records(files.records(0), ["d", "a"])
    write_records(files.records(1), ["b", "c"])  # c: merged already by an interrupted merge
    files.skip(1, "e", "test")
    assert merge(files, output, ["a", "b", "c", "d", "e"]) == 3
    assert [r["id"] for r in lines(output)] == ["c", "a", "b", "d"]
    assert lines(output)[1] == {"id": "a", "value": "A"}
    assert files.ranks() == [] and sorted(p.name for p in tmp_path.iterdir()) == ["traj.jsonl"]


def test_world_from_the_launcher_environment():
    assert World.from_env({}) == World(0, 1)
    assert World.from_env({"RANK": "3", "WORLD_SIZE": "4"}) == World(3, 4)
    for bad in ({"RANK": "4", "WORLD_SIZE": "4"}, {"RANK": "x"}):
        with pytest.raises(ValueError, match="RANK"):
            World.from_env(bad)


# --- self-distillation in a trainer ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / "llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    return write_sharegpt(tmp_path_factory.mktemp("data") / "chats.json", random_chats(24, reply=9))


def test_the_trainer_answers_on_its_training_device(model_dir, chats, tmp_path, monkeypatch):
    """trainer_datasets moves the target to args.device before the engine gets it: with args naming the meta device,
    the generator receives a model on meta (a CPU target would show it was not moved); the generator runs it in eval
    mode and the trainer gets it back in the mode it handed over."""
    import train.self_distill as self_distill_module
    from data.config import load_data_config
    from models.loading import load_target, load_tokenizer

    seen = []

    def generator(engine, tokenizer, conversations, output, config, progress=None, on_skip=None):
        seen.append(({p.device.type for p in engine.model.parameters()}, engine.model.training))
        with open(output, "a") as f:  # an answer per conversation, as the engine would write it
            for i, conversation in conversations:
                turns = [{"from": "human", "value": conversation[0]["content"]}, {"from": "gpt", "value": "ok"}]
                f.write(json.dumps({"id": i, "conversations": turns, "finish": ["stop"]}) + "\n")
        return DistillStats(written=len(conversations), already_done=0, too_long=0, empty=0, truncated_turns=0)

    monkeypatch.setattr(self_distill_module, "self_distill", generator)
    data = load_data_config("sharegpt", {"path": str(chats), "max_length": 64, "validation_fraction": 0.0,
                                         "self_distill_samples": 6, "self_distill_new_tokens": 4})
    cfg = OmegaConf.create({"seed": 0, "model": {"chat_template": None}, "data": data})
    target = load_target(str(model_dir), dtype="fp32").train()  # frozen, in the mode a trainer may hand over
    args = SimpleNamespace(device=torch.device("meta"), process_index=0, world_size=1)
    datasets = self_distill_module.trainer_datasets(cfg, target, load_tokenizer(str(model_dir)), args, tmp_path,
                                                    SplitDatasets(train=[], validation=None))
    assert seen == [({"meta"}, False)]
    assert {p.device.type for p in target.parameters()} == {"meta"}  # left where the trainer trains it
    assert target.training and not any(p.requires_grad for p in target.parameters())  # in the state it came in
    assert len(datasets.train) == 6


def train_command(model_dir: Path, chats: Path, out: Path, *extra: str) -> list[str]:
    return ["medusa1", "+model=tiny", f"model.path={model_dir}", "model.dtype=fp32", "data=sharegpt",
            f"data.path={chats}", "data.max_length=64", "data.validation_fraction=0.25", "data.self_distill=true",
            "data.self_distill_samples=10", "data.self_distill_new_tokens=5", "data.self_distill_batch_size=3",
            "training.max_steps=1", "training.per_device_train_batch_size=2", "method.num_heads=1",
            "eval.greedy_prompts=0", "logger=none", f"output_dir={out}", *extra]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def torchrun(*module: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            *module]


@pytest.fixture(scope="module")
def two_rank_run(model_dir, chats, tmp_path_factory) -> Path:
    """A 2-process trainer run (torchrun, gloo) with self-distillation on: its output_dir."""
    out = tmp_path_factory.mktemp("runs") / "run"
    run([*torchrun("-m", "train"), *train_command(model_dir, chats, out)])
    return out


def answers(out: Path) -> dict[str, list]:
    """id -> conversation of every answer the ranks of a run wrote."""
    files = RankFiles(out / "self_distill")
    return {r["id"]: r["conversations"] for rank in files.ranks() for r in lines(files.records(rank))}


@pytest.mark.distributed
def test_two_trainer_ranks_share_the_prompts_and_one_resumes_them(model_dir, chats, two_rank_run):
    """torchrun, 2 processes (gloo): each rank answers into its own file, the two files together hold every chosen
    prompt once (answered or skipped), and a rerun under world size 1 answers nothing new."""
    out = two_rank_run
    files = RankFiles(out / "self_distill")
    assert files.ranks() == [0, 1]
    answered = [lines(files.records(r)) for r in (0, 1)]
    assert all(answered)  # both ranks answered
    skipped = [r["id"] for rank in (0, 1) if files.skipped(rank).is_file() for r in lines(files.skipped(rank))]
    ids = [r["id"] for rank in answered for r in rank] + skipped
    assert len(ids) == len(set(ids)) == 10
    again = run([sys.executable, "-m", "train", *train_command(model_dir, chats, out, "training.max_steps=2")])
    assert "0 answers generated, 10 already in" in again.stdout + again.stderr
    assert [lines(files.records(r)) for r in (0, 1)] == answered


@pytest.mark.distributed
def test_a_zero3_target_is_gathered_to_answer_and_answers_as_an_unpartitioned_one(model_dir, chats, two_rank_run,
                                                                                   tmp_path):
    """deepspeed=zero3 loads the target partitioned; under data.self_distill each rank gathers it whole, answers its
    share, and the answers are those of the same 2-process run without DeepSpeed, word for word."""
    out = tmp_path / "zero3"
    run([*torchrun("-m", "train"), *train_command(model_dir, chats, out, "deepspeed=zero3")])
    files = RankFiles(out / "self_distill")
    assert files.ranks() == [0, 1] and all(lines(files.records(r)) for r in (0, 1))
    assert answers(out) == answers(two_rank_run) and len(answers(out)) > 0


# --- Jacobi trajectories --------------------------------------------------------------------------------------------

def collect_args(model_dir: Path, chats: Path, output: Path, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--output", str(output), "--data", "sharegpt", f"data.path={chats}",
            "--block-size", "4", "--max-new-tokens", "8", "--max-prompts", "10", "--batch-size", "3", *extra]


@pytest.mark.distributed
def test_two_jacobi_ranks_write_their_shares_and_rank_0_merges_them(model_dir, chats, tmp_path, capsys):
    output = tmp_path / "traj.jsonl"
    result = run([*torchrun("scripts/collect_jacobi.py"), *collect_args(model_dir, chats, output)])
    printed = result.stdout.splitlines()
    rank1_line = next(line for line in printed if line.startswith("rank 1: "))  # "rank 1: N new records -> ..."
    rank0_line = next(line for line in printed if "merged from 2 ranks" in line)  # "N new records -> ..."
    rank0, rank1 = int(rank0_line.split()[0]), int(rank1_line.split()[2])
    assert rank0 > 0 and rank1 > 0 and rank0 + rank1 == 10  # two non-empty shares
    assert "(10 merged from 2 ranks)" in rank0_line
    assert [r["id"] for r in lines(output)] == [f"train:{i}" for i in range(10)]  # every prompt once, in order
    assert sorted(p.name for p in tmp_path.iterdir()) == ["traj.jsonl"]  # rank files merged away
    before = output.read_text()
    assert collect_main(collect_args(model_dir, chats, output)) == 0  # world size 1: nothing left
    assert capsys.readouterr().out.startswith("0 new records")
    assert output.read_text() == before


def test_jacobi_device_and_dtype_defaults_and_bad_values(model_dir, chats, tmp_path, capsys):
    cpu = torch.device("cpu")
    if not torch.cuda.is_available():
        assert placement(None, None) == (cpu, "fp32")
    assert placement("cpu", "bf16") == (cpu, "bf16")
    for device, dtype, message in (("cpu", "float32", "--dtype 'float32': choose one of bf16, fp16, fp32"),
                                   ("gpu", None, "device 'gpu': not a device")):
        with pytest.raises(ValueError, match=message):
            placement(device, dtype)
    missing = tmp_path / "no-model"  # a bad value is refused before the model (or the data) is read
    bad = [(["--dtype", "half"], "--dtype 'half'"), (["--batch-size", "0"], "--batch-size 0")]
    if not torch.cuda.is_available():
        bad.append((["--device", "cuda:1"], "device 'cuda:1': "))
    for extra, message in bad:
        assert collect_main(collect_args(missing, chats, tmp_path / "t.jsonl", *extra)) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not (tmp_path / "t.jsonl").exists()


# --- the offline self-distillation tool ----------------------------------------------------------------------------

@pytest.mark.distributed
def test_two_ranks_of_the_offline_tool_answer_every_conversation_once(model_dir, chats, tmp_path):
    output = tmp_path / "distilled.jsonl"
    args = ["--model", str(model_dir), "--data", str(chats), "--output", str(output), "--max-new-tokens", "4",
            "--batch-size", "3", "--max-samples", "9", "--dtype", "fp32"]
    result = run([*torchrun("scripts/self_distill.py"), *args])
    written = [int(line.split(": ")[1].split()[0]) for line in result.stdout.splitlines()
               if "conversations written" in line]
    assert len(written) == 2 and all(written)  # both ranks answered
    ids = [r["id"] for r in lines(output)]
    assert len(ids) == len(set(ids)) == sum(written) <= 9  # an empty answer is not written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["distilled.jsonl"]
    again = run([sys.executable, "scripts/self_distill.py", *args])
    assert "0 conversations written" in again.stdout
