"""Tune the GPU kernels for the calls the decode engine makes (not bench_kernels' batch 16):
the refresh slots' dense read with logits written in place (2-4 slots, none, some or all
occupied; program counts per row), and the sparse read that stores the new token (batch 4-16). One layer of a stacked
cache per call, calls chained inside one jit; prints a table and writes sweep_engine.json.

    python scripts/bench/sweep_engine_kernels.py --out /tmp/sweep          # on the GPU
    python scripts/bench/sweep_engine_kernels.py --smoke --out /tmp/sweep  # tiny, interpret mode
    python scripts/bench/sweep_engine_kernels.py --kinds sparse --heads 16/8 --contexts 8192  # 0.6b
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from sfi_jax.kernels import attention_gpu as gpu  # noqa: E402

HQ, HKV, D, C_SIZE, WINDOW = 32, 8, 128, 2052, 257
DENSE_GRID = list(itertools.product((64, 128), (4, 8), (2, 3), (0.5, 1, 2, 4)))
SPARSE_GRID = list(itertools.product((32, 64), (4, 8), (2, 3), (1, 2, 4, 8, 16)))


def timed(fn, x, consts, repeats=7, inner=8):
    """Median seconds per call of fn(x, consts) -> x', chained `inner` times in one jit (the
    arrays are arguments: closed-over device arrays would be baked into the program). The
    state x is donated and fed back, so buffers the kernels update in place (caches, logits)
    are not copied at each call of the chain."""
    @functools.partial(jax.jit, donate_argnums=0)
    def chain(x, consts):
        for _ in range(inner):
            x = fn(x, consts)
        return x

    x = jax.block_until_ready(chain(x, consts))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = jax.block_until_ready(chain(x, consts))
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def dense_case(ctx, batch, n_slots, occupied, cfg, interpret, layers=2):
    key = jax.random.key(0)
    s = ctx + 64
    k = jax.random.normal(key, (layers, batch, HKV, s, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(1), k.shape, jnp.bfloat16)
    q = jax.random.normal(jax.random.key(2), (batch, HQ, D), jnp.bfloat16)
    buf = jnp.zeros((layers, n_slots, HQ, s), jnp.float32)
    slots = jnp.where(jnp.arange(n_slots) < occupied, jnp.arange(n_slots), batch + jnp.arange(n_slots))
    lengths = jnp.full((batch,), ctx, jnp.int32)
    row_len = jnp.where(slots < batch, ctx, 0)

    def fn(state, consts):
        (q, buf), (k, v, row_len, slots) = state, consts
        out, buf, _ = gpu.dense_decode(q, k, v, row_len, layer=1, rows=jnp.minimum(slots, batch - 1),
                                       logits_into=buf, out_into=q, out_rows=slots, gather_q=True,
                                       interpret=interpret, config=cfg)
        return out, buf

    t = timed(fn, (q, buf), (k, v, row_len, slots))
    nbytes = max(occupied * HKV * ctx * D * 2 * 2 + occupied * HQ * ctx * 4, 1)
    del k, v, lengths
    return t, nbytes


def plain_case(ctx, batch, cfg, interpret, layers=2):
    """The dense arm's read: every row at full length, no logits (config DENSE)."""
    s = ctx + 64
    k = jax.random.normal(jax.random.key(0), (layers, batch, HKV, s, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(1), k.shape, jnp.bfloat16)
    q = jax.random.normal(jax.random.key(2), (batch, HQ, D), jnp.bfloat16)
    lengths = jnp.full((batch,), ctx, jnp.int32)

    def fn(q, consts):
        k, v, lengths = consts
        return gpu.dense_decode(q, k, v, lengths, layer=1, interpret=interpret, config=cfg)

    t = timed(fn, q, (k, v, lengths))
    return t, batch * HKV * ctx * D * 2 * 2


def sparse_case(ctx, batch, cfg, interpret, layers=2):
    s = ctx + 64
    k = jax.random.normal(jax.random.key(0), (layers, batch, HKV, s, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(1), k.shape, jnp.bfloat16)
    ck = jax.random.normal(jax.random.key(3), (layers, batch, HKV, C_SIZE, D), jnp.bfloat16)
    cv = jax.random.normal(jax.random.key(4), ck.shape, jnp.bfloat16)
    norms = jnp.zeros((layers, batch, HKV, s), jnp.float32)
    c_len = jnp.full((layers, batch, HKV), C_SIZE, jnp.int32)
    lengths = jnp.full((batch,), ctx, jnp.int32)
    rs = lengths - (WINDOW - 1)
    q = jax.random.normal(jax.random.key(2), (batch, HQ, D), jnp.bfloat16)
    kn = jax.random.normal(jax.random.key(5), (batch, HKV, D), jnp.bfloat16)

    def fn(state, consts):
        (q, k, v, norms), (ck, cv, c_len, rs, lengths, kn) = state, consts
        out, k, v, norms = gpu.sparse_decode(q, ck, cv, c_len, k, v, rs, lengths, layer=1,
                                             window=WINDOW, new_kv=(kn, kn), key_norms=norms,
                                             interpret=interpret, config=cfg)
        return out, k, v, norms

    t = timed(fn, (q, k, v, norms), (ck, cv, c_len, rs, lengths, kn))
    nbytes = batch * HKV * (C_SIZE + WINDOW) * D * 2 * 2
    return t, nbytes


def main(argv=None):
    global HQ, HKV
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/sweep")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--contexts", default="131072,32768")
    p.add_argument("--budget-s", type=float, default=400.0, help="stop sweeping after this")
    p.add_argument("--kinds", default="dense,sparse",
                   help="calls to sweep, in this order: dense (the refresh slots' read), "
                        "sparse, plain (the dense arm's read, at --plain-batches)")
    p.add_argument("--heads", default=f"{HQ}/{HKV}",
                   help="query heads / KV heads (qwen3-4b 32/8; qwen3-0.6b 16/8)")
    p.add_argument("--batches", default="6,16", help="batches of the sparse cases")
    p.add_argument("--plain-batches", default="1", help="batches of the plain cases")
    a = p.parse_args(argv)
    try:
        HQ, HKV = (int(h) for h in a.heads.split("/"))
    except ValueError:
        raise SystemExit(f"--heads {a.heads!r}: expected QUERY_HEADS/KV_HEADS, e.g. 16/8")
    if HQ % HKV:
        raise SystemExit(f"--heads {a.heads!r}: query heads must be a multiple of KV heads")
    t_start = time.time()
    ctxs = [int(c) for c in a.contexts.split(",")]
    dense_grid, sparse_grid = DENSE_GRID, SPARSE_GRID
    cases_d = [(ctxs[0], 6, 2, 1), (ctxs[0], 6, 2, 0), (ctxs[0], 6, 2, 2)] + \
        [(c, 16, 4, 2) for c in ctxs[1:]]
    cases_s = [(ctxs[-1], int(b)) for b in a.batches.split(",")]
    cases_p = [(c, int(b)) for b in a.plain_batches.split(",") for c in ctxs]
    if a.smoke:
        ctxs, dense_grid, sparse_grid = [256], DENSE_GRID[:2], SPARSE_GRID[:2]
        cases_d, cases_s, cases_p = [(256, 3, 2, 1)], [(256, 3)], [(256, 1)]
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "heads": [HQ, HKV],
           "default_dense": list(gpu.REFRESH.__dict__.values()),
           "default_sparse": list(gpu.SPARSE.__dict__.values()),
           "default_plain": list(gpu.DENSE.__dict__.values()), "dense": [], "sparse": [],
           "plain": []}
    os.makedirs(a.out, exist_ok=True)

    def save():
        with open(os.path.join(a.out, "sweep_engine.json"), "w") as f:
            json.dump(res, f, indent=1)

    def run(kind, grid, case_fn, cases, defaults):
        per_row = kind == "dense"  # the refresh call aims its programs at one row
        for case in cases:
            for bk, nw, ns, waves in [defaults] + grid:
                if time.time() - t_start > a.budget_s:
                    return
                cfg = gpu.Config(block_k=bk, num_warps=nw, num_stages=ns,
                                 programs=int(waves * gpu._NUM_SMS), per_row=per_row)
                try:
                    t, nbytes = case_fn(*case, cfg, a.smoke)
                    row = {"case": case, "config": [bk, nw, ns, waves], "us": t * 1e6,
                           "tb_s": nbytes / t / 1e12}
                except Exception as e:  # a config Triton cannot compile is reported, not fatal
                    row = {"case": case, "config": [bk, nw, ns, waves], "error": repr(e)[:200]}
                res[kind].append(row)
                print(kind, json.dumps(row), flush=True)
            save()

    d, s, pd = gpu.REFRESH, gpu.SPARSE, gpu.DENSE
    sweeps = {"dense": (dense_grid, dense_case, cases_d,
                        (d.block_k, d.num_warps, d.num_stages, d.programs / gpu._NUM_SMS)),
              "sparse": (sparse_grid, sparse_case, cases_s,
                         (s.block_k, s.num_warps, s.num_stages, s.programs // gpu._NUM_SMS)),
              "plain": (dense_grid, plain_case, cases_p,
                        (pd.block_k, pd.num_warps, pd.num_stages, pd.programs / gpu._NUM_SMS))}
    for kind in a.kinds.split(","):
        run(kind, *sweeps[kind])
    save()
    print("\nkind   case                 default us   best us  best config (bk, warps, stages, waves)")
    for kind in ("dense", "sparse", "plain"):
        for case in sorted({tuple(r["case"]) for r in res[kind]}):
            rows = [r for r in res[kind] if tuple(r["case"]) == case and "us" in r]
            if not rows:
                continue
            best = min(rows, key=lambda r: r["us"])
            print(f"{kind:<6} {str(case):<20} {rows[0]['us']:10.1f} {best['us']:9.1f}  "
                  f"{best['config']}  ({best['tb_s']:.2f} TB/s)")


if __name__ == "__main__":
    main()
