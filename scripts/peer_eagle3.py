"""Train EAGLE-3 with the reference trainers on OUR feature cache, and serve their drafts in our engine.

    python scripts/peer_eagle3.py convert --cache features/smollm2 --model builtin:smollm2 --out peers/smollm2 \
        --draft-vocab 8192 [--vocab-from CKPT] [--layers 2 15 27] [--max-samples N] [--epochs 1] [--lr 2e-3] \
        [--ttt-steps 3] [--max-length 2048]
        writes <out>/specforge (per-sample .ckpt files, vocab_mapping.pt, a target view, train.yaml, draft.json) and
        <out>/speculators (hidden_states/hs_<i>.safetensors, rows.jsonl, d2t.npy, t2d.npy) from one cache
        (train/peer_formats.py says what each reads), and prints the commands that train, export, import and bench
        all three drafters on the same tokens, epochs, layers and draft vocabulary.
    python scripts/peer_eagle3.py speculators-import SRC DST
        a draft speculators saved -> the LlamaForCausalLMEagle3 folder `python -m models.convert eagle3-import` reads.
    python scripts/peer_eagle3.py tree CKPT OUT.json
        the default tree of a draftsmith eagle3 checkpoint (from its measured acceptance) as a tree file, so that
        imported drafts, which carry no acceptance table, are benched on the same tree.

The peers run in their own virtual environments outside the repository, under $DRAFTSMITH_PEERS (default
<draftsmith cache>/peers: specforge-venv/ and speculators-venv/; --specforge-python / --speculators-python name others):
    python -m venv --system-site-packages $DRAFTSMITH_PEERS/specforge-venv
    $DRAFTSMITH_PEERS/specforge-venv/bin/pip install --no-deps specforge==0.2.0   # + its pure-Python dependencies
    python -m venv --system-site-packages $DRAFTSMITH_PEERS/speculators-venv
    $DRAFTSMITH_PEERS/speculators-venv/bin/pip install speculators==0.9.0 transformers==5.19.0
Each is started through scripts/peer_eagle3_driver.py,
which applies the CPU patches and prints them. Settings: SpecForge training.attention_backend=sdpa, NO_SHARD, fp32
draft; speculators --hidden-states-dtype float32 --loss-implementation eager --draft-attn-impl sdpa, AdamW, and its
norms and sliding window off (`speculators_args`). Both get a batch of 1 sample, like our trainer's command.
Errors print one line naming the file or option and exit with status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from data.errors import UsageError  # noqa: E402
from inference.drafters.eagle3 import default_tree  # noqa: E402
from models.buildcache import cache_root  # noqa: E402
from models.eagle3 import Eagle3Config, read_eagle3_config  # noqa: E402
from models.eagle3_interop import DRAFTSMITH_KEY, foreign_config, sglang_layer_ids  # noqa: E402
from models.refs import locate  # noqa: E402
from train import peer_formats as pf  # noqa: E402

PEERS = Path(os.environ.get("DRAFTSMITH_PEERS") or cache_root() / "peers")
DRIVER = Path(__file__).resolve().parent / "peer_eagle3_driver.py"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/peer_eagle3.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="a feature cache -> SpecForge's and speculators' training data")
    c.add_argument("--cache", required=True, help="a complete `python -m train features` folder")
    c.add_argument("--model", required=True, help="the target the cache was made with (builtin:smollm2, a folder)")
    c.add_argument("--out", required=True, help="output folder (specforge/, speculators/ under it)")
    vocab = c.add_mutually_exclusive_group(required=True)
    vocab.add_argument("--draft-vocab", type=int, help="S: the S most frequent trained labels (train.eagle3's rule)")
    vocab.add_argument("--vocab-from", help="a draftsmith eagle3 checkpoint whose draft vocabulary to reuse")
    c.add_argument("--layers", type=int, nargs=3, help="fused hidden_states indices (default: the cache's three)")
    c.add_argument("--max-samples", type=int, help="only the first N train samples")
    c.add_argument("--epochs", type=int, default=1)
    c.add_argument("--lr", type=float, default=2e-3)
    c.add_argument("--ttt-steps", type=int, default=3)
    c.add_argument("--max-length", type=int, default=2048)
    c.add_argument("--conf-model", default="smollm2", help="conf/model name for our trainer when --model is a folder")
    c.add_argument("--specforge-python", default=str(PEERS / "specforge-venv" / "bin" / "python"))
    c.add_argument("--speculators-python", default=str(PEERS / "speculators-venv" / "bin" / "python"))
    s = sub.add_parser("speculators-import", help="a speculators eagle3 draft -> the LlamaForCausalLMEagle3 layout")
    s.add_argument("src")
    s.add_argument("dst")
    t = sub.add_parser("tree", help="a draftsmith eagle3 checkpoint's default tree -> a tree file")
    t.add_argument("checkpoint")
    t.add_argument("out")
    return p


def specforge_config(out: Path, target: Path, lm_head_key: str, layers: tuple[int, ...], args) -> dict:
    """SpecForge 0.2.0's run config (specforge/config/schema.py Config) for offline training on CPU."""
    return {
        "model": {"target_model_path": str(target), "draft_model_config": str(out / "draft.json"),
                  "lm_head_key": lm_head_key, "vocab_mapping_path": str(out / "vocab_mapping.pt"),
                  "aux_hidden_state_layer_ids": sglang_layer_ids(layers), "torch_dtype": "float32"},
        "data": {"hidden_states_path": str(out / "data"), "max_length": args.max_length,
                 "cache_dir": str(out / "cache"), "dataloader_num_workers": 0},
        "training": {"num_epochs": args.epochs, "batch_size": 1, "learning_rate": args.lr,
                     "ttt_length": args.ttt_steps, "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                     "log_interval": 10},
        "output_dir": str(out / "output"),
    }


def convert(args) -> int:
    cache, out = Path(args.cache), Path(args.out)
    manifest = pf.check_cache_for_peers(cache)
    layers = pf.fused_of(manifest, args.layers, f"--cache {cache}")
    model_dir = locate(args.model)
    text = json.loads((model_dir / "config.json").read_text())
    text = text.get("text_config", text)
    if int(text["vocab_size"]) != manifest.vocab_size or int(text["hidden_size"]) != manifest.hidden_size:
        raise pf.PeerFormatError(f"--model {args.model}: vocab {text['vocab_size']} / hidden {text['hidden_size']}, "
                                 f"the cache's {manifest.vocab_size} / {manifest.hidden_size}")
    if args.draft_vocab is not None and not 0 < args.draft_vocab <= manifest.vocab_size:
        raise pf.PeerFormatError(f"--draft-vocab {args.draft_vocab}: outside [1, {manifest.vocab_size}]")
    norm = pf.final_norm(model_dir)
    ids = (pf.checkpoint_vocab(args.vocab_from) if args.vocab_from
           else pf.cache_vocab(cache, args.draft_vocab, manifest.vocab_size))
    sf, sp = out / "specforge", out / "speculators"
    counts = pf.write_specforge(cache, sf, layers, ids, manifest.vocab_size, args.max_samples)
    ratio = pf.write_speculators(cache, sp, layers, ids, manifest.vocab_size, norm, args.max_samples)["train_data_ratio"]
    target, key = pf.specforge_target(model_dir, sf / "target")
    draft = foreign_config(Eagle3Config(target=text, layers=layers, draft_vocab_size=len(ids), ttt_steps=args.ttt_steps),
                           torch.float32, {}, str(model_dir / "config.json"))
    draft.pop(DRAFTSMITH_KEY, None)
    (sf / "draft.json").write_text(json.dumps(draft, indent=2))
    (sf / "train.yaml").write_text(json.dumps(specforge_config(sf, target, key, layers, args), indent=2))
    print(f"{counts['samples']} samples, {counts['tokens']:,} tokens ({counts['trained_tokens']:,} trained), layers "
          f"{list(layers)}, draft vocabulary {len(ids)}: {sf} and {sp}")
    for line in commands(args, cache, out, model_dir, layers, len(ids), ratio):
        print(line)
    return 0


def commands(args, cache: Path, out: Path, model_dir: Path, layers: tuple[int, ...], size: int,
             ratio: float) -> list[str]:
    """The commands that train each peer, bring its draft back, and bench all three on the same prompts."""
    sf, sp, q = out / "specforge", out / "speculators", shlex.quote
    driver = q(str(DRIVER))
    model = args.model.removeprefix("builtin:") if args.model.startswith("builtin:") else f"{args.conf_model} " \
        f"model.path={q(str(model_dir))}"
    partial = [f"# --max-samples {args.max_samples}: the peers get the first {args.max_samples} train samples, this "
               f"command the whole cache; for one comparison make the cache that small instead "
               f"(python -m train features ... data.max_samples=N)"] if args.max_samples else []
    return [
        *partial,
        "# draftsmith",
        f"OMP_NUM_THREADS=1 python -m train eagle3 +model={model} +experiment=sharegpt_eagle3 "
        f"data.features={q(str(cache))} data.self_distill=false method.layers=[{','.join(map(str, layers))}] method.draft_vocab={size} "
        f"method.ttt_steps={args.ttt_steps} training.num_train_epochs={args.epochs} training.learning_rate={args.lr} "
        f"training.per_device_train_batch_size=1 training.max_steps=-1 output_dir={q(str(out / 'ours'))}",
        "# SpecForge 0.2.0 (patches: scripts/peer_eagle3_driver.py)",
        f"OMP_NUM_THREADS=1 {q(args.specforge_python)} {driver} specforge -- train -c {q(str(sf / 'train.yaml'))}",
        f"{q(args.specforge_python)} {driver} specforge -- export --to sglang --checkpoint "
        f"{q(str(sf / 'output'))}/specforge-run-step<last> --draft-config {q(str(sf / 'draft.json'))} "
        f"--output-dir {q(str(sf / 'export'))} --vocab-mapping {q(str(sf / 'vocab_mapping.pt'))}",
        f"python -m models.convert eagle3-import {q(str(sf / 'export'))} {q(str(out / 'specforge-draft'))} "
        f"--base {q(str(model_dir))}",
        "# speculators 0.9.0 (patches: scripts/peer_eagle3_driver.py)",
        f"{q(args.speculators_python)} {driver} speculators-dataset {q(str(sp))}",
        f"OMP_NUM_THREADS=1 {q(args.speculators_python)} {driver} speculators -- "
        + " ".join(speculators_args(args, model_dir, sp, layers, size, ratio)),
        f"python scripts/peer_eagle3.py speculators-import {q(str(sp / 'output'))}/<last epoch> "
        f"{q(str(sp / 'export'))}",
        f"python -m models.convert eagle3-import {q(str(sp / 'export'))} {q(str(out / 'speculators-draft'))} "
        f"--base {q(str(model_dir))}",
        "# the engine: the same prompts, chain 3 and one tree (our draft's default tree) for all three",
        f"python scripts/peer_eagle3.py tree {q(str(out / 'ours'))} {q(str(out / 'tree.json'))}",
        "python scripts/bench_suite.py conf/bench/smollm2-eagle3-peers.yaml --out outputs/bench/smollm2-eagle3-peers",
    ]


def speculators_args(args, model_dir: Path, sp: Path, layers: tuple[int, ...], size: int, ratio: float) -> list[str]:
    """speculators.train's flags for the classic EAGLE-3 layer our engine serves (its 0.9.0 defaults add norms before
    fc, before the residual and on the fed-back state, and a sliding window; the layout has none) and the same
    AdamW, epochs, TTT steps and sequence length as the other two. --mask-token-id: the EAGLE-3 draft reads none, but
    the CLI resolves one from the target's tokenizer unless given. --train-data-ratio: the train samples, exactly
    (train.peer_formats.write_speculators)."""
    q = shlex.quote
    return ["--verifier-name-or-path", q(str(model_dir)), "--data-path", q(str(sp / "data")),
            "--d2t-path", q(str(sp / "d2t.npy")), "--t2d-path", q(str(sp / "t2d.npy")),
            "--draft-vocab-size", str(size), "--target-layer-ids", *map(str, layers),
            "--epochs", str(args.epochs), "--lr", str(args.lr), "--optimizer", "adamw",
            "--ttt-steps", str(args.ttt_steps), "--total-seq-len", str(args.max_length),
            "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output", "--full-attention-indices", "0",
            "--mask-token-id", "0", "--hidden-states-dtype", "float32", "--loss-implementation", "eager",
            "--draft-attn-impl", "sdpa", "--num-workers", "0", "--on-missing", "raise",
            "--train-data-ratio", repr(ratio), "--save-path", q(str(sp / "output"))]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "convert":
            return convert(args)
        if args.command == "tree":
            choices = default_tree(read_eagle3_config(args.checkpoint).acceptance)
            Path(args.out).write_text(json.dumps({"choices": [list(c) for c in choices],
                                                  "source": f"default tree of {args.checkpoint}"}) + "\n")
            print(f"{args.out}: {len(choices)} nodes")
            return 0
        print(pf.speculators_to_eagle3(args.src, args.dst))
        return 0
    except (UsageError, ValueError, OSError, KeyError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
