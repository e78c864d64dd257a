"""Prefill attention: a chunk of queries at an offset over a cache that already holds them.

`prefill_attention` checks shapes and picks an implementation: "cudnn" (cuDNN's fused
attention, two calls merged by their log-sum-exp; GPU, half precision), "pallas_gpu"
(Triton-lowered flash kernel), "mosaic_gpu" (its Mosaic GPU twin for Hopper; half precision,
GQA groups dividing 64), "pallas_tpu" (Mosaic TPU flash kernel), "xla" (blockwise jnp below)
or "auto" (the current platform's fastest: on a Hopper GPU "mosaic_gpu", on other GPUs
"cudnn", each where it applies, then "cudnn", then "pallas_gpu"; "pallas_tpu" on TPU; "xla"
on CPU). A Pallas kernel asked for off
its platform runs in interpret mode, so every implementation can be tested on a CPU.

All of them walk key blocks only up to the causal edge of a query block and the filled
prefix (kv_len), keep an online softmax in float32 and never hold a [T, S] score matrix.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from sfi_jax.kernels.common import (dot_precision, gpu_fallback, interpret_for, platform,
                                    platform_prefill)

IMPLS = ("auto", "xla", "cudnn", "pallas_gpu", "mosaic_gpu", "pallas_tpu")
XLA_BLOCK_Q = 512
XLA_BLOCK_K = 512
_M_INIT = -1e30  # finite: exp(m_old - m_new) is never NaN while a row has seen no key


def resolve_impl(impl, q=None, k=None) -> str:
    """The implementation `impl` stands for on the current platform (for q, k when given:
    "auto" on a GPU takes the Mosaic GPU kernel, then cuDNN, only for inputs they support)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
    if impl == "auto":
        impl = platform_prefill()
        if impl == "mosaic_gpu" and q is not None:
            from sfi_jax.kernels import prefill_attention_mgpu

            if not prefill_attention_mgpu.supported(q, k):
                impl = "cudnn"
        if impl == "cudnn" and q is not None:
            from sfi_jax.kernels import prefill_attention_cudnn

            if not prefill_attention_cudnn.supported(q, k):
                impl = gpu_fallback()
    return impl


def _check_block(name, value, impl):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}; expected a positive int or None")
    if impl == "pallas_gpu" and value & (value - 1):
        raise ValueError(f"{name}={value}; the pallas_gpu kernel needs a power of two")
    if impl == "mosaic_gpu":
        if name == "block_q":
            raise ValueError(f"block_q={value}; the mosaic_gpu kernel's query block is fixed "
                             "(64 // G positions: 64 wgmma rows of G heads)")
        if value % 64:
            raise ValueError(f"{name}={value}; the mosaic_gpu kernel needs a multiple of 64")
    if impl == "pallas_tpu":
        step = 128 if name == "block_k" else 8
        if value % step:
            raise ValueError(f"{name}={value}; the pallas_tpu kernel needs a multiple of {step}")


def _check(q, k, v, q_start, kv_len, layer, row):
    if q.ndim != 4:
        raise ValueError(f"q has shape {q.shape}; expected [B, T, Hq, D]")
    want = 5 if layer is not None else 4
    for name, x in (("k", k), ("v", v)):
        if x.ndim != want:
            what = "[L, B, Hkv, S, D] (stacked, with layer=)" if want == 5 else "[B, Hkv, S, D]"
            raise ValueError(f"{name} has shape {x.shape}; expected {what}")
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} differ")
    b, t, hq, d = q.shape
    _, hkv, s_len, dk = k.shape[-4:]
    if row is None and k.shape[-4] != b:
        raise ValueError(f"q has batch {b} but the cache {k.shape} has batch {k.shape[-4]}")
    if row is not None and k.shape[-4] < b:
        raise ValueError(f"q has batch {b} but the cache {k.shape} has only {k.shape[-4]} rows")
    if dk != d:
        raise ValueError(f"head dim of q ({d}) and k ({dk}) differ")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if t < 1 or s_len < 1:
        raise ValueError(f"empty chunk or cache: q {q.shape}, k {k.shape}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} has dtype {x.dtype}; expected bfloat16 or float32")
    if k.dtype != v.dtype:
        raise ValueError(f"k ({k.dtype}) and v ({v.dtype}) dtypes differ")
    for name, x in (("q_start", q_start), ("kv_len", kv_len)):
        if x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} is {x.dtype}{list(x.shape)}; expected int32[{b}]")
    for name, x in (("layer", layer), ("row", row)):
        if x is not None and jnp.shape(x) != ():
            raise ValueError(f"{name} has shape {jnp.shape(x)}; expected a scalar")


def prefill_attention(q, k, v, q_start, kv_len, *, impl="auto", block_q=None, block_k=None,
                      layer=None, row=None):
    """Causal attention of a chunk of queries over a cache that already holds the chunk.

    q [B, T, Hq, D]: query t of row b sits at position q_start[b] + t. k, v [B, Hkv, S, D]
    (head-major; with `layer`, stacked [L, B, Hkv, S, D] and layer `layer` is read in place).
    row: query row b reads cache row `row` + b (a traced scalar; the cache may hold more rows
    than q: an Engine prefills one request into its slot's row in place); None: row 0 and the
    cache's batch is q's.
    A query at position p sees keys j <= p with j < kv_len[b]. Queries at positions >= kv_len[b]
    are padding: their output is finite but unspecified. GQA: Hq = G * Hkv, query head
    h * G + g reads KV head h. Returns out [B, T, Hq, D] in q's dtype.
    block_q / block_k: query positions per program and keys per step (None: the
    implementation's default; powers of two for pallas_gpu, multiples of 8 / 128 for
    pallas_tpu; mosaic_gpu: block_k a multiple of 64, block_q None).
    """
    impl = resolve_impl(impl, q, k)
    q_start = jnp.asarray(q_start)
    kv_len = jnp.asarray(kv_len)
    _check(q, k, v, q_start, kv_len, layer, row)
    _check_block("block_q", block_q, impl)
    _check_block("block_k", block_k, impl)
    q_start, kv_len = q_start.astype(jnp.int32), kv_len.astype(jnp.int32)
    if layer is not None:
        layer = jnp.asarray(layer, jnp.int32)
    row = jnp.zeros((), jnp.int32) if row is None else jnp.asarray(row, jnp.int32)
    if impl == "xla":
        return prefill_attention_xla(q, k, v, q_start, kv_len, layer, row,
                                     block_q=block_q or XLA_BLOCK_Q,
                                     block_k=block_k or XLA_BLOCK_K)
    if impl == "cudnn":
        from sfi_jax.kernels import prefill_attention_cudnn

        if platform() != "gpu" or not prefill_attention_cudnn.supported(q, k):
            raise ValueError(f"impl='cudnn' needs a GPU and bfloat16/float16 inputs with head dim "
                             f"<= 128 (got {platform()}, {q.dtype}, D={q.shape[-1]})")
        return prefill_attention_cudnn.prefill_attention(q, k, v, q_start, kv_len, layer, row)
    if impl == "mosaic_gpu":
        from sfi_jax.kernels import prefill_attention_mgpu

        if not prefill_attention_mgpu.supported(q, k):
            raise ValueError(
                f"impl='mosaic_gpu' takes bfloat16/float16 caches, head dim 64/128/256, S a "
                f"multiple of 8 and a GQA group G dividing 64; got {k.dtype}, D={q.shape[-1]}, "
                f"S={k.shape[-2]}, G={q.shape[-2] // k.shape[-3]}")
        return prefill_attention_mgpu.prefill_attention(
            q, k, v, q_start, kv_len, layer, row, interpret=interpret_for(impl),
            config=prefill_attention_mgpu.config_for(q.shape[-1], block_k))
    if impl == "pallas_gpu":
        from sfi_jax.kernels import prefill_attention_gpu as mod

    else:
        from sfi_jax.kernels import prefill_attention_tpu as mod
    return mod.prefill_attention(q, k, v, q_start, kv_len, layer, row, block_q=block_q,
                                 block_k=block_k, interpret=interpret_for(impl))


def _stack(x, layer):
    """A 5-D [L, B, Hkv, S, D] view and the layer to read (free when not stacked)."""
    if layer is None:
        return x[None], jnp.zeros((), jnp.int32)
    return x, layer


@functools.partial(jax.jit, static_argnames=("block_q", "block_k"))
def prefill_attention_xla(q, k, v, q_start, kv_len, layer=None, row=0, *,
                          block_q=XLA_BLOCK_Q, block_k=XLA_BLOCK_K):
    """The "xla" implementation: a scan over query blocks, each a while loop over the key
    blocks it needs (up to its causal edge and max(kv_len)), so scores take
    O(block_q * block_k) memory per head and the unfilled cache is never read."""
    v, _ = _stack(v, layer)
    k, layer = _stack(k, layer)
    b, t, hq, d = q.shape
    hkv, s_len = k.shape[2], k.shape[3]
    g = hq // hkv
    bq, bk = min(block_q, t), min(block_k, s_len)
    nq = -(-t // bq)
    qp = jnp.pad(q, ((0, 0), (0, nq * bq - t), (0, 0), (0, 0)))
    qp = qp.reshape(b, nq, bq, hkv, g, d).transpose(1, 0, 3, 4, 2, 5)  # [nq, B, Hkv, G, bq, D]
    kv_len = jnp.clip(kv_len, 0, s_len)
    scale = 1.0 / math.sqrt(d)
    prec = dot_precision(k.dtype)
    key_idx = jnp.arange(bk)

    def q_block(args):
        i, qb = args
        qb = qb.astype(k.dtype)
        first = q_start + i * bq
        pos = first[:, None] + jnp.arange(bq)[None, :]  # [B, bq]
        hi = jnp.max(jnp.minimum(kv_len, first + bq))
        n_blocks = (jnp.maximum(hi, 0) + bk - 1) // bk

        def body(j, carry):
            acc, m, l = carry
            start = j * bk
            at = jnp.minimum(start, s_len - bk)  # a short last block re-reads; masked below
            kb = lax.dynamic_slice(k, (layer, row, 0, at, 0), (1, b, hkv, bk, d))[0]
            vb = lax.dynamic_slice(v, (layer, row, 0, at, 0), (1, b, hkv, bk, d))[0]
            keys = at + key_idx
            ok = ((keys >= start)[None, None, :] & (keys[None, None, :] <= pos[:, :, None])
                  & (keys[None, None, :] < kv_len[:, None, None]))  # [B, bq, bk]
            s = jnp.einsum("bhgqd,bhkd->bhgqk", qb, kb, precision=prec,
                           preferred_element_type=jnp.float32) * scale
            s = jnp.where(ok[:, None, None], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(vb.dtype), vb, precision=prec,
                            preferred_element_type=jnp.float32)
            return acc * alpha[..., None] + pv, m_new, l * alpha + jnp.sum(p, axis=-1)

        init = (jnp.zeros((b, hkv, g, bq, d), jnp.float32),
                jnp.full((b, hkv, g, bq), _M_INIT, jnp.float32),
                jnp.zeros((b, hkv, g, bq), jnp.float32))
        acc, _, l = lax.fori_loop(0, n_blocks, body, init)
        ok = l != 0  # no valid key: 0; NaN inputs stay NaN
        return jnp.where(ok[..., None], acc / jnp.where(ok, l, 1.0)[..., None], 0.0)

    out = lax.map(q_block, (jnp.arange(nq, dtype=jnp.int32), qp))  # [nq, B, Hkv, G, bq, D]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, hq, d)[:, :t]
    return out.astype(q.dtype)
