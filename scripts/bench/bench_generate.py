"""Decode tokens/s through `sfi_jax.generate`, the path users call, for several modes on the same
prompts: what a user of the API sees, beside bench_e2e.py's loop-level numbers.

Each case (mode, and for exact mode its accept rate) runs `generate` twice on the same random
prompts (token ids; random weights of a preset): the first call compiles, the second is timed;
its stats give decode tokens/s (compiles excluded), the decode path taken, the dense steps and,
in exact mode, tokens per verify. Random weights accept almost no draft, so exact mode without
--accept-rate is its worst case (acceptance near 0); with a rate, each draft token is accepted
with that probability instead of being verified (a benchmark switch, tokens then not dense's).

    python scripts/bench/bench_generate.py --model qwen3-4b --context 32768 --batch 1 \\
        --cases dense,sfi,exact,exact@0.95 --out /tmp/generate        # H200
    python scripts/bench/bench_generate.py --model qwen3-0.6b --context 512 --new-tokens 32 \\
        --cases dense,sfi --out /tmp/generate                          # CPU check

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402,F401  (puts this checkout's package on the path)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import sfi_jax  # noqa: E402


def parse_case(text: str) -> tuple[str, float | None]:
    """'dense' / 'sfi' / 'exact' / 'exact@RATE' -> (mode, accept rate or None)."""
    mode, _, rate = text.partition("@")
    if mode not in ("dense", "sfi", "exact") or (rate and mode != "exact"):
        raise ValueError(f"a case is dense, sfi, exact or exact@RATE, got {text!r}")
    return mode, float(rate) if rate else None


def run_case(model, prompts, mode, rate, args):
    kw = dict(max_new_tokens=args.new_tokens, mode=mode, stop_at_eos=False,
              chunk_steps=args.chunk_steps)
    if rate is not None:
        kw["accept_rate"] = rate
    sfi_jax.generate(model, prompts, **kw)  # compiles
    t = time.perf_counter()
    res = sfi_jax.generate(model, prompts, **kw)
    wall = time.perf_counter() - t
    s = res.stats
    rec = {"case": mode if rate is None else f"{mode}@{rate:g}", "mode": mode,
           "accept_rate": rate, "decode_tokens_per_s": s["decode_tokens_per_s"],
           "decode_s": s["decode_s"], "prefill_s": s["prefill_s"], "wall_s": wall,
           "compile_s": s.get("compile_s"), "decode_path": str(s.get("decode_path", mode)),
           "dense_steps": s.get("dense_steps")}
    if mode == "exact":
        rec.update({k: s.get(k) for k in ("drafted", "accepted", "verify_steps")})
        n = sum(len(r) for r in res.tokens) - len(prompts)  # tokens after the first
        rec["tokens_per_verify"] = n / max(1, sum(s.get("verify_steps") or [0]))
    return rec


def markdown(report) -> str:
    c = report["config"]
    dense = next((r["decode_tokens_per_s"] for r in report["rows"] if r["case"] == "dense"),
                 None)
    lines = [f"# Decode through generate: {c['model']}, context {c['context']}, batch "
             f"{c['batch']}", "", f"Command: `{report['command']}`  ",
             f"Machine: {report['machine']}  ",
             f"{c['new_tokens']} new tokens per row after a prompt of {c['prompt_tokens']} random "
             "token ids; the second of two identical calls timed (compiles excluded).", "",
             "| case | decode path | decode tok/s | vs dense | tokens per verify | prefill (s) |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        ratio = "-" if not dense else f"{r['decode_tokens_per_s'] / dense:.2f}x"
        tpv = r.get("tokens_per_verify")
        lines.append(f"| {r['case']} | {r['decode_path']} | {r['decode_tokens_per_s']:.1f} | "
                     f"{ratio} | {'-' if tpv is None else f'{tpv:.2f}'} | "
                     f"{r['prefill_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="a preset (random weights)")
    p.add_argument("--context", type=int, default=512,
                   help="prompt + new tokens per row")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chunk-steps", type=int, default=32)
    p.add_argument("--cases", default="dense,sfi,exact",
                   help="comma-separated: dense, sfi, exact or exact@RATE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    try:
        cases = [parse_case(c) for c in args.cases.split(",") if c]
    except ValueError as e:
        p.error(str(e))
    n_prompt = args.context - args.new_tokens
    if n_prompt < 1:
        p.error(f"--context ({args.context}) must exceed --new-tokens ({args.new_tokens})")
    model = sfi_jax.load_model(args.model, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(100, model.config.vocab_size - 100, n_prompt).tolist()
               for _ in range(args.batch)]
    rows = []
    for mode, rate in cases:
        rows.append(run_case(model, prompts, mode, rate, args))
        print(json.dumps(rows[-1]), flush=True)
    report = {"command": "python scripts/bench/bench_generate.py " + " ".join(
                  argv if argv is not None else sys.argv[1:]),
              "machine": f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax "
                         f"{jax.__version__}, Python {platform.python_version()}",
              "config": {"model": args.model, "context": args.context, "batch": args.batch,
                         "new_tokens": args.new_tokens, "prompt_tokens": n_prompt,
                         "chunk_steps": args.chunk_steps},
              "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
