"""A/B of engine variants end to end: one `bench_e2e.py` process per variant (XLA flags and
engine switches are read at start-up), the same model and context for all; writes one JSON
with every variant's record and prints a table.

    python scripts/ab_e2e.py --variants base,radix,cmdbuf --contexts 131072 --out /tmp/ab
    python scripts/ab_e2e.py --smoke --variants base,radix --out /tmp/ab   # CPU check

Variants (name: environment, bench_e2e arguments):
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CMDBUF = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
          "WHILE,CONDITIONAL")
VARIANTS = {
    "base": ({}, []),
    "previous_selector": ({}, ["--topk-impl", "threshold", "--scores-impl", "xla"]),
    "radix": ({}, ["--topk-impl", "radix"]),
    "pallas_scores": ({}, ["--scores-impl", "pallas_gpu"]),
    "radix_pallas": ({}, ["--topk-impl", "radix", "--scores-impl", "pallas_gpu"]),
    "exhaustive_tiling": ({"XLA_FLAGS": "--xla_gpu_exhaustive_tiling_search=true"}, []),
    "cmdbuf": ({"XLA_FLAGS": CMDBUF}, []),
    "refresh_cond": ({"SFI_JAX_REFRESH_COND": "1"}, []),
    "repack_xla": ({"SFI_JAX_REPACK": "xla"}, []),
    "heads_xla": ({"SFI_JAX_HEADS": "xla"}, []),
    "cmdbuf_refresh_cond": ({"XLA_FLAGS": CMDBUF, "SFI_JAX_REFRESH_COND": "1"}, []),
}
__doc__ += "".join(f"    {k}: {v[0] or '-'} {' '.join(v[1]) or '-'}\n" for k, v in VARIANTS.items())


def run_variant(name, args):
    env, extra = VARIANTS[name]
    out = os.path.join(args.out, name)
    cmd = [sys.executable, os.path.join(HERE, "bench_e2e.py"), "--models", args.model,
           "--contexts", args.contexts, "--out", out, "--no-check", *extra]
    if args.smoke:
        cmd.append("--smoke")
    if args.profile:
        cmd.append("--profile")
    t = time.perf_counter()
    res = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=args.timeout)
    rec = dict(env=env, args=extra, rc=res.returncode, wall_s=time.perf_counter() - t)
    path = os.path.join(out, "e2e.json")
    if res.returncode == 0 and os.path.exists(path):
        with open(path) as f:
            rec["results"] = json.load(f)["results"]
    else:
        rec["stderr_tail"] = res.stderr[-3000:]
    return rec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="base,radix")
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--contexts", default="131072")
    p.add_argument("--out", default="/tmp/ab")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--smoke", action="store_true", help="bench_e2e --smoke (tiny, CPU)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per variant")
    args = p.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    os.makedirs(args.out, exist_ok=True)
    report = {}
    for name in names:
        report[name] = run_variant(name, args)
        print(name, "rc", report[name]["rc"], f"{report[name]['wall_s']:.0f} s", flush=True)
        with open(os.path.join(args.out, "ab.json"), "w") as f:
            json.dump(report, f, indent=1)
    print("| variant | ctx | SFI tok/s | dense tok/s | speedup | fast step ms | selector ms/row |")
    print("|---|---|---|---|---|---|---|")
    for name, rec in report.items():
        for r in rec.get("results", []):
            print(f"| {name} | {r['context']} | {r['sfi_tokens_per_s']:.0f} | "
                  f"{r['dense_tokens_per_s']:.0f} | {r['speedup']:.2f} | "
                  f"{r['fast_step_s'] * 1e3:.3f} | {r['selector_row_s'] * 1e3:.3f} |")
        if rec["rc"] != 0:
            print(f"| {name} | failed rc {rec['rc']} | | | | | |")


if __name__ == "__main__":
    main()
