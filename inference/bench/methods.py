"""The methods `bench` times: our engine (with the drafter, or NoDrafter) and Hugging Face `generate` baselines.

    drafter      the engine with the session's drafter
    ar           the same engine loop with NoDrafter (one token per target forward)
    hf           `model.generate` on the same model object (greedy, or sampling with the same filters)
    hf_pld       `generate(prompt_lookup_num_tokens=N, max_matching_ngram_size=n)`: HF prompt lookup decoding, with
                 by default the draft length and longest n-gram of our prompt_lookup drafter (the session's when
                 --drafter is prompt_lookup, else its defaults)
    hf_assisted  `generate(assistant_model=draft)`: HF assisted generation with the same draft model as our
                 draft-model drafter (HF's own draft-length policy; `assisted_settings` records it)
    llama_cpp    llama.cpp's plain greedy decoding (llama-cpp-python) of the same prompt ids from a GGUF file (--gguf;
                 for smollm2 by default the Q4_1 file the builtin model is dequantised from: the same weights), with
                 as many threads as torch; its own quantised kernels round differently, so it is timed but not held to
                 greedy identity (inference.bench.stats.OWN_NUMERICS)
hf_pld, hf_assisted and llama_cpp are greedy only. Every runner maps (prompt ids, max new tokens, seed) to a
`TurnResult`; the HF runners count the target's forward calls with a forward hook, so τ is measured for them too.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from inference.api import Engine
from inference.bench.stats import TurnResult
from inference.drafters.prompt_lookup import PromptLookupDrafter
from inference.engine.devices import input_device
from inference.engine.drafter import NoDrafter
from models.backbone import eos_token_ids

BASELINES = ("ar", "hf", "hf_pld", "hf_assisted", "llama_cpp")
GREEDY_ONLY = ("hf_pld", "hf_assisted", "llama_cpp")


@dataclass(frozen=True)
class Sampling:
    """A method's sampling parameters under the engine's names (declared in inference.engine.loop.SAMPLING_GROUPS:
    their flags, defaults and checks); max_new_tokens is a run's, given per call."""

    temperature: float
    top_k: int
    top_p: float
    acceptance: str

    @classmethod
    def of(cls, args: argparse.Namespace) -> Sampling:
        """The sampling flags of a parsed `bench` command line."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class HFOptions:
    """Settings of the HF speculative baselines."""

    pld_tokens: int  # prompt_lookup_num_tokens: tokens copied per lookup
    pld_ngram: int  # max_matching_ngram_size: longest suffix n-gram searched
    assistant: nn.Module | None  # hf_assisted's draft model, in the target's dtype on its device
    gguf: str | None = None  # llama_cpp's GGUF file


Runner = Callable[[list[int], int, int], TurnResult]


class EngineRunner:
    """A method that decodes with an inference Engine (drafter or NoDrafter)."""

    def __init__(self, engine: Any, sampling: Sampling) -> None:
        self.engine, self.sampling = engine, sampling
        engine.sync_phases = True  # per-phase times right on CUDA too (the tables show where a step's time goes)

    def __call__(self, prompt_ids: list[int], max_new_tokens: int, seed: int) -> TurnResult:
        s = self.sampling
        start = time.perf_counter()
        out = self.engine.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=s.temperature,
                                   top_k=s.top_k, top_p=s.top_p, acceptance=s.acceptance, seed=seed)
        stats = out.stats
        wall = time.perf_counter() - start - stats.times.compile  # a compiled step's first calls: timed apart
        return TurnResult(tuple(out.sequences[0]), "", wall, stats.target_forwards,
                          tuple(step[0] for step in stats.accepted), stats.times)


class ForwardCounter:
    """Counts the forward calls of `module` inside a `with` block (a forward hook, removed on exit)."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.count = module, 0

    def __enter__(self) -> ForwardCounter:
        self.count = 0
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self.count += 1

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()


class HFRunner:
    """Hugging Face `generate` on the target: greedy at temperature 0, else sampling with the same filters.
    `extra` are further `generate` keywords (prompt lookup, assistant model); then the per-step acceptance is not
    observable and `accepted` stays empty, while `target_forwards` is counted."""

    def __init__(self, model: nn.Module, eos_ids: Sequence[int], pad_id: int | None, sampling: Sampling,
                 extra: Mapping[str, Any] | None = None) -> None:
        self.model, self.eos_ids, self.pad_id, self.sampling = model, list(eos_ids), pad_id, sampling
        self.extra = dict(extra or {})

    def __call__(self, prompt_ids: list[int], max_new_tokens: int, seed: int) -> TurnResult:
        s = self.sampling
        ids = torch.tensor([prompt_ids], device=input_device(self.model))
        kwargs: dict[str, Any] = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        if s.temperature > 0:
            kwargs = {"do_sample": True, "temperature": s.temperature, "top_k": s.top_k or None, "top_p": s.top_p}
            torch.manual_seed(seed)
        start = time.perf_counter()
        with ForwardCounter(self.model) as forwards:
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                min_new_tokens=None, eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id, **kwargs,
                **self.extra,
            )
        tokens = out[0, len(prompt_ids):].tolist()
        wall = time.perf_counter() - start
        end = next((i + 1 for i, t in enumerate(tokens) if t in self.eos_ids), len(tokens))
        tokens = tokens[:end]
        accepted = () if self.extra else (0,) * max(len(tokens) - 1, 0)
        return TurnResult(tuple(tokens), "", wall, forwards.count, accepted, None)


class LlamaCppRunner:
    """llama.cpp greedy decoding (llama-cpp-python) of the prompt ids, from a GGUF file, on torch's thread count."""

    def __init__(self, gguf: str, eos_ids: Sequence[int], context: int = 4096) -> None:
        from llama_cpp import Llama  # deferred: an optional package (pip install llama-cpp-python)

        self.llm = Llama(model_path=gguf, n_ctx=context, n_threads=torch.get_num_threads(),
                         n_threads_batch=torch.get_num_threads(), verbose=False)
        self.eos_ids = set(eos_ids)

    def __call__(self, prompt_ids: list[int], max_new_tokens: int, seed: int) -> TurnResult:
        start = time.perf_counter()
        tokens: list[int] = []
        for token in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(token))
            if token in self.eos_ids or len(tokens) >= max_new_tokens:
                break
        wall = time.perf_counter() - start
        return TurnResult(tuple(tokens), "", wall, len(tokens), (0,) * max(len(tokens) - 1, 0), None)


def pld_defaults(drafter: Any) -> tuple[int, int]:
    """(draft tokens, longest n-gram) of the session's prompt_lookup drafter, else of a default one."""
    reference = drafter if isinstance(drafter, PromptLookupDrafter) else PromptLookupDrafter()
    return reference.num_draft, reference.max_ngram


def assisted_settings(assistant: nn.Module) -> dict[str, Any]:
    """The draft-length policy `generate(assistant_model=...)` applies, as transformers' AssistedCandidateGenerator
    resolves it (the assistant's generation_config over the library defaults; with scikit-learn installed the
    confidence threshold adapts during generation)."""
    from transformers.utils import is_sklearn_available

    config = copy.deepcopy(assistant.generation_config)
    config.update(**config._get_default_generation_params(), defaults_only=True)  # what generate() does (5.x)
    return {"num_assistant_tokens": config.num_assistant_tokens,
            "num_assistant_tokens_schedule": config.num_assistant_tokens_schedule,
            "assistant_confidence_threshold": config.assistant_confidence_threshold,
            "adaptive_threshold": bool(is_sklearn_available() and config.assistant_confidence_threshold)}


def build_runners(session: Any, names: Sequence[str], sampling: Sampling, hf: HFOptions) -> dict[str, Runner]:
    model = session.engine.model
    eos, pad = eos_token_ids(model), session.tokenizer.pad_token_id
    extra = {"hf": {},
             "hf_pld": {"prompt_lookup_num_tokens": hf.pld_tokens, "max_matching_ngram_size": hf.pld_ngram},
             "hf_assisted": {"assistant_model": hf.assistant}}
    made: dict[str, Runner] = {}
    for name in names:
        if name == "drafter":
            made[name] = EngineRunner(session.engine, sampling)
        elif name == "ar":
            made[name] = EngineRunner(Engine(model, NoDrafter()), sampling)
        elif name == "llama_cpp":
            made[name] = LlamaCppRunner(hf.gguf, eos)
        else:
            made[name] = HFRunner(model, eos, pad, sampling, extra[name])
    return made
