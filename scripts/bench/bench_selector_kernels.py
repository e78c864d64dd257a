"""Time the selector's score stages on the GPU, jnp against the Triton kernels (and with
--mosaic their Mosaic GPU twin, a few chunkings), for one
refreshed row of every layer (N = layers sets of KV heads x R rows x S positions):
steps 1-4 (and, for the kernels, their first one and two passes, and a few tuning knobs),
steps 5-6 (the kernel with a few blocks and warp counts), and the whole scores. Prints one
line per part and writes selector_kernels.json.

    python scripts/bench/bench_selector_kernels.py --out /tmp/selk            # on the GPU
    python scripts/bench/bench_selector_kernels.py --mosaic --out /tmp/selk   # and the twin
    python scripts/bench/bench_selector_kernels.py --smoke --out /tmp/selk    # tiny, interpret mode
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import timeit  # noqa: E402

from sfi_jax.config import SFIConfig  # noqa: E402
from sfi_jax.kernels import selector_gpu as sg  # noqa: E402

selmod = importlib.import_module("sfi_jax.selector.select")
ADJUST_BLOCK = 512  # sg.adjust_scores' default block


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--out", default="/tmp/selk")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--mosaic", action="store_true",
                   help="also the Mosaic GPU twin of steps 1-4 (selector_mgpu.base_scores)")
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.heads, a.seq = 2, 2, 4096
    interpret = jax.default_backend() != "gpu"
    sfi = SFIConfig()
    N, H, R, S = a.layers, a.heads, a.rows, a.seq
    key = jax.random.key(0)
    logits = jax.random.normal(key, (N, 1, H, R, S), jnp.float32) * 3
    norms = jax.random.uniform(key, (N, 1, H, S), jnp.float32) + 0.5
    lo = jnp.full((N,), sfi.n_sink, jnp.int32)
    hi = jnp.full((N,), S - sfi.n_recent, jnp.int32)
    it = dict(iters=2 if a.smoke else 10, repeats=2 if a.smoke else 5)
    params = selmod.score_params(sfi)
    plan = sg._Plan(params, R, S)
    idx = jnp.zeros((2,), jnp.int32)
    kw = sg._call_kwargs(plan, N, H, 4, interpret)
    k1 = jax.jit(lambda lg: sg._row_lse(plan, kw, idx, lo, hi, lg))
    k12 = jax.jit(lambda lg, kn: sg._fusion(plan, kw, idx, lo, hi, lg, kn, k1(lg)))
    base_k = jax.jit(lambda lg, kn: sg.base_scores(lg, kn, lo, hi, 0, 0, params=params,
                                                   interpret=interpret))
    base_x = jax.jit(lambda lg, kn: selmod.base_scores(lg[:, 0], kn[:, 0], lo, hi, sfi))
    pad = sg.adjust_pad(params)
    z = jnp.pad(base_x(logits, norms), ((0, 0), (0, 0), (pad, pad)), constant_values=-jnp.inf)
    adj_k = jax.jit(lambda z: sg.adjust_scores(z, lo, hi, params=params, interpret=interpret))
    adj_x = jax.jit(lambda z: selmod.adjust_scores(z, lo, hi, sfi))
    full = {impl: jax.jit(lambda lg, kn, i=impl: selmod.selector_scores_at(
        lg, 0, kn, 0, lo, hi, sfi, impl=i)) for impl in ("xla", "pallas_gpu")}
    res = {"device": jax.devices()[0].device_kind, "shape": [N, H, R, S],
           "chunks": plan.n_chunks, "blk": plan.blk}
    parts = [("kernel pass 1 (row stats)", k1, (logits,)),
             ("kernel passes 1-2", k12, (logits, norms)),
             ("kernel steps 1-4", base_k, (logits, norms)),
             ("jnp steps 1-4", base_x, (logits, norms)),
             ("kernel steps 5-6", adj_k, (z,)),
             ("jnp steps 5-6", adj_x, (z[:, :, pad:pad + S],)),
             ("kernel steps 1-6", full["pallas_gpu"], (logits, norms)),
             ("jnp steps 1-6", full["xla"], (logits, norms))]
    sweep_14 = ((8, 4096, 8), (4, 8192, 8), (4, 4096, 4), (4, 4096, 16))
    sweep_56 = ((128, 4), (512, 4), (512, 8), (1024, 8))
    if interpret:  # warps change nothing there: no second compile of the defaults' program
        sweep_14 = [c for c in sweep_14 if c[1:] != (sg._TILE, sg._CHUNK_BLOCKS)]
        sweep_56 = [c for c in sweep_56 if c[0] != ADJUST_BLOCK]
    for warps, tile, chunk in sweep_14:
        fn = jax.jit(lambda lg, kn, w=warps, t=tile, c=chunk: sg.base_scores(
            lg, kn, lo, hi, 0, 0, params=params, interpret=interpret, num_warps=w, tile=t,
            chunk_blocks=c))
        parts.append((f"kernel steps 1-4 w{warps} t{tile} c{chunk}", fn, (logits, norms)))
    for block, warps in sweep_56:
        fn = jax.jit(lambda z, b=block, w=warps: sg.adjust_scores(
            z, lo, hi, params=params, interpret=interpret, block=b, num_warps=w))
        parts.append((f"kernel steps 5-6 b{block} w{warps}", fn, (z,)))
    if a.mosaic:
        from sfi_jax.kernels import selector_mgpu as sm

        configs = [None] if interpret else [None, sm.ScoresConfig(copies=4),
                                            sm.ScoresConfig(stages=3),
                                            sm.ScoresConfig(lines=16, copies=4)]
        for cfg in configs:
            fn = jax.jit(lambda lg, kn, c=cfg: sm.base_scores(
                lg, kn, lo, hi, 0, 0, params=params, interpret=interpret, config=c))
            parts.append((f"mosaic steps 1-4 {cfg or 'default'}", fn, (logits, norms)))
        full["mosaic_gpu"] = jax.jit(lambda lg, kn: selmod.selector_scores_at(
            lg, 0, kn, 0, lo, hi, sfi, impl="mosaic_gpu"))
        parts.append(("mosaic steps 1-6", full["mosaic_gpu"], (logits, norms)))
    for name, fn, args in parts:
        res[name] = timeit(fn, *args, **it)
        print(f"{name:<28} {res[name]:10.1f} us", flush=True)
    zk, zx = full["pallas_gpu"](logits, norms), full["xla"](logits, norms)
    res["max_abs_diff"] = float(jnp.max(jnp.where(jnp.isfinite(zx), jnp.abs(zk - zx), 0.0)))
    print("max |kernel - jnp| on finite scores:", res["max_abs_diff"])
    if a.mosaic:
        zm = full["mosaic_gpu"](logits, norms)
        res["mosaic_max_abs_diff"] = float(jnp.max(jnp.where(jnp.isfinite(zx), jnp.abs(zm - zx),
                                                             0.0)))
        print("max |mosaic - jnp| on finite scores:", res["mosaic_max_abs_diff"])
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "selector_kernels.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
