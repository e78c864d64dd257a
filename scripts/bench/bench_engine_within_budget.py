"""The Engine on the quickstart's request (SmolLM2, its chat-templated example prompt, which
fits the SFI budget): decode tokens/s of mode "sfi" (dense chunks while every request fits),
of the SFI program alone (`SlotDecoder.dense_within_budget = False`, what the Engine ran
before) and of mode "dense". The configurations take turns, so the machine's load hits all.

    python scripts/bench/bench_engine_within_budget.py --runs 3 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import sfi_jax
from sfi_jax.cli import DEFAULT_PROMPT

CONFIGS = {"sfi": ("sfi", True), "sfi_program": ("sfi", False), "dense": ("dense", True)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    tok = sfi_jax.load_tokenizer(args.model)
    model = sfi_jax.load_model(args.model, dtype="float32")
    prompt = tok.apply_chat_template([{"role": "user", "content": DEFAULT_PROMPT}],
                                     tokenize=False, add_generation_prompt=True)
    engines = {}
    for name, (mode, switch) in CONFIGS.items():
        engines[name] = sfi_jax.Engine(model, tokenizer=tok, mode=mode).start()
        engines[name].decoder.dense_within_budget = switch
    request = sfi_jax.Request(prompt=prompt, max_tokens=args.max_tokens)
    for e in engines.values():  # compile
        e.generate(request)
    rates = {name: [] for name in CONFIGS}
    tokens = None
    for _ in range(args.runs):
        for name, e in engines.items():
            r = e.generate(request)
            tokens = r.token_ids if tokens is None else tokens
            assert r.token_ids == tokens, name  # the same greedy answer in every configuration
            rates[name].append(round((r.completion_tokens - 1) / (r.stats["e2e_s"] - r.ttft_s),
                                     2))
    metrics = {name: {k: e.metrics()[k] for k in ("slow_steps", "fast_steps", "dense_steps",
                                                   "sfi_chunks", "dense_chunks")}
               for name, e in engines.items()}
    for e in engines.values():
        e.stop()
    med = {name: statistics.median(v) for name, v in rates.items()}
    print(json.dumps({"model": args.model, "prompt_tokens": len(tok(prompt)["input_ids"]),
                      "new_tokens": len(tokens), "cpus": os.cpu_count(),
                      "decode_tokens_per_s": rates, "median": med,
                      "vs_dense": {n: round(m / med["dense"], 3) for n, m in med.items()},
                      "metrics": metrics, "load_avg_1m": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
