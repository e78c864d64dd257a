"""Multi-query (verify) decode kernel timing on one GPU, written as JSON to --out.

For each batch B, context S and query count T (GQA 32/8, D 128, bf16; every row full: the T
queries sit at positions S - T .. S - 1) it times:
- `multi_query_decode` (impl pallas_gpu, its default tuning), without and with logits, and
  each --configs entry (no logits) when given;
- the dense decode kernel at T = 1 (`sfi_jax.kernels.dense_decode`, impl pallas_gpu), with and
  without logits: what one plain decode step costs;
- cuDNN (`jax.nn.dot_product_attention(..., implementation="cudnn")`) with the T queries over
  all S keys of a [B, S, Hkv, D] copy of the cache (no causal mask among the T: the same
  bytes), and at T = 1.
Each call's output feeds the next call's query inside one jit (calls back to back with a real
dependency); median over repeats after a warm-up. Bytes: K and V read once, q read, out
written (plus the f32 logits with logits); the fraction is of --bandwidth (4.3 TB/s, the
H200's measured copy bandwidth). Our output and logits are checked against the jnp reference
on every case.

--mosaic: also the Mosaic GPU twin (multi_query_decode_mgpu, its default tuning), checked
against the reference, then timed without and with logits (mosaic_s, mosaic_logits_s and their
ratios to the Triton kernel's times).

--smoke: tiny shapes on the CPU (the Pallas GPU kernel in interpret mode; no cuDNN).

  python scripts/bench/bench_multi_query_kernel.py --out benchmarks/multi_query_kernel.json
  python scripts/bench/bench_multi_query_kernel.py --sweep --batches 6 --contexts 131072 \
      --out /tmp/mq_sweep.json
  python scripts/bench/bench_multi_query_kernel.py --smoke --out /tmp/mq_smoke.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402  (also puts this checkout's package on the path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sfi_jax.kernels import dense_decode  # noqa: E402
from sfi_jax.kernels import multi_query_decode_gpu as mq_gpu  # noqa: E402
from sfi_jax.kernels import multi_query_decode_mgpu as mq_mgpu  # noqa: E402
from sfi_jax.kernels.multi_query_decode_reference import (  # noqa: E402
    multi_query_decode as reference)

HQ, HKV, D = 32, 8, 128
# block_k:num_warps:num_stages:programs per SM, tried by --sweep
SWEEP = ["128:4:2:8", "128:8:2:8", "128:4:2:16", "64:4:2:8", "64:4:3:8", "64:8:3:16",
         "32:4:3:8"]


class Results:
    """Rows written to --out after each one, so a run cut short keeps what it measured."""

    def __init__(self, path, meta):
        self.path, self.meta, self.rows = path, meta, []

    def add(self, row):
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        with open(self.path, "w") as f:
            json.dump(dict(meta=self.meta, rows=self.rows), f, indent=1)


def chained_time(step, q, args, *, inner, repeats):
    """Median seconds per call of `inner` chained calls q <- step(q, *args) in one jit."""

    @jax.jit
    def run(q, *args):
        for _ in range(inner):
            q = step(q, *args)
        return q

    t0 = time.perf_counter()
    jax.block_until_ready(run(q, *args))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = None
        for _ in range(3):
            y = run(q, *args)
        jax.block_until_ready(y)
        times.append((time.perf_counter() - t0) / (3 * inner))
    return statistics.median(times), compile_s


def rel_err(a, b):
    """Relative L2 error over b's finite entries; inf when the -inf patterns differ."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.array_equal(np.isneginf(a), np.isneginf(b)):
        return float("inf")
    fin = np.isfinite(b)
    return float(np.linalg.norm(a[fin] - b[fin]) / max(np.linalg.norm(b[fin]), 1e-30))


def parse_config(text):
    """block_k:num_warps:num_stages:programs_per_sm, e.g. 128:4:2:8."""
    bk, warps, stages, per_sm = (int(x) for x in text.split(":"))
    return mq_gpu.Config(block_k=bk, num_warps=warps, num_stages=stages,
                         programs=per_sm * mq_gpu._NUM_SMS)


def randn(seed, shape, dtype):
    """Standard normal values made on the host in chunks (no program to compile; bounded
    host memory for the large caches)."""
    rng = np.random.default_rng(seed)
    flat = np.empty(int(np.prod(shape)), jnp.dtype(dtype))
    step = 1 << 26
    for i in range(0, flat.size, step):
        flat[i:i + step] = rng.standard_normal(min(step, flat.size - i), np.float32)
    return jnp.asarray(flat.reshape(shape))


def case(res, b, s, t, *, heads, dtype, interpret, configs, inner, repeats, bandwidth, cudnn,
         baselines, mosaic=False, mosaic_configs=()):
    hq, hkv, d = heads
    k, v = baselines["kv"]
    q = randn(1000 * b + t, (b, t, hq, d), dtype)
    kv_len = jnp.full((b,), s, jnp.int32)
    q_start = kv_len - t
    row = dict(B=b, S=s, T=t, Hq=hq, Hkv=hkv, D=d, dtype=jnp.dtype(dtype).name)

    def ours(cfg=None, logits=False):
        def step(q, k, v):
            res = mq_gpu.multi_query_decode(q, k, v, q_start, kv_len, return_logits=logits,
                                            interpret=interpret, config=cfg)
            return res[0] if logits else res
        return step

    out, lg, lse = mq_gpu.multi_query_decode(q, k, v, q_start, kv_len, return_logits=True,
                                             interpret=interpret)
    r_out, r_lg, r_lse = reference(q, k, v, q_start, kv_len, return_logits=True)
    row["rel_err"] = {"out": rel_err(out, r_out), "logits": rel_err(lg, r_lg),
                      "lse": rel_err(lse, r_lse)}
    del out, lg, lse, r_out, r_lg, r_lse
    kv_bytes = 2 * b * hkv * s * d * jnp.dtype(dtype).itemsize
    io_bytes = 2 * b * t * hq * d * jnp.dtype(dtype).itemsize
    logit_bytes = b * hq * t * s * 4
    row["bytes"] = kv_bytes + io_bytes
    row["bytes_logits"] = row["bytes"] + logit_bytes
    timed = dict(inner=inner, repeats=repeats)
    row["ours_s"], row["compile_s"] = chained_time(ours(), q, (k, v), **timed)
    row["ours_logits_s"], _ = chained_time(ours(logits=True), q, (k, v), **timed)
    row["ours_frac_bw"] = row["bytes"] / row["ours_s"] / bandwidth
    row["ours_logits_frac_bw"] = row["bytes_logits"] / row["ours_logits_s"] / bandwidth
    row["dense_T1_s"] = baselines["dense"]
    row["dense_T1_logits_s"] = baselines["dense_logits"]
    row["ours_over_dense_T1"] = row["ours_s"] / baselines["dense"]
    row["ours_logits_over_dense_T1_logits"] = row["ours_logits_s"] / baselines["dense_logits"]
    if mosaic and mq_mgpu.supported(q, k):
        try:
            out, lg, lse = mq_mgpu.multi_query_decode(q, k, v, q_start, kv_len,
                                                      return_logits=True, interpret=interpret)
            r_out, r_lg, r_lse = reference(q, k, v, q_start, kv_len, return_logits=True)
            row["mosaic_rel_err"] = {"out": rel_err(out, r_out), "logits": rel_err(lg, r_lg),
                                     "lse": rel_err(lse, r_lse)}
            del out, lg, lse, r_lse  # (r_out, r_lg: the configs below are checked against them)

            def mosaic_step(logits, config=None):
                def step(q, k, v):
                    r = mq_mgpu.multi_query_decode(q, k, v, q_start, kv_len,
                                                   return_logits=logits, interpret=interpret,
                                                   config=config)
                    return r[0] if logits else r
                return step

            if max(row["mosaic_rel_err"].values()) <= 2e-2:
                row["mosaic_s"] = chained_time(mosaic_step(False), q, (k, v), **timed)[0]
                row["mosaic_logits_s"] = chained_time(mosaic_step(True), q, (k, v), **timed)[0]
                # two score blocks: a block's logits written beside the last block's store
                two = mq_mgpu.base.fit(dataclasses.replace(mq_mgpu.DEFAULT_LOGITS,
                                                           score_buffers=2), q.shape[-1], True)
                row["mosaic_logits_2buf_s"] = chained_time(mosaic_step(True, two), q, (k, v),
                                                           **timed)[0]
                row["mosaic_over_triton"] = row["mosaic_s"] / row["ours_s"]
                row["mosaic_logits_over_triton"] = row["mosaic_logits_s"] / row["ours_logits_s"]
                row["mosaic_logits_2buf_over_triton"] = (row["mosaic_logits_2buf_s"]
                                                         / row["ours_logits_s"])
                print(f"B={b} S={s} T={t}: mosaic/triton {row['mosaic_over_triton']:.3f}, "
                      f"with logits {row['mosaic_logits_over_triton']:.3f} "
                      f"(two score blocks {row['mosaic_logits_2buf_over_triton']:.3f})",
                      flush=True)
                row["mosaic_configs"] = {}
                row["mosaic_configs_rel_err"] = {}
                for text in mosaic_configs:  # block_k:stages:programs[:flags]
                    cfg = _common.mosaic_attention_config(text)
                    # each config its own split plan: checked at this shape before it is timed
                    out, lg, _ = mq_mgpu.multi_query_decode(
                        q, k, v, q_start, kv_len, return_logits=True, interpret=interpret,
                        config=cfg)
                    errs = {"out": rel_err(out, r_out), "logits": rel_err(lg, r_lg)}
                    row["mosaic_configs_rel_err"][text] = errs
                    del out, lg
                    if max(errs.values()) > 2e-2:
                        print(f"  mosaic {text}: FAIL against the reference {errs}", flush=True)
                        continue
                    times = [chained_time(mosaic_step(lg, cfg), q, (k, v), **timed)[0]
                             / row["ours_logits_s" if lg else "ours_s"] for lg in (False, True)]
                    row["mosaic_configs"][text] = times
                    print(f"  mosaic {text}: /triton {times[0]:.3f}, with logits {times[1]:.3f}",
                          flush=True)
        except Exception as e:  # a compile or run failure: say so, go on
            traceback.print_exc()
            row["mosaic_error"] = repr(e)[:800]
    if configs:
        row["configs"] = {}
        for text in configs:
            try:
                row["configs"][text] = chained_time(ours(parse_config(text)), q, (k, v),
                                                    **timed)[0]
            except Exception as e:  # a config that does not compile: say so, go on
                row["configs"][text] = repr(e)[:300]
    if cudnn:
        kc, vc = baselines["cudnn_kv"]

        def step_cudnn(q, kc, vc):
            return jax.nn.dot_product_attention(q, kc, vc, implementation="cudnn")

        try:
            row["cudnn_s"] = chained_time(step_cudnn, q, (kc, vc), **timed)[0]
            row["cudnn_T1_s"] = baselines["cudnn_T1"]
            row["ours_speedup_vs_cudnn"] = row["cudnn_s"] / row["ours_s"]
        except Exception as e:
            row["cudnn_error"] = repr(e)[:300]
    res.add(row)


def baselines_for(b, s, *, heads, dtype, interpret, inner, repeats, cudnn):
    """The cache of (B, S) and the T = 1 timings every T of it is compared with."""
    hq, hkv, d = heads
    k, v = randn(1, (b, hkv, s, d), dtype), randn(2, (b, hkv, s, d), dtype)
    lens = jnp.full((b,), s, jnp.int32)
    q1 = randn(b, (b, hq, d), dtype)
    impl = "pallas_gpu"
    timed = dict(inner=inner, repeats=repeats)
    out = {"kv": (k, v)}
    out["dense"] = chained_time(lambda q, k, v: dense_decode(q, k, v, lens, impl=impl), q1,
                                (k, v), **timed)[0]
    out["dense_logits"] = chained_time(
        lambda q, k, v: dense_decode(q, k, v, lens, impl=impl, return_logits=True)[0], q1,
        (k, v), **timed)[0]
    if cudnn:
        kc, vc = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        out["cudnn_kv"] = (kc, vc)
        try:
            out["cudnn_T1"] = chained_time(
                lambda q, kc, vc: jax.nn.dot_product_attention(q, kc, vc,
                                                               implementation="cudnn"),
                q1[:, None], (kc, vc), **timed)[0]
        except Exception as e:
            traceback.print_exc()
            out["cudnn_T1"] = repr(e)[:300]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 6])
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--configs", nargs="*", default=[],
                   help="block_k:num_warps:num_stages:programs_per_sm entries to time too")
    p.add_argument("--sweep", action="store_true", help=f"--configs {' '.join(SWEEP)}")
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the fraction")
    p.add_argument("--inner", type=int, default=16, help="chained calls per timed jit call")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mosaic", action="store_true",
                   help="also check and time the Mosaic GPU kernel")
    p.add_argument("--mosaic-configs", nargs="*", default=[],
                   help="with --mosaic: block_k:stages:programs[:r] Mosaic configs to time too "
                        "(r: P·V's operand from registers)")
    a = p.parse_args(argv)
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    heads = (HQ, HKV, D)
    if a.smoke:
        heads = (4, 2, 64) if a.mosaic else (4, 2, 32)
        a.batches, a.contexts, a.queries = [2], [40], [3]
        a.inner, a.repeats = 1, 1
        a.configs, a.sweep = [], False
    elif not on_gpu:
        sys.exit("no GPU here: run with --smoke, or on the GPU machine")
    configs = SWEEP if a.sweep else a.configs
    interpret = not on_gpu
    meta = dict(backend=jax.default_backend(), device=str(jax.devices()[0]),
                jax=jax.__version__, python=platform.python_version(), smoke=a.smoke,
                bandwidth=a.bandwidth, inner=a.inner, repeats=a.repeats,
                cudnn_note="T queries over all S keys (no causal mask among the T)",
                argv=sys.argv[1:] if argv is None else list(argv))
    res = Results(a.out, meta)
    kw = dict(heads=heads, dtype=jnp.bfloat16, interpret=interpret, inner=a.inner,
              repeats=a.repeats)
    for b in a.batches:
        for s in a.contexts:
            base = baselines_for(b, s, cudnn=on_gpu, **kw)
            for t in a.queries:
                try:
                    case(res, b, s, t, configs=configs, bandwidth=a.bandwidth, cudnn=on_gpu,
                         baselines=base, mosaic=a.mosaic, mosaic_configs=a.mosaic_configs,
                         **kw)
                except Exception as e:  # keep going: the file says what failed
                    traceback.print_exc()
                    res.add(dict(B=b, S=s, T=t, error=repr(e)[:500]))
            del base
    tol = lambda r: 2e-2 if r["dtype"] == "bfloat16" else 1e-4
    bad = [r for r in res.rows if "error" in r or "mosaic_error" in r
           or max(r["rel_err"].values()) > tol(r)
           or max(r.get("mosaic_rel_err", {"": 0.0}).values()) > tol(r)]
    if bad:
        sys.exit(f"{len(bad)} case(s) failed or were off the reference: see {a.out}")


if __name__ == "__main__":
    main()
