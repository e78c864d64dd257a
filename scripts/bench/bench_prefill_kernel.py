"""Prefill attention kernel timing against cuDNN, written as JSON to --out.

On a GPU: GQA 32/8, D 128, bf16, batch 1. For each chunk T and context N (offset N - T) it
times `prefill_attention` (impl pallas_gpu, each --configs entry; the dispatcher's cudnn and
mosaic_gpu paths; the cuDNN path with its prefix in unmasked runs of chunks, `prefix="pieces"`;
the Mosaic kernel with two warpgroups, WARP_SPECIALISED) over a head-major cache
holding N keys, and cuDNN (`jax.nn.dot_product_attention(..., implementation="cudnn")`) on
(a) a causal no-offset call of T queries over T keys, (b) a causal no-offset call of length N
(the whole prompt at once) and (c) for offsets, the prefix (non-causal) and the chunk
(causal) as two calls merged by their log-sum-exp, which is what the same chunk costs through
cuDNN; and (d) the prefix call alone, at its exact length without a mask (as in (c)) and as the
dispatcher's cuDNN path makes it (a power-of-two slab masked to the prefix's length), to split
that path's cost from cuDNN's own. Our output is checked against (c) (or the reference on small shapes). TFLOP/s count
causal FLOPs: 4 * B * Hq * D * (query-key pairs that attend).

--smoke: tiny shapes on the CPU through the xla path, checked against the dense reference.

  python scripts/bench/bench_prefill_kernel.py --out benchmarks/prefill_kernel.json
  python scripts/bench/bench_prefill_kernel.py --smoke --out /tmp/prefill_kernel.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402  (also puts this checkout's package on the path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sfi_jax.kernels import (prefill_attention_cudnn, prefill_attention_gpu,  # noqa: E402
                             prefill_attention_mgpu)
from sfi_jax.kernels.prefill_attention import prefill_attention  # noqa: E402
from sfi_jax.kernels.prefill_attention_reference import prefill_attention as reference  # noqa: E402


def causal_pairs(t, offset):
    """Query-key pairs of a chunk of t queries at `offset` over the filled prefix + itself."""
    return t * offset + t * (t + 1) // 2


def tflops(b, hq, d, pairs, seconds):
    return 4.0 * b * hq * d * pairs / seconds / 1e12


class Results:
    """Rows written to --out after each one, so a run cut short keeps what it measured."""

    def __init__(self, path, meta):
        self.path, self.meta, self.rows = path, meta, []

    def add(self, row):
        self.rows.append(row)
        print(row, flush=True)
        with open(self.path, "w") as f:
            json.dump(dict(meta=self.meta, rows=self.rows), f, indent=1)


def time_fn(fn, args, reps, repeats=3):
    """Median seconds per call of `reps` back-to-back calls (after a warm-up)."""
    return _common.timeit(fn, *args, iters=reps, repeats=repeats) / 1e6


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def parse_config(text):
    """rows:block_k:num_warps:num_stages, e.g. 128:64:8:3."""
    rows, bk, warps, stages = (int(x) for x in text.split(":"))
    return prefill_attention_gpu.Config(rows=rows, block_k=bk, num_warps=warps,
                                        num_stages=stages)


def make_inputs(key, b, t, n, hq, hkv, d, dtype):
    """Random q [B, T, Hq, D] and head-major k, v [B, Hkv, N, D]; key: a jax key, or an int
    for numpy's generator (no random-number programs to compile on a CPU)."""
    if isinstance(key, int):
        rng = np.random.default_rng(key)
        return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
                     for shape in ((b, t, hq, d), (b, hkv, n, d), (b, hkv, n, d)))
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, t, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, hkv, n, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, hkv, n, d), jnp.float32).astype(dtype)
    return q, k, v


def cudnn_causal(q, k, v):
    """cuDNN causal attention, q [B, T, Hq, D], k, v [B, S, Hkv, D] (no offset)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def cudnn_offset(q, k_seq, v_seq, offset):
    """A chunk at `offset` through cuDNN: prefix (non-causal) and chunk (causal, top-left
    aligned) as two calls, merged by their log-sum-exp. k_seq, v_seq [B, N, Hkv, D]."""
    chunk = slice(offset, offset + q.shape[1])
    o2, l2 = jax.nn.dot_product_attention(q, k_seq[:, chunk], v_seq[:, chunk], is_causal=True,
                                          implementation="cudnn", return_residual=True)
    if offset == 0:
        return o2
    o1, l1 = jax.nn.dot_product_attention(q, k_seq[:, :offset], v_seq[:, :offset],
                                          implementation="cudnn", return_residual=True)
    if l1.shape != q.shape[:3]:  # [B, Hq, T] -> [B, T, Hq]
        l1, l2 = l1.transpose(0, 2, 1), l2.transpose(0, 2, 1)
    m = jnp.maximum(l1, l2)
    w1, w2 = jnp.exp(l1 - m)[..., None], jnp.exp(l2 - m)[..., None]
    out = (o1.astype(jnp.float32) * w1 + o2.astype(jnp.float32) * w2) / (w1 + w2)
    return out.astype(q.dtype)


# the warp-specialised Mosaic kernel's configs timed beside the default twin (D 128)
WARP_SPECIALISED = (prefill_attention_mgpu.Config(block_k=128, stages=2, warpgroups=2),
                    prefill_attention_mgpu.Config(block_k=64, stages=4, warpgroups=2))


def run_smoke(args, res):
    hq, hkv, d, b = 4, 2, 16, 2
    for t, n in ((16, 48), (24, 70)):
        q, k, v = make_inputs(t * 100 + n, b, t, n, hq, hkv, d, jnp.float32)
        offset = n - t
        qs = jnp.full((b,), offset, jnp.int32)
        kl = jnp.full((b,), n, jnp.int32)
        fn = jax.jit(lambda q, k, v, qs, kl: prefill_attention(q, k, v, qs, kl, impl="xla",
                                                               block_q=8, block_k=16))
        sec = time_fn(fn, (q, k, v, qs, kl), reps=2, repeats=2)
        err = rel_err(fn(q, k, v, qs, kl), reference(q, k, v, qs, kl))
        res.add(dict(kind="ours", impl="xla", t=t, offset=offset, context=n,
                     config=None, ms=sec * 1e3,
                     tflops=tflops(b, hq, d, causal_pairs(t, offset), sec),
                     max_rel_err=err, checked_against="reference"))


def check_small(configs):
    """Our kernel (each config) and cuDNN's split-and-merge against the dense reference on a
    small offset chunk, so the large rows' cross-check against cuDNN means something."""
    hq, hkv, d, b, t, n = 32, 8, 128, 2, 384, 1280
    q, k, v = make_inputs(jax.random.key(0), b, t, n, hq, hkv, d, jnp.bfloat16)
    qs, kl = jnp.full((b,), n - t, jnp.int32), jnp.full((b,), n, jnp.int32)
    want = reference(q, k, v, qs, kl).astype(jnp.float32)
    out = {}
    try:
        got = cudnn_offset(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), n - t)
        out["cudnn_split_merge"] = rel_err(got.astype(jnp.float32), want)
    except Exception as e:  # noqa: BLE001
        out["cudnn_split_merge"] = f"{type(e).__name__}: {e}"[:300]
    for cfg in configs:
        got = prefill_attention_gpu.prefill_attention(q, k, v, qs, kl, config=cfg)
        out[str(cfg)] = rel_err(got.astype(jnp.float32), want)
    for starts in ((n - t, n - t), (0, n - t), (5, 300)):  # the dispatcher's cuDNN path, ragged
        qs2 = jnp.asarray(starts, jnp.int32)
        kl2 = jnp.minimum(qs2 + t, n)
        try:
            got = prefill_attention(q, k, v, qs2, kl2, impl="cudnn")
            ref = reference(q, k, v, qs2, kl2)
            valid = (qs2[:, None] + jnp.arange(t)[None]) < kl2[:, None]
            out[f"cudnn_dispatch_starts_{starts}"] = rel_err(
                jnp.where(valid[..., None, None], got.astype(jnp.float32), 0.0),
                jnp.where(valid[..., None, None], ref.astype(jnp.float32), 0.0))
        except Exception as e:  # noqa: BLE001
            out[f"cudnn_dispatch_starts_{starts}"] = f"{type(e).__name__}: {e}"[:300]
    return out


def parse_heads(text):
    """"HQ:HKV:D" -> (hq, hkv, d); Hq a multiple of Hkv."""
    try:
        hq, hkv, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads {text!r}: expected HQ:HKV:D, e.g. 32:8:128")
    if min(hq, hkv, d) < 1 or hq % hkv:
        raise argparse.ArgumentTypeError(f"--heads {text!r}: positive, Hq a multiple of Hkv")
    return hq, hkv, d


def run_gpu(args, res):
    (hq, hkv, d), b, dtype = args.heads, 1, jnp.bfloat16
    configs = [parse_config(c) for c in args.configs]
    res.meta["rel_err_vs_reference_b2_t384_offset896"] = check_small(configs)
    print(res.meta, flush=True)
    cudnn_no_offset = {}

    def cudnn_full(n):
        """Seconds of cuDNN causal no-offset attention of length n (None if it failed)."""
        if n not in cudnn_no_offset:
            q, k, v = make_inputs(jax.random.key(n), b, n, n, hq, hkv, d, dtype)
            ks, vs = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            row = dict(kind="cudnn_causal_no_offset", t=n, offset=0, context=n)
            try:
                sec = time_fn(jax.jit(cudnn_causal), (q, ks, vs), reps=args.reps)
                row.update(ms=sec * 1e3, tflops=tflops(b, hq, d, causal_pairs(n, 0), sec))
            except Exception as e:  # noqa: BLE001 - record why cuDNN could not run
                sec, row["error"] = None, f"{type(e).__name__}: {e}"[:300]
            cudnn_no_offset[n] = sec
            res.add(row)
        return cudnn_no_offset[n]

    for t in args.chunks:
        for n in args.contexts:
            if n < t:
                continue
            offset = n - t
            pairs = causal_pairs(t, offset)
            q, k, v = make_inputs(jax.random.key(t + n), b, t, n, hq, hkv, d, dtype)
            qs, kl = jnp.full((b,), offset, jnp.int32), jnp.full((b,), n, jnp.int32)
            ks, vs = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # cuDNN's layout
            cfn = jax.jit(cudnn_offset, static_argnames="offset")
            want = None
            try:
                want = cfn(q, ks, vs, offset=offset)
                sec = time_fn(lambda *a: cfn(*a, offset=offset), (q, ks, vs), reps=args.reps)
                res.add(dict(kind="cudnn_split_merge", t=t, offset=offset, context=n,
                             ms=sec * 1e3, tflops=tflops(b, hq, d, pairs, sec)))
            except Exception as e:  # noqa: BLE001 - record why cuDNN could not run
                res.add(dict(kind="cudnn_split_merge", t=t, offset=offset, context=n,
                             error=f"{type(e).__name__}: {e}"[:300]))
            cudnn_full(t)
            if offset:  # the prefix call alone: exact length, no mask (as split-merge) against
                # the dispatcher's form, a power-of-two slab masked to the prefix's length
                slab = next(x for x in prefill_attention_cudnn.prefix_lengths(t, n) if x >= offset)
                for kind, keys, lens in (("cudnn_prefix_exact", offset, None),
                                         ("cudnn_prefix_padded_slab", slab, offset)):
                    fn = jax.jit(lambda q, ks, vs, m=keys, ln=lens: jax.nn.dot_product_attention(
                        q, ks[:, :m], vs[:, :m], implementation="cudnn",
                        key_value_seq_lengths=None if ln is None else jnp.full((b,), ln, jnp.int32)))
                    row = dict(kind=kind, t=t, offset=offset, context=n, keys=keys)
                    try:
                        sec = time_fn(fn, (q, ks, vs), reps=args.reps)
                        row.update(ms=sec * 1e3, tflops=tflops(b, hq, d, t * offset, sec))
                    except Exception as e:  # noqa: BLE001 - record why cuDNN could not run
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    res.add(row)

            def timed(row, fn, fn_args, want=want, pairs=pairs):
                """fn's time and its error against cuDNN's split-merge output into row."""
                out = fn(*fn_args)
                sec = time_fn(fn, fn_args, reps=args.reps)
                row.update(ms=sec * 1e3, tflops=tflops(b, hq, d, pairs, sec),
                           max_rel_err=None if want is None else rel_err(
                               out.astype(jnp.float32), want.astype(jnp.float32)),
                           checked_against=None if want is None else "cudnn_split_merge")

            # the dispatcher's cuDNN and Mosaic GPU paths, and the cuDNN path with its prefix
            # in unmasked runs of chunks: head-major cache of 2n positions, traced offset
            arms = (("ours_cudnn", "cudnn", functools.partial(prefill_attention, impl="cudnn")),
                    ("ours_mosaic", "mosaic_gpu",
                     functools.partial(prefill_attention, impl="mosaic_gpu")),
                    ("ours_cudnn_pieces", "cudnn", functools.partial(
                        prefill_attention_cudnn.prefill_attention, prefix="pieces")))
            for kind, impl, attend in arms:
                row = dict(kind=kind, impl=impl, t=t, offset=offset, context=n)
                try:
                    pad = ((0, 0), (0, 0), (0, n), (0, 0))
                    kb, vb = jnp.pad(k, pad), jnp.pad(v, pad)
                    timed(row, jax.jit(attend), (q, kb, vb, qs, kl))
                    del kb, vb
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                res.add(row)
            # the Mosaic GPU kernel with two compute warpgroups and a TMA producer
            for ws in WARP_SPECIALISED:
                row = dict(kind="ours_mosaic_ws", impl="mosaic_gpu", t=t, offset=offset,
                           context=n, config=ws.__dict__)
                fn = jax.jit(lambda q, k, v, qs, kl, c=ws: prefill_attention_mgpu.prefill_attention(
                    q, k, v, qs, kl, config=c))
                try:
                    timed(row, fn, (q, k, v, qs, kl))
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                res.add(row)
            for cfg in configs:
                fn = jax.jit(lambda q, k, v, qs, kl, c=cfg: prefill_attention_gpu.prefill_attention(
                    q, k, v, qs, kl, config=c))
                row = dict(kind="ours", impl="pallas_gpu", t=t, offset=offset, context=n,
                           config=cfg.__dict__)
                try:
                    timed(row, fn, (q, k, v, qs, kl))
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                res.add(row)
            del q, k, v, ks, vs, want
    for n in args.full:  # the whole prompt as one chunk: the same shapes as cuDNN no-offset
        sec_c = cudnn_full(n)
        q, k, v = make_inputs(jax.random.key(n), b, n, n, hq, hkv, d, dtype)
        qs, kl = jnp.zeros((b,), jnp.int32), jnp.full((b,), n, jnp.int32)
        for cfg in configs:
            fn = jax.jit(lambda q, k, v, qs, kl, c=cfg: prefill_attention_gpu.prefill_attention(
                q, k, v, qs, kl, config=c))
            row = dict(kind="ours_no_offset", impl="pallas_gpu", t=n, offset=0, context=n,
                       config=cfg.__dict__)
            try:
                sec = time_fn(fn, (q, k, v, qs, kl), reps=args.reps)
                row.update(ms=sec * 1e3, tflops=tflops(b, hq, d, causal_pairs(n, 0), sec),
                           vs_cudnn_time=None if sec_c is None else sec / sec_c)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            res.add(row)
        del q, k, v


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (xla impl)")
    p.add_argument("--chunks", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--contexts", type=int, nargs="+",
                   default=[8192, 16384, 32768, 65536, 131072])
    p.add_argument("--full", type=int, nargs="*", default=[8192, 32768, 131072],
                   help="no-offset lengths timed as one chunk beside cuDNN")
    p.add_argument("--configs", nargs="+",
                   default=["128:64:8:3", "128:128:8:2", "128:64:4:3", "64:64:4:3", "128:128:8:3"],
                   help="GPU kernel configs rows:block_k:num_warps:num_stages")
    p.add_argument("--reps", type=int, default=5, help="back-to-back calls per timing")
    p.add_argument("--heads", type=parse_heads, default=(32, 8, 128),
                   help="HQ:HKV:D of the GPU shapes (default 32:8:128, Qwen3-4B's; "
                        "16:8:128 is Qwen3-0.6B's)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if not args.smoke and jax.default_backend() not in ("gpu", "cuda"):
        sys.exit(f"no GPU (backend {jax.default_backend()!r}); use --smoke on a CPU")
    meta = dict(command=" ".join(["python", "scripts/bench/bench_prefill_kernel.py", *argv]),
                device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                python=platform.python_version(), smoke=args.smoke,
                shapes="smoke: Hq 4 Hkv 2 D 16 f32 B 2" if args.smoke else
                "Hq {} Hkv {} D {} bf16 B 1".format(*args.heads),
                flops="4 * B * Hq * D * causal pairs")
    res = Results(args.out, meta)
    (run_smoke if args.smoke else run_gpu)(args, res)
    print(f"wrote {args.out} ({len(res.rows)} rows)")


if __name__ == "__main__":
    main()
