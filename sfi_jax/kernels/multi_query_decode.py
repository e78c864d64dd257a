"""Multi-query decode attention: T queries per row at consecutive positions, causal among
themselves, over the head-major cache that already holds their keys (exact mode's verify step,
which is also SFI's slow step: it can return the logits the selector reads).

impl: "auto" (pallas_gpu on GPU, pallas_tpu on TPU, xla elsewhere), "xla" (pure jnp),
"pallas_gpu" (Triton-lowered), "mosaic_gpu" (Mosaic GPU, for half-precision caches, head dim
64/128/256 and G * T <= 64 rows per KV head; other inputs take the Triton kernel, or "xla"
on a jax without the Triton lowering),
"pallas_tpu" (Mosaic TPU). A Pallas kernel asked for off its
own platform runs in interpret mode, so both can be tested on a CPU.
"""

from __future__ import annotations

import jax.numpy as jnp

from sfi_jax.kernels.common import gpu_fallback, interpret_for, platform_kernel

IMPLS = ("auto", "xla", "pallas_gpu", "mosaic_gpu", "pallas_tpu")
MAX_QUERIES = 16


def resolve_impl(impl) -> str:
    """The implementation `impl` stands for on this platform."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
    if impl == "auto":
        return platform_kernel()
    return impl


def one_query_logits(logits, logits_query):
    """logits [B, Hq, T, S] -> [B, Hq, S] at query logits_query[b] (-inf outside [0, T))."""
    t = logits.shape[2]
    pick = jnp.clip(logits_query, 0, t - 1)[:, None, None, None]
    one = jnp.take_along_axis(logits, pick, axis=2)[:, :, 0]
    ok = (logits_query >= 0) & (logits_query < t)
    return jnp.where(ok[:, None, None], one, -jnp.inf)


def _check(q, k, v, q_start, kv_len, layer):
    if q.ndim != 4:
        raise ValueError(f"q has shape {q.shape}; expected [B, T, Hq, D]")
    b, t, hq, d = q.shape
    if not 1 <= t <= MAX_QUERIES:
        raise ValueError(f"q has T={t} queries per row; expected 1..{MAX_QUERIES}")
    want = 4 if layer is None else 5
    for name, x in (("k", k), ("v", v)):
        if x.ndim != want:
            layout = "[B, Hkv, S, D]" if layer is None else "[L, B, Hkv, S, D] (layer given)"
            raise ValueError(f"{name} has shape {x.shape}; expected {layout}")
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} differ")
    if k.shape[-4] != b:
        raise ValueError(f"k has {k.shape[-4]} rows; q has {b}")
    if k.shape[-1] != d:
        raise ValueError(f"head dim of q ({d}) and k ({k.shape[-1]}) differ")
    if hq % k.shape[-3]:
        raise ValueError(f"{hq} query heads are not a multiple of {k.shape[-3]} KV heads")
    if t > k.shape[-2]:
        raise ValueError(f"T={t} queries do not fit a cache of {k.shape[-2]} positions")
    for name, x in (("q_start", q_start), ("kv_len", kv_len)):
        if x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} is {x.dtype}{list(x.shape)}; expected an integer [{b}]")
    if layer is not None and jnp.shape(layer) not in ((), (1,)):
        raise ValueError(f"layer has shape {jnp.shape(layer)}; expected a scalar")


def multi_query_decode(q, k, v, q_start, kv_len, *, layer=None, return_logits=False,
                       logits_query=None, impl="auto"):
    """Attention of q [B, T, Hq, D]: query t of row b sits at position q_start[b] + t and reads
    the keys at positions j <= q_start[b] + t and j < kv_len[b] of k, v [B, Hkv, S, D] (or
    stacked [L, B, Hkv, S, D], read in place at `layer`, which may be traced).

    Queries at positions >= kv_len[b] are padding: zeros out, -inf logits and lse. On GPU a
    row with kv_len[b] <= q_start[b] reads no K/V (with logits it only writes their -inf).
    Returns out [B, T, Hq, D] in q's dtype, or with return_logits (out, logits f32
    [B, Hq, T, S] of scaled q.k, -inf where masked, lse f32 [B, Hq, T]). The logits keep the
    head major and T inner, so [B, Hkv, G * T, S] is a free view for the selector.
    logits_query (with return_logits): int32 [B], the one query per row whose logits come
    back, as logits [B, Hq, S]; rows with logits_query[b] outside [0, T) get unspecified
    logits (the GPU kernel writes none: a verify that refreshes a few rows' selections writes
    only theirs, not T * B rows of S floats per layer).
    """
    q_start, kv_len = jnp.asarray(q_start), jnp.asarray(kv_len)
    _check(q, k, v, q_start, kv_len, layer)
    impl = resolve_impl(impl)
    q_start, kv_len = q_start.astype(jnp.int32), kv_len.astype(jnp.int32)
    if layer is not None:
        layer = jnp.asarray(layer, jnp.int32).reshape(())
    if logits_query is not None:
        logits_query = jnp.asarray(logits_query)
        if not return_logits:
            raise ValueError("logits_query needs return_logits=True")
        if logits_query.shape != (q.shape[0],) or \
                not jnp.issubdtype(logits_query.dtype, jnp.integer):
            raise ValueError(f"logits_query is {logits_query.dtype}{list(logits_query.shape)}; "
                             f"expected an integer [{q.shape[0]}]")
        logits_query = logits_query.astype(jnp.int32)
        if impl != "pallas_gpu":  # all T queries' logits, then one per row
            out, logits, lse = multi_query_decode(q, k, v, q_start, kv_len, layer=layer,
                                                  return_logits=True, impl=impl)
            return out, one_query_logits(logits, logits_query), lse
    if impl == "mosaic_gpu":
        from sfi_jax.kernels import multi_query_decode_mgpu as mgpu

        if mgpu.supported(q, k):
            return mgpu.multi_query_decode(q, k, v, q_start, kv_len, layer,
                                           return_logits=return_logits,
                                           interpret=interpret_for("mosaic_gpu"))
        impl = gpu_fallback()  # the Triton kernel, or XLA on a jax without it
    if impl == "xla":
        from sfi_jax.kernels import multi_query_decode_reference as ref

        return ref.multi_query_decode(q, k, v, q_start, kv_len, layer=layer,
                                      return_logits=return_logits)
    if impl == "pallas_gpu":
        from sfi_jax.kernels import multi_query_decode_gpu as gpu

        return gpu.multi_query_decode(q, k, v, q_start, kv_len, layer,
                                      return_logits=return_logits, logits_query=logits_query,
                                      interpret=interpret_for("pallas_gpu"))
    from sfi_jax.kernels import multi_query_decode_tpu as tpu

    return tpu.multi_query_decode(q, k, v, q_start, kv_len, layer,
                                  return_logits=return_logits,
                                  interpret=interpret_for("pallas_tpu"))
