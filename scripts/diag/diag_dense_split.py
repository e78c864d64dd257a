"""The dense decode kernels (Triton and its Mosaic GPU twin) with their splits sized by each
row's length (the default) against splits sized by the cache's length: rows shorter than their
cache (an Engine's slots).
Prints one line per (lengths, arm): microseconds per call and the share of the copy bandwidth
the row's K/V bytes need. GPU only."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from sfi_jax.kernels import attention_gpu, attention_mgpu


def timed(fn, *args, reps=50):
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=7)
    p.add_argument("--cache", type=int, default=40960)
    p.add_argument("--lengths", default="34816,40960,8192")
    p.add_argument("--bandwidth-tbs", type=float, default=4.3, help="copy bandwidth (H200)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    b, hq, hkv, d, s = args.batch, 32, 8, 128, args.cache
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, b, hkv, s, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, b, hkv, s, d)), jnp.bfloat16)
    rows = []
    for n in map(int, args.lengths.split(",")):
        lengths = jnp.full((b,), n, jnp.int32)
        outs = {}
        for impl, arm, by_length in ((i, a, b) for i in ("triton", "mosaic")
                                     for a, b in (("by_length", True), ("by_cache", False))):
            mod = attention_gpu if impl == "triton" else attention_mgpu
            cfg = dataclasses.replace(mod.DENSE, by_length=by_length)
            if impl == "mosaic":
                cfg = attention_mgpu.fit(cfg, d)  # within the shared memory
            fn = jax.jit(lambda q, k, v, ln, cfg=cfg, mod=mod: mod.dense_decode(
                q, k, v, ln, jnp.int32(0), config=cfg))
            arm = f"{impl}:{arm}"
            outs[arm] = np.asarray(fn(q, k, v, lengths).astype(jnp.float32))
            t = timed(fn, q, k, v, lengths)
            floor = 2 * b * hkv * n * d * 2 / (args.bandwidth_tbs * 1e12)
            rows.append(dict(length=n, cache=s, batch=b, arm=arm, us=t * 1e6,
                             of_bandwidth=floor / t))
            print(json.dumps(rows[-1]), flush=True)
        for impl in ("triton", "mosaic"):
            err = np.abs(outs[f"{impl}:by_length"] - outs[f"{impl}:by_cache"]).max()
            print(f"length {n} {impl}: max |by_length - by_cache| = {err:.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
