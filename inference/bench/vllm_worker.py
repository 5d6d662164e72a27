"""vLLM's side of the serve check (inference.bench.serve_check), run by vLLM's own Python, not ours:

    <vllm-venv>/bin/python inference/bench/vllm_worker.py REQUEST.json RESULT.json

vLLM pins its own transformers and torch, so it lives in a separate environment; this file imports nothing of
draftsmith's (the standard library, then vllm inside `main`). REQUEST holds the target folder, the exported drafter,
the speculative method, the number of draft tokens, the dtype and the prompts as token ids; RESULT gets, per prompt,
the greedy output ids and the seconds its `generate` took, and the spec-decode counters the prompts added
(`LLM.get_metrics()`: vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens and
_num_accepted_tokens_per_pos, read before and after so the warm-up is not counted). Prompts run one at a time
(batch 1, as our engine runs them), after one warm-up generation.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Iterable

PREFIX = "vllm:spec_decode_"
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POSITION = "num_accepted_tokens_per_pos"
WARMUP_TOKENS = 8


def spec_counts(metrics: Iterable[Any], num_draft: int) -> dict[str, Any]:
    """The spec-decode counters of a `get_metrics()` snapshot (Counter: .value, Vector: .values), summed over
    engines; absent ones are 0."""
    counts: dict[str, Any] = {name: 0 for name in COUNTERS}
    counts[PER_POSITION] = [0] * num_draft
    for metric in metrics:
        name = metric.name.removeprefix(PREFIX)
        if name in COUNTERS:
            counts[name] += int(metric.value)
        elif name == PER_POSITION:
            for i, value in enumerate(metric.values[:num_draft]):
                counts[PER_POSITION][i] += int(value)
    return counts


def counts_added(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """after - before, counter by counter (the per-position one element-wise)."""
    added = {name: after[name] - before[name] for name in COUNTERS}
    added[PER_POSITION] = [a - b for a, b in zip(after[PER_POSITION], before[PER_POSITION])]
    return added


def main(argv: list[str]) -> int:
    request_file, result_file = argv
    with open(request_file, encoding="utf-8") as f:
        request = json.load(f)
    import vllm  # deferred: only vLLM's own environment has it
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    num_draft = request["num_draft"]
    llm = LLM(model=request["target"], tokenizer=request["target"], dtype=request["dtype"], seed=0,
              max_model_len=request["max_model_len"], enforce_eager=True, disable_log_stats=False,
              speculative_config={"method": request["method"], "model": request["drafter"],
                                  "num_speculative_tokens": num_draft})
    stop = request["stop_token_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"], stop_token_ids=stop)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS), use_tqdm=False)
    before = spec_counts(llm.get_metrics(), num_draft)
    answers = []
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        answers.append({"tokens": list(out.token_ids), "wall_s": time.perf_counter() - start,
                        "finish_reason": out.finish_reason})
    counts = counts_added(before, spec_counts(llm.get_metrics(), num_draft))
    with open(result_file, "w", encoding="utf-8") as f:
        json.dump({"vllm_version": vllm.__version__, "answers": answers, "counts": counts}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
