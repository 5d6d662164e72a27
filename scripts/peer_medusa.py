"""Driver for FasterDecoding's Medusa engine (PyPI `medusa-llm`), run by scripts/bench_peers.py inside the peer's own
virtual environment (its transformers, not ours). Standalone on purpose: it imports nothing from draftsmith.

Protocol: one JSON object per line on stdin, one reply per line on the original stdout (the libraries' own prints go
to stderr). Requests:
    {"cmd": "init", "model_dir", "work_dir", "heads_dir", "choices", "dtype", "threads"}
        prepares <work_dir>/base (the target's folder as this transformers reads it), loads Medusa's
        KV-cache Llama with the heads from <heads_dir> (config.json names <work_dir>/base) and a stock
        LlamaForCausalLM for plain greedy; replies {"versions", "patches"}
    {"cmd": "generate", "method": "medusa" | "greedy", "prompt": [ids], "max_new_tokens": N}
        replies {"tokens", "wall", "forwards", "accepted", "times"} (tokens trimmed at EOS and N)
    {"cmd": "quit"}
Every reply carries "ok"; a failure replies {"ok": false, "error": "<one line>"} and the driver goes on.

The Medusa loop below is `MedusaModel.medusa_generate` (medusa-llm 0.1) step for step, calling the package's own
functions in the same order, with three differences that favour the peer or make it measurable: it stops at N new
tokens (medusa_generate only counts steps), it skips the per-step `tokenizer.decode` of the whole answer that
medusa_generate yields for streaming, and it times the phases (prefill, draft, forward, verify, cache).
Runtime patches (listed in the init reply, so the bench prints them):
    rope_theta   the package's Llama fork builds its rotary embedding with base 10000 whatever the config says;
                 SmolLM2 uses 100000, so `_init_rope` is wrapped to pass config.rope_theta
    gqa_cache    `initialize_past_key_values` allocates num_attention_heads KV heads; a grouped-query model
                 (SmolLM2: 9 query / 3 KV heads) writes num_key_value_heads, so the buffer uses that
    config       the target's config.json (written by transformers 5: rope_parameters, dtype) is rewritten with
                 rope_theta / torch_dtype for this transformers, and tokenizer.json with its BPE merges as strings
                 (tokenizers 0.14 cannot read merge pairs); weights linked, not copied
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

PATCHES: list[str] = []


def reply(out, obj: dict) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def prepare_base(model_dir: Path, base_dir: Path) -> None:
    """The target folder as transformers 4.3x reads it: rope_theta and torch_dtype at the top of config.json, a
    tokenizer_config naming the fast tokenizer class (transformers 5's tokenizer_config names classes it lacks)."""
    base_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    rope = config.pop("rope_parameters", None) or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{model_dir}/config.json: rope_type {rope['rope_type']!r} is not handled by this driver")
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    config.pop("transformers_version", None)
    (base_dir / "config.json").write_text(json.dumps(config, indent=2))
    write_old_tokenizer(model_dir / "tokenizer.json", base_dir / "tokenizer.json")
    for name in ("model.safetensors", "generation_config.json"):
        link = base_dir / name
        if (model_dir / name).exists() and not link.exists():
            link.symlink_to((model_dir / name).resolve())
    tok = json.loads((model_dir / "tokenizer_config.json").read_text()) if (model_dir / "tokenizer_config.json").exists() else {}
    keep = {k: tok[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token", "model_max_length") if k in tok}
    (base_dir / "tokenizer_config.json").write_text(json.dumps({**keep, "tokenizer_class": "PreTrainedTokenizerFast"}))
    PATCHES.append(f"config: {model_dir}/config.json rewritten for transformers 4.x into {base_dir} "
                   f"(rope_theta={config.get('rope_theta')}, torch_dtype={config.get('torch_dtype')}); "
                   f"tokenizer.json merges rewritten as strings")


def write_old_tokenizer(src: Path, dst: Path) -> None:
    """tokenizer.json as tokenizers 0.14 parses it: BPE merges as "a b" strings (newer files store pairs), without
    the model keys it does not know. MedusaModel builds the tokenizer although this driver passes only ids."""
    data = json.loads(src.read_text())
    model = data.get("model", {})
    if model.get("merges") and isinstance(model["merges"][0], list):
        model["merges"] = [" ".join(pair) for pair in model["merges"]]
    model.pop("ignore_merges", None)
    dst.write_text(json.dumps(data))


def patch_rope() -> None:
    from medusa.model import modeling_llama_kv as kv

    original = kv.LlamaAttention._init_rope

    def _init_rope(self) -> None:
        original(self)
        theta = float(getattr(self.config, "rope_theta", 10000.0))
        if self.config.rope_scaling is None and theta != self.rotary_emb.base:
            self.rotary_emb = kv.LlamaRotaryEmbedding(self.head_dim, max_position_embeddings=self.max_position_embeddings,
                                                      base=theta)

    kv.LlamaAttention._init_rope = _init_rope
    PATCHES.append("rope_theta: medusa.model.modeling_llama_kv.LlamaAttention._init_rope passes config.rope_theta "
                   "(the fork hard-codes base 10000)")


def patch_gqa_cache() -> None:
    from medusa.model import kv_cache, medusa_model

    def initialize_past_key_values(model):
        config = model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        data = torch.zeros(config.num_hidden_layers * 2, 1, heads, config.max_position_embeddings,
                           config.hidden_size // config.num_attention_heads, device=model.device, dtype=model.dtype)
        length = torch.zeros(config.num_hidden_layers * 2, dtype=torch.long, device="cpu")
        past = [[kv_cache.KVCache(data[i * 2 + j], length[i * 2 + j]) for j in range(2)]
                for i in range(config.num_hidden_layers)]
        return past, data, length

    kv_cache.initialize_past_key_values = initialize_past_key_values
    medusa_model.initialize_past_key_values = initialize_past_key_values
    PATCHES.append("gqa_cache: medusa.model.kv_cache.initialize_past_key_values allocates num_key_value_heads "
                   "(the package allocates num_attention_heads, which a grouped-query model cannot write)")


def versions() -> dict[str, str]:
    from importlib.metadata import version

    found = {"python": sys.version.split()[0]}
    for name in ("medusa-llm", "torch", "transformers", "tokenizers", "accelerate", "fschat", "safetensors"):
        try:
            found[name] = version(name)
        except Exception:  # noqa: BLE001 - a missing distribution is reported as such
            found[name] = "absent"
    return found


class Medusa:
    """Medusa's engine and a stock greedy model of the same stack, on one target."""

    def __init__(self, req: dict) -> None:
        torch.set_num_threads(int(req["threads"]))
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[req["dtype"]]
        base_dir = Path(req["work_dir"]) / "base"
        prepare_base(Path(req["model_dir"]), base_dir)
        patch_rope()
        patch_gqa_cache()
        from medusa.model import medusa_model, utils
        from transformers import LlamaForCausalLM

        self.utils = utils
        heads_dir = Path(req["heads_dir"])
        named = json.loads((heads_dir / "config.json").read_text()).get("base_model_name_or_path")
        if Path(named).resolve() != base_dir.resolve():
            raise ValueError(f"{heads_dir}/config.json: base_model_name_or_path {named!r} is not {base_dir}")
        self.model = medusa_model.MedusaModel.from_pretrained(str(heads_dir), torch_dtype=dtype).eval()
        # from_pretrained loads the heads with strict=False; load again strictly so a key mismatch cannot pass silently
        state = torch.load(heads_dir / "medusa_lm_head.pt", map_location="cpu")
        self.model.medusa_head.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
        self.choices = list(req["choices"])
        if len(self.choices) - 1 != self.model.medusa:
            raise ValueError(f"choices {self.choices}: medusa-llm 0.1 takes [1, k_1..k_H] with one k per head "
                             f"(H={self.model.medusa})")
        self.buffers = utils.generate_medusa_buffers(self.choices, device="cpu")
        self.kv = medusa_model.initialize_past_key_values(self.model.base_model)
        self.eos = self.model.base_model.config.eos_token_id
        self.greedy_model = LlamaForCausalLM.from_pretrained(str(base_dir), torch_dtype=dtype).eval()

    @torch.inference_mode()
    def medusa(self, prompt: list[int], max_new: int) -> dict:
        u, model, buffers = self.utils, self.model, self.buffers
        past_key_values, data, length = self.kv
        times = dict.fromkeys(("prefill", "draft", "forward", "verify", "cache", "other"), 0.0)
        start = time.perf_counter()
        length.zero_()
        input_ids = torch.tensor([prompt])
        u.reset_medusa_mode(model)
        medusa_logits, logits = u.initialize_medusa(input_ids, model, buffers["medusa_attn_mask"], past_key_values)
        times["prefill"] = time.perf_counter() - start
        new_token, accepted = 0, []
        topk = self.choices[1:]
        while new_token < max_new:
            t0 = time.perf_counter()
            candidates, tree_candidates = u.generate_candidates(medusa_logits, logits, topk, buffers["tree_indices"], 0.0)
            t1 = time.perf_counter()
            medusa_logits, logits, outputs = u.tree_decoding(model, tree_candidates, past_key_values,
                                                             buffers["medusa_position_ids"], input_ids,
                                                             buffers["retrieve_indices"])
            t2 = time.perf_counter()
            best, accept_length = u.evaluate_posterior(logits, candidates, 0.0, 0.09, 0.3)
            t3 = time.perf_counter()
            input_ids, logits, medusa_logits, new_token = u.update_inference_inputs(
                input_ids, candidates, best, accept_length, buffers["retrieve_indices"], outputs, logits,
                medusa_logits, new_token, data, length)
            t4 = time.perf_counter()
            accepted.append(int(accept_length))
            done = self.eos in input_ids[0, len(prompt):]
            times["draft"] += t1 - t0
            times["forward"] += t2 - t1
            times["verify"] += t3 - t2
            times["cache"] += t4 - t3
            times["other"] += time.perf_counter() - t4
            if done:
                break
        wall = time.perf_counter() - start
        return {"tokens": trim(input_ids[0, len(prompt):].tolist(), self.eos, max_new), "wall": wall,
                "forwards": 1 + len(accepted), "accepted": accepted, "times": times}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new: int) -> dict:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        out = self.greedy_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                         do_sample=False, eos_token_id=self.eos, pad_token_id=self.eos)
        wall = time.perf_counter() - start
        tokens = trim(out[0, len(prompt):].tolist(), self.eos, max_new)
        return {"tokens": tokens, "wall": wall, "forwards": len(tokens), "accepted": [0] * max(len(tokens) - 1, 0),
                "times": None}


def trim(tokens: list[int], eos: int, max_new: int) -> list[int]:
    """New tokens up to and including the first EOS, at most max_new (the same rule as the engine's)."""
    tokens = tokens[:max_new]
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def main() -> int:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # library prints must not corrupt the reply channel
    sys.stdout = sys.stderr
    engine = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["cmd"] == "quit":
                reply(out, {"ok": True})
                return 0
            if req["cmd"] == "init":
                engine = Medusa(req)
                reply(out, {"ok": True, "versions": versions(), "patches": PATCHES})
            elif req["cmd"] == "generate":
                run = engine.medusa if req["method"] == "medusa" else engine.greedy
                reply(out, {"ok": True, **run(req["prompt"], int(req["max_new_tokens"]))})
            else:
                reply(out, {"ok": False, "error": f"unknown cmd {req['cmd']!r}"})
        except Exception as e:  # noqa: BLE001 - every failure goes back to the bench as one line
            traceback.print_exc(file=sys.stderr)
            first = (str(e).strip().splitlines() or [""])[0]
            reply(out, {"ok": False, "error": f"{type(e).__name__}: {first}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
