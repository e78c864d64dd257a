"""The persistent attention-output + MLP kernel (`kernels.mlp_block_gpu`) on the device, at a
model's real shapes: checked, then timed against the three fused-epilogue matmul launches it
replaces, per grid/tile variant.

Check (one layer, each variant): against the fused launches (their split sums and epilogues)
and a float32 jnp reference; the same call repeated must give the same bits (a missed ordering
between a phase's stores and the next phase's loads would show as an occasional difference)
and leave the counters at zero. A variant whose programs cannot all be resident at once would
poll until SPIN_LIMIT: its one call then takes far longer than it should, and it is reported
as such and not timed.

Timing: `--layers` layers of distinct random weights (so no layer's weights sit in L2) run as
one jitted chain, the time per layer against the weights' bytes at the measured copy
bandwidth.

    python scripts/diag/diag_mlp_block.py --models qwen3-4b,qwen3-0.6b --out /tmp/block.json
    python scripts/diag/diag_mlp_block.py --smoke --out /tmp/block.json   # CPU, interpret
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_VARIANTS = "2:4:3:2,1:4:3:2,1:8:3:2,2:4:3:0,2:4:3:4,2:4:4:2,3:4:3:2,4:4:2:2"


def parse_variant(text):
    """`mlp_block_gpu.parse_config`, as a command-line error."""
    from sfi_jax.kernels.mlp_block_gpu import parse_config

    try:
        return parse_config(text)
    except ValueError as e:
        raise SystemExit(str(e))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen3-4b,qwen3-0.6b")
    p.add_argument("--rows", default="1")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help="comma-separated programs_per_sm:warps:stages:prefetch_tiles"
                        "[:block_n[:max_splits]]")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="a tiny shape, small tiles (CPU)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import _common  # noqa: F401  (imports jax; puts this checkout's package on the path)
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from sfi_jax.kernels import mlp_block_gpu as mb
    from sfi_jax.kernels import skinny_matmul as dispatch
    from sfi_jax.models.config import PRESETS

    eps = 1e-6
    variants = {v: parse_variant(v) for v in args.variants.split(",")}
    if args.smoke:
        shapes = {"tiny": (96, 80, 200)}
        variants = {"smoke": mb.BlockConfig(block_n=32, block_k=32, programs=16)}
        args.layers, args.repeats, iters, reps = 2, 2, 1, 1
        bw = None
    else:
        shapes = {m: (PRESETS[m].num_q_heads * PRESETS[m].head_dim, PRESETS[m].hidden_size,
                      PRESETS[m].intermediate_size) for m in args.models.split(",")}
        iters, reps = 5, 5
        bw = _common.copy_bandwidth()
    bf = jnp.bfloat16 if not args.smoke else jnp.float32
    results = []
    for name, (ko, h, inter) in shapes.items():
        for rows in (int(r) for r in args.rows.split(",")):
            key = jax.random.key(rows * 131 + h)

            def layer(i):
                ks = jax.random.split(jax.random.fold_in(key, i), 6)
                return dict(
                    wo=(jax.random.normal(ks[0], (ko, h)) / np.sqrt(ko)).astype(bf),
                    norm=(1 + 0.2 * jax.random.normal(ks[1], (h,))).astype(bf),
                    wg=(jax.random.normal(ks[2], (h, inter)) / np.sqrt(h)).astype(bf),
                    wu=(jax.random.normal(ks[3], (h, inter)) / np.sqrt(h)).astype(bf),
                    wd=(jax.random.normal(ks[4], (inter, h)) / np.sqrt(inter)).astype(bf),
                    attn=jax.random.normal(ks[5], (rows, ko)).astype(bf))

            layers = [layer(i) for i in range(args.layers)]
            x0 = jax.random.normal(jax.random.fold_in(key, 999), (rows, h)).astype(bf)
            w_bytes = sum(int(v.nbytes) for k_, v in layers[0].items() if k_ != "attn")

            def fused_layer(w, x, sync):
                f = dispatch.skinny_matmul_fused
                x, sync = f(w["attn"], (w["wo"],), None, sync, epilogue="residual", residual=x)
                hh, sync = f(x, (w["wg"], w["wu"]), w["norm"], sync, epilogue="silu", eps=eps)
                return f(hh, (w["wd"],), None, sync, epilogue="residual", residual=x)

            def block_layer(cfg):
                def run(w, x, sync):
                    return dispatch.mlp_block(w["attn"], w["wo"], x, w["norm"], w["wg"],
                                              w["wu"], w["wd"], sync, eps=eps, config=cfg)
                return run

            def reference(w, x):  # float32 jnp, the activations rounded as the kernels do
                f32 = jnp.float32
                h1 = (x.astype(f32) + (w["attn"].astype(f32) @ w["wo"].astype(f32))
                      .astype(bf).astype(f32)).astype(bf).astype(f32)
                n = (h1 * jax.lax.rsqrt(jnp.mean(h1 * h1, -1, keepdims=True) + eps)
                     * w["norm"].astype(f32))
                g, u = n @ w["wg"].astype(f32), n @ w["wu"].astype(f32)
                hh = (jax.nn.silu(g) * u).astype(bf).astype(f32)
                return (h1 + (hh @ w["wd"].astype(f32)).astype(bf).astype(f32)).astype(bf)

            def chain(step):
                @jax.jit
                def run(ws, x, sync):
                    for w in ws:
                        x, sync = step(w, x, sync)
                    return x, sync
                return run

            def rel(a, b):
                a, b = a.astype(jnp.float32), b.astype(jnp.float32)
                return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

            one = layers[0]
            want = jax.jit(reference)(one, x0)
            fused_one, _ = jax.jit(fused_layer)(one, x0, dispatch.new_sync())
            base = dict(model=name, rows=rows, k_o=ko, hidden=h, intermediate=inter,
                        weight_bytes_per_layer=w_bytes)
            row = dict(base, variant="fused (3 launches)", rel_err_ref=rel(fused_one, want))
            if not args.smoke:
                t = _common.timeit(chain(fused_layer), layers, x0, dispatch.new_sync(),
                                   iters=iters, repeats=reps) / args.layers
                row.update(us_per_layer=round(t, 2),
                           of_copy_bandwidth=round(w_bytes / (t * 1e-6) / bw, 3))
            results.append(row)
            print(json.dumps(row), flush=True)
            for vname, cfg in variants.items():
                fn = jax.jit(block_layer(cfg))
                sync = dispatch.new_sync()
                first, sync = fn(one, x0, sync)  # compiles
                first.block_until_ready()
                t0 = time.perf_counter()
                again, sync = fn(one, x0, sync)
                again.block_until_ready()
                call_s = time.perf_counter() - t0
                differ = int(bool(jnp.any(again != first)))
                stuck = call_s > (5.0 if args.smoke else 0.05)
                for _ in range(0 if stuck else args.repeats):
                    again, sync = fn(one, x0, sync)
                    differ += int(bool(jnp.any(again != first)))
                zero = bool(jnp.all(sync == 0))
                row = dict(base, variant=vname, config=dataclasses.asdict(cfg),
                           rel_err_ref=rel(first, want), rel_err_fused=rel(first, fused_one),
                           repeats=args.repeats, runs_that_differ=differ, counters_zero=zero,
                           one_call_ms=round(call_s * 1e3, 3), stuck=stuck)
                row["ok"] = (not stuck and differ == 0 and zero and row["rel_err_ref"] < 2e-2
                             and row["rel_err_fused"] < 2e-2)
                if row["ok"] and not args.smoke:
                    t = _common.timeit(chain(block_layer(cfg)), layers, x0, dispatch.new_sync(),
                                       iters=iters, repeats=reps) / args.layers
                    row.update(us_per_layer=round(t, 2),
                               of_copy_bandwidth=round(w_bytes / (t * 1e-6) / bw, 3))
                results.append(row)
                print(json.dumps(row), flush=True)
    out = dict(device=str(jax.devices()[0]), jax=jax.__version__, copy_bandwidth=bw,
               command=" ".join(["python", "scripts/diag/diag_mlp_block.py", *(argv or sys.argv[1:])]),
               results=results, all_ok=all(r.get("ok", True) for r in results))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'model':12} {'rows':>4} {'variant':22} {'us/layer':>9} {'of bw':>6} {'err':>8} ok")
    for r in results:
        print(f"{r['model']:12} {r['rows']:4d} {r['variant']:22} {r.get('us_per_layer', '-'):>9} "
              f"{r.get('of_copy_bandwidth', '-'):>6} {r['rel_err_ref']:8.1e} {r.get('ok', '')}")
    print("mlp block:", "all ok" if out["all_ok"] else "FAILED", flush=True)
    return 0 if out["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
