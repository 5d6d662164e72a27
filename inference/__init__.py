"""draftsmith inference engine: draft -> verify -> accept -> update cache, lossless by default.

    from inference import load
    engine = load("path/to/drafter")              # base model read from the checkpoint's config.json
    out = engine.generate(prompt_ids, max_new_tokens=128)
    out.sequences, out.stats

Subpackages, each importing only those before it: kernels (CPU linear and attention) <- engine (tree buffers,
verification, cache surgery, the drafter protocol, the loop, devices) <- drafters (Medusa, draft model, EAGLE-3,
Jacobi, lookahead, prompt lookup, the registry) <- api (load + Engine), textstream, session (a command line's model
options) <- collect (self-distillation, Jacobi trajectories), bench (benchmarks, build-tree) <- cli.
"""

from inference.api import Engine, load
from inference.drafters.draft_model import DraftModelDrafter
from inference.drafters.lookahead import LookaheadDrafter, TokenTrie
from inference.drafters.medusa import MedusaDrafter
from inference.drafters.prompt_lookup import PromptLookupDrafter
from inference.engine.drafter import DecodeState, Draft, Drafter, NoDrafter
from inference.engine.loop import DecodeConfig, GenerationOutput, GenerationStats, StepTimes, generate
from inference.engine.tree import TreeBuffers, TreeError, build_tree, load_tree
from inference.engine.verify import (
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
