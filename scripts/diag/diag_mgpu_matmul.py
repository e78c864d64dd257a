"""The decode step's weight matmuls three ways: the Mosaic GPU kernel
(`skinny_matmul_mgpu.skinny_matmul_partials` + the sum over splits), the Triton kernel
(`skinny_matmul_gpu.skinny_matmul_partials` + sum, its default config) and XLA (x @ w,
float32 out), at the qwen3-4b and qwen3-0.6b projection shapes and a few row counts.

The products run over `copies` distinct weight copies (about --stream-mb of weights, at most
--max-copies copies), so the weights stream from memory, not from L2, as a decode step's
successive layers do; one jitted call runs --per-call of them (one dispatch for several
products). Microseconds per product over --reps rounds of all copies after a warm-up. Prints
one JSON line per (model, proj, rows): us per arm, the fraction of --bandwidth-tbs that the
weight bytes need in that time, and the Mosaic result's max relative error against XLA's;
--out writes all rows.
--configs adds one Mosaic arm per config (`mosaic:N:K:S:P`: block_n, block_k, stages, programs),
a sweep in one call. An arm that raises is recorded (its error) and the rest go on; exits 1,
after all rows, if the Mosaic arm failed or its error passed 1e-2.
--epilogues: each arm also applies the decode step's epilogue (a residual add for one weight,
silu(gate) * up for two; the products rounded to bf16 first, the output bf16), and two arms
apply it in their kernel: "mosaic_fused" (`skinny_matmul_mgpu.skinny_matmul_fused`) and
"triton_fused" (`skinny_matmul_gpu.skinny_matmul_fused`, up to 4 rows); the others run it as
XLA's fusion after theirs. GPU only."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {  # proj: (K, N, weights)
    "qwen3-4b": {"qkv": (2560, 6144, 1), "o": (4096, 2560, 1), "gate_up": (2560, 9728, 2),
                 "down": (9728, 2560, 1)},
    "qwen3-0.6b": {"qkv": (1024, 4096, 1), "o": (2048, 1024, 1), "gate_up": (1024, 3072, 2),
                   "down": (3072, 1024, 1)},
}
ARMS = ("mosaic", "triton", "xla")
TOL = 1e-2


def _epilogue(ys, r):
    """The decode step's epilogue on products ys (float32): rounded to bf16, then r + y (one
    weight) or silu(gate) * up (two)."""
    ys = [y.astype(jnp.bfloat16) for y in ys]
    return (r + ys[0],) if len(ys) == 1 else (jax.nn.silu(ys[0]) * ys[1],)


def _many_fn(arm, mosaic_config, epilogues=False):
    """arm's products over a group of weight copies: many(x, r, copies) -> per copy a tuple of
    float32 [M, N], one per weight; with epilogues the epilogue's bf16 output [M, N] (r: the
    residual). The Triton fused kernel's counters pass from product to product, as in the
    decode step."""
    if arm in ("mosaic_fused", "triton_fused"):
        from sfi_jax.kernels import skinny_matmul_gpu, skinny_matmul_mgpu

        def many(x, r, copies):
            outs, sync = [], skinny_matmul_gpu.new_sync() if arm == "triton_fused" else None
            for ws in copies:
                ep = "residual" if len(ws) == 1 else "silu"
                if arm == "mosaic_fused":
                    out = skinny_matmul_mgpu.skinny_matmul_fused(x, ws, epilogue=ep, residual=r,
                                                                 config=mosaic_config)
                else:
                    out, sync = skinny_matmul_gpu.skinny_matmul_fused(
                        x, ws, None, sync, epilogue=ep, residual=r if ep == "residual" else None)
                outs.append((out,))
            return outs
        return jax.jit(many)
    g = _products_fn(arm, mosaic_config)
    f = (lambda x, ws, r: _epilogue(g(x, ws), r)) if epilogues else (lambda x, ws, r: g(x, ws))
    return jax.jit(lambda x, r, copies: [f(x, ws, r) for ws in copies])


def _products_fn(arm, mosaic_config):
    """arm(x, ws) -> a tuple of float32 [M, N], one per weight."""
    if arm.startswith("mosaic:"):
        mosaic_config = parse_config(arm.split(":", 1)[1])
        arm = "mosaic"
    if arm == "mosaic":
        from sfi_jax.kernels import skinny_matmul_mgpu

        def f(x, ws):
            parts = skinny_matmul_mgpu.skinny_matmul_partials(x, ws, config=mosaic_config)
            return tuple(p.sum(axis=0) for p in parts)
    elif arm == "triton":
        from sfi_jax.kernels import skinny_matmul_gpu

        def f(x, ws):
            return tuple(p.sum(axis=0) for p in skinny_matmul_gpu.skinny_matmul_partials(x, ws))
    else:
        def f(x, ws):
            return tuple(jnp.matmul(x, w, preferred_element_type=jnp.float32) for w in ws)
    return f


def parse_config(text):
    """A `skinny_matmul_mgpu.Config` from "block_n:block_k:stages:programs"."""
    from sfi_jax.kernels import skinny_matmul_mgpu

    try:
        bn, bk, st, pr = map(int, text.split(":"))
    except ValueError:
        raise SystemExit(f"--configs: expected block_n:block_k:stages:programs, got {text!r}")
    return skinny_matmul_mgpu.Config(block_n=bn, block_k=bk, stages=st, programs=pr)


def _timed(fn, x, r, groups, reps):
    """(microseconds per product, the first copy's products): fn runs one group of copies per
    call (one compile: the groups are alike); reps rounds over all groups after a warm-up."""
    first = [np.asarray(o.astype(jnp.float32))
             for o in jax.block_until_ready(fn(x, r, groups[0]))[0]]
    for g in groups[1:]:
        out = fn(x, r, g)
    t = time.perf_counter()
    for _ in range(reps):
        for g in groups:
            out = fn(x, r, g)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / (reps * sum(map(len, groups))) * 1e6, first


def run_shape(model, proj, rows, args, mosaic_config, arms=ARMS):
    k, n, n_w = SHAPES[model][proj]
    w_bytes = n_w * k * n * 2
    n_copies = max(2, min(args.max_copies, math.ceil(args.stream_mb * 2**20 / w_bytes)))
    per_call = min(args.per_call, n_copies)
    n_copies = -(-n_copies // per_call) * per_call
    key = jax.random.key(sum(map(ord, model + proj)))
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (rows, k), jnp.float32).astype(jnp.bfloat16)
    r = jax.random.normal(jax.random.fold_in(kx, 1), (rows, n), jnp.float32).astype(jnp.bfloat16)
    copies = [tuple((jax.random.normal(jax.random.fold_in(kw, c * 2 + i), (k, n), jnp.float32)
                     / np.sqrt(k)).astype(jnp.bfloat16) for i in range(n_w))
              for c in range(n_copies)]
    groups = [copies[i:i + per_call] for i in range(0, n_copies, per_call)]
    floor_us = w_bytes / (args.bandwidth_tbs * 1e12) * 1e6
    row = dict(model=model, proj=proj, rows=rows, k=k, n=n, weights=n_w, weight_bytes=w_bytes,
               copies=n_copies, per_call=per_call)
    results = {}
    for arm in arms:
        many = _many_fn(arm, mosaic_config, args.epilogues)
        try:
            us, results[arm] = _timed(many, x, r, groups, args.reps)
            row[f"{arm}_us"] = round(us, 2)
            row[f"{arm}_of_bandwidth"] = round(floor_us / us, 3)
        except Exception as e:  # noqa: BLE001 (an arm that fails is a result of the A/B)
            row[f"{arm}_us"] = None
            row[f"{arm}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    for arm in (a for a in results if a != "xla"):
        if "xla" in results:
            row[f"{arm}_max_rel_err"] = float(max(
                np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
                for a, b in zip(results[arm], results["xla"])))
    del copies, groups
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(SHAPES), help="comma-separated")
    p.add_argument("--projs", default="qkv,o,gate_up,down", help="comma-separated")
    p.add_argument("--rows", default="1,6,16", help="comma-separated row counts (<= 64)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--stream-mb", type=float, default=192.0,
                   help="weight bytes per timed call (copies of the weight)")
    p.add_argument("--max-copies", type=int, default=32)
    p.add_argument("--per-call", type=int, default=8,
                   help="products (weight copies) per jitted call, unrolled")
    p.add_argument("--bandwidth-tbs", type=float, default=4.3, help="copy bandwidth (H200)")
    p.add_argument("--block-n", type=int, default=None, help="Mosaic Config.block_n")
    p.add_argument("--block-k", type=int, default=None, help="Mosaic Config.block_k")
    p.add_argument("--stages", type=int, default=None, help="Mosaic Config.stages")
    p.add_argument("--programs", type=int, default=None, help="Mosaic Config.programs")
    p.add_argument("--configs", default="",
                   help="comma-separated extra Mosaic arms, block_n:block_k:stages:programs each")
    p.add_argument("--epilogues", action="store_true",
                   help="every arm with the decode step's epilogue; adds the fused arms")
    p.add_argument("--out", default=None, help="JSON file for all rows")
    args = p.parse_args(argv)
    extra = [f"mosaic:{c}" for c in args.configs.split(",") if c]
    if args.epilogues:
        extra = ["mosaic_fused", "triton_fused", *extra]
    for c in extra:
        if c.startswith("mosaic:"):
            parse_config(c.split(":", 1)[1])  # a bad config fails before any timing

    from sfi_jax.kernels import skinny_matmul_mgpu

    over = {f: v for f, v in (("block_n", args.block_n), ("block_k", args.block_k),
                              ("stages", args.stages), ("programs", args.programs))
            if v is not None}
    mosaic_config = skinny_matmul_mgpu.Config(**over) if over else None
    rows_out, bad = [], []
    t0 = time.perf_counter()
    for model in args.models.split(","):
        for proj in args.projs.split(","):
            for rows in map(int, args.rows.split(",")):
                row = run_shape(model, proj, rows, args, mosaic_config, (*ARMS, *extra))
                rows_out.append(row)
                print(json.dumps(row), flush=True)
                for arm in ("mosaic", *extra):
                    if arm == "triton_fused" and rows > 4:
                        continue  # (its kernel takes up to 4 rows: the raise is recorded)
                    err = row.get(f"{arm}_max_rel_err")
                    if row[f"{arm}_us"] is None or err is None or not err <= TOL:
                        bad.append((model, proj, rows, arm))
    print(f"{len(rows_out)} rows in {time.perf_counter() - t0:.0f} s", flush=True)
    arms = ("triton", "xla", "mosaic", *extra)
    print("| model | proj | rows | " + " | ".join(arms) + " |  (us)")
    for r in rows_out:
        print(f"| {r['model']} | {r['proj']} | {r['rows']} | "
              + " | ".join(f"{r.get(a + '_us') or '-'}" for a in arms) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__,
                       "epilogues": args.epilogues,
                       "mosaic_config": str(mosaic_config or skinny_matmul_mgpu.DEFAULT),
                       "bandwidth_tbs": args.bandwidth_tbs, "rows": rows_out}, f, indent=1)
    if bad:
        print(f"mosaic arm failed or off by more than {TOL}: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
