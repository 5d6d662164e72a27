"""The training task (`python -m train <method>`): check everything, build the built-in tiny models it uses that were
never built (train.tiny_build), load the target, build the data, train with the HF Trainer (train.trainer), evaluate,
save. A method (train/<name>.py) only says which modules train and how a batch becomes a loss (train.method); this
module stays free of method branches.
"""

from __future__ import annotations

import logging
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from transformers import set_seed

from data.collate import ChatCollator
from data.datasets import SplitDatasets, build_datasets
from data.features import FeatureCollator, FeatureDataset, check_cache, read_prompts
from models.fingerprint import target_fingerprint, tokenizer_fingerprint
from models.loading import check_nf4_on_cpu, load_target, load_tokenizer, places_on_cpu
from models.refs import builtin_names, parse_model
from models.tiny import BUILD_COMMAND, BUILD_TIME, BUILTIN_MODELS, is_built
from train.checks import check_values
from train.distributed import deepspeed_settings, is_main_process
from train.logger import configure_logger
from train.method import ChecksInputs, CountsLabels, ProvidesData, ReadsFeatures, Standalone, TrainMethod, load_method
from train.prompts import prompt_ids
from train.resume import check_resume, resolve_resume
from train.self_distill import trainer_datasets
from train.tiny_build import ensure_built
from train.trainer import (TRAINER_CHECKPOINTS, DraftTrainer, LossModule, RunStart, TimeBudget, TrimHeap, glibc,
                           throughput, training_arguments)

log = logging.getLogger("draftsmith")
MODEL_KEYS = ("model.path", "method.draft")  # the settings that name a model (train.config)


@dataclass(frozen=True)
class CachedData:
    datasets: SplitDatasets
    collator: FeatureCollator
    prompts: list[list[int]]  # greedy-evaluation prompts stored with the cache


def feature_cache(cfg: DictConfig, tokenizer: Any, method: TrainMethod) -> CachedData:
    """data.features: the train / validation samples of a feature cache made for this target and tokenizer (checked
    from the files, before the target loads), with the layers the method reads (ReadsFeatures) and soft labels when
    it mixes them in."""
    folder = cfg.data.features
    if isinstance(method, ReadsFeatures):
        layers, soft = method.feature_needs()
    else:
        layers, soft = [], cfg.method.get("soft_labels", 0) > 0
    manifest = check_cache(
        folder, target=target_fingerprint(cfg.model.path, cfg.model.trust_remote_code, cfg.model.revision),
        tokenizer=tokenizer_fingerprint(tokenizer), need_layers=layers, need_topk=soft)
    validation = (FeatureDataset(folder, "validation", layers, topk=soft) if manifest.samples.get("validation")
                  else None)
    train = FeatureDataset(folder, "train", layers, topk=soft)
    if cfg.data.max_tokens is not None:
        train = train.sample(cfg.data.max_tokens, cfg.data.seed)
    log.info("data.features=%s: %s of its %s train tokens in %d samples (the cache's data recipe replaces data=%s)",
             folder, f"{train.tokens:,}", f"{manifest.tokens['train']:,}", len(train), cfg.data.name)
    return CachedData(
        datasets=SplitDatasets(train=train, validation=validation),
        collator=FeatureCollator(tokenizer.pad_token_id),
        prompts=read_prompts(folder)[: cfg.eval.greedy_prompts],
    )


def build_tiny_models(cfg: DictConfig) -> None:
    """Build each built-in tiny model the run uses (a MODEL_KEYS setting names it, directly, as a conf/model name or
    as an early-exit source) that was never built, after one line on stderr: models/ only locates built ones
    (models.builtin), so the training entry point builds them. Every process of a launch calls this; the build lock
    lets one build while the others wait, and only the main process prints the line."""
    settings = [OmegaConf.select(cfg, key) for key in MODEL_KEYS]
    named = {name for model in settings if model for name in builtin_names(parse_model(model))}
    for name in BUILTIN_MODELS:
        if name in named and not is_built(name):
            if is_main_process():
                print(f"builtin:{name} is not built yet: building it now, once ({BUILD_TIME}; `{BUILD_COMMAND}` is "
                      f"the same step on its own)", file=sys.stderr, flush=True)
            ensure_built(name)


def run(cfg: DictConfig) -> dict[str, float]:
    """Hydra task: set up, train, evaluate, save. Returns the final metrics.

    Everything a user gave is checked before the expensive work: values and combinations, the resumed checkpoint
    against this config; then any built-in tiny model the run uses is built if it never was (the checks that follow
    read the models' files); then the 4-bit layers' shapes, cross-file inputs (ChecksInputs), then every data record;
    only then does the target load and the data get generated (self-distillation) or trained on."""
    check_values(cfg)  # again for each job of a multirun, whose values were not checked before Hydra started
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    set_seed(cfg.seed)
    output_dir = Path(cfg.output_dir)
    method = load_method(cfg)
    resume = resolve_resume(cfg.training.resume_from_checkpoint, output_dir / TRAINER_CHECKPOINTS)
    if resume:
        check_resume(cfg, Path(resume))
    build_tiny_models(cfg)
    output_dir.mkdir(parents=True, exist_ok=True)
    report_to = configure_logger(cfg)
    if isinstance(method, Standalone):
        return method.run(cfg)

    deepspeed = deepspeed_settings(cfg)  # checks the combination and reads the target's config only
    if cfg.model.quantization == "nf4" and places_on_cpu(None):
        check_nf4_on_cpu(cfg.model.path, cfg.model.trust_remote_code, cfg.model.revision)
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.chat_template or cfg.data.chat_template, cfg.model.trust_remote_code)
    if isinstance(method, ChecksInputs):
        method.check_inputs(tokenizer)
    own_data = isinstance(method, ProvidesData)
    cache = feature_cache(cfg, tokenizer, method) if cfg.data.features else None
    if cache is not None:
        datasets = cache.datasets
    else:
        datasets = method.datasets(tokenizer) if own_data else build_datasets(cfg.data, tokenizer)
    args = training_arguments(cfg, report_to, deepspeed)  # before the target: ZeRO-3 loads it partitioned
    target = load_target(
        cfg.model.path,
        dtype=cfg.model.dtype,
        quantization=cfg.model.quantization,
        double_quant=cfg.model.double_quant,
        attn_implementation=cfg.model.attn_implementation,
        # a 4-bit target cannot move after loading: it loads onto this rank's training device
        device_map=str(args.device) if cfg.model.quantization not in (None, "none") else None,
        trust_remote_code=cfg.model.trust_remote_code,
        revision=cfg.model.revision,
    )
    if cfg.data.self_distill and not own_data and cache is None:  # on args.device, the ranks sharing the prompts
        datasets = trainer_datasets(cfg, target, tokenizer, args, output_dir, datasets)
    if isinstance(method, CountsLabels):
        method.count_labels(datasets.train)
    model = method.build(target, tokenizer)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_val = len(datasets.validation) if datasets.validation is not None else 0
    log.info("method %s: %.2fM trainable parameters; %d train / %d validation samples",
             cfg.method.name, n_train / 1e6, len(datasets.train), n_val)
    if not n_val:
        log.warning("no validation samples (data.validation_path / data.validation_fraction): skipping evaluation")

    extra = {
        "method": cfg.method.name,
        "data": cfg.data.path or cfg.data.name,
        "command": "python -m train " + shlex.join(sys.argv[1:]),
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
    }
    trainer = DraftTrainer(
        model=LossModule(model, method),
        args=args,
        train_dataset=datasets.train,
        eval_dataset=datasets.validation,
        data_collator=(cache.collator if cache is not None else method.collator(tokenizer) if own_data
                       else ChatCollator(tokenizer.pad_token_id)),
        processing_class=tokenizer,
        method=method,
        prompts=cache.prompts if cache is not None else prompt_ids(cfg, tokenizer),
        extra=extra,
        on_nonfinite=cfg.training.on_nonfinite,
    )
    if cfg.training.max_minutes:
        trainer.add_callback(TimeBudget(cfg.training.max_minutes))
    libc = glibc() if cfg.training.trim_heap and args.device.type == "cpu" else None
    if libc is not None:
        trainer.add_callback(TrimHeap(libc))
    start = RunStart()
    trainer.add_callback(start)
    if resume:
        log.info("resuming from %s", resume)
    trained = trainer.train(resume_from_checkpoint=resume)
    extra["throughput"] = throughput(trained.metrics, trainer.state, start)
    log.info("training: %(steps)d steps, %(tokens)d tokens in %(seconds).0f s: %(tokens_per_second).0f tokens/s, "
             "%(seconds_per_step).2f s a step, peak resident memory %(peak_rss_gb).2f GB", extra["throughput"])
    metrics = trainer.evaluate() if n_val else {}
    extra["metrics"] = {k: v for k, v in metrics.items() if isinstance(v, float)}
    trainer.save_drafter(output_dir, {**extra, "global_step": trainer.state.global_step})
    if not is_main_process():
        return metrics
    if metrics:
        print(method.report(metrics), flush=True)
    print(f"checkpoint: {output_dir}", flush=True)
    return metrics
