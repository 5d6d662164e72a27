"""draftsmith inference engine: draft -> verify -> accept -> update cache, lossless by default.

    from inference import load
    engine = load("path/to/drafter")              # base model read from the checkpoint's config.json
    out = engine.generate(prompt_ids, max_new_tokens=128)
    out.sequences, out.stats

Modules: tree (choice paths -> buffers), verify (greedy / typical (lossy) / rejection sampling), cache (tree masks
and KV surgery), drafters (Drafter protocol, NoDrafter, MedusaDrafter), draft_model (DraftModelDrafter), generate (the
loop), api (load + Engine), devices (where a target split by device_map computes).
"""

from inference.api import Engine, load
from inference.draft_model import DraftModelDrafter
from inference.drafters import DecodeState, Draft, Drafter, MedusaDrafter, NoDrafter
from inference.generate import DecodeConfig, GenerationOutput, GenerationStats, StepTimes, generate
from inference.lookahead import LookaheadDrafter, TokenTrie
from inference.prompt_lookup import PromptLookupDrafter
from inference.tree import TreeBuffers, TreeError, build_tree, load_tree
from inference.verify import (
    SamplingParams, VerifyResult, verify_greedy, verify_rejection, verify_speculative, verify_typical,
)

__all__ = [
    "DecodeConfig",
    "DecodeState",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "Engine",
    "GenerationOutput",
    "GenerationStats",
    "LookaheadDrafter",
    "MedusaDrafter",
    "NoDrafter",
    "PromptLookupDrafter",
    "SamplingParams",
    "StepTimes",
    "TokenTrie",
    "TreeBuffers",
    "TreeError",
    "VerifyResult",
    "build_tree",
    "generate",
    "load",
    "load_tree",
    "verify_greedy",
    "verify_rejection",
    "verify_speculative",
    "verify_typical",
]
