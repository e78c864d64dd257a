"""Public decode-attention entry points: pick an implementation and check shapes.

impl: "auto" (the kernel of the current platform; "xla" on CPU), "xla" (pure jnp),
"pallas_gpu" (Triton-lowered), "pallas_tpu" (Mosaic TPU). A Pallas kernel asked for
off its own platform runs in interpret mode, so both kernels can be tested on a CPU.
"""

from __future__ import annotations

import jax.numpy as jnp

from sfi_jax.backend import platform as _platform
from sfi_jax.kernels import reference

IMPLS = ("auto", "xla", "pallas_gpu", "pallas_tpu")


def _resolve(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
    if impl == "auto":
        return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(_platform(), "xla")
    return impl


def _interpret(impl):
    """Interpret mode (value for pallas_call's `interpret`) when off the kernel's platform."""
    if impl == "pallas_gpu":
        return _platform() != "gpu"
    if _platform() == "tpu":
        return None
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()


def _check_cache(name, cache, layer, ndim=4):
    want = ndim + (layer is not None)
    if cache.ndim != want:
        stacked = " stacked [L, ...]" if layer is not None else ""
        raise ValueError(f"{name} has shape {cache.shape}; expected {want} dims{stacked}")


def _check(q, k, v, lengths, layer):
    if q.ndim != 3:
        raise ValueError(f"q has shape {q.shape}; expected [B, Hq, D]")
    _check_cache("k", k, layer)
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} differ")
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[-3]
    if k.shape[-1] != d:
        raise ValueError(f"head dim of q ({d}) and k ({k.shape[-1]}) differ")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if lengths.shape != (q.shape[0],):
        raise ValueError(f"lengths has shape {lengths.shape}; expected ({q.shape[0]},)")


def dense_decode(q, k, v, lengths, *, return_logits=False, impl="auto", layer=None, rows=None):
    """Decode attention of q [B, Hq, D] over k, v [B, Hkv, S, D], positions < lengths[b].

    layer: with k, v stacked [L, B, Hkv, S, D], read that layer in place (no copy).
    rows: int32 [R]; q and lengths then have R rows and row i reads cache row rows[i].
    Returns out [B, Hq, D], or with return_logits (out, logits f32 [B, Hq, S] with -inf at
    ignored positions, lse f32 [B, Hq]). A row of length 0 gives zeros and lse -inf.
    """
    _check(q, k, v, lengths, layer)
    if rows is not None and rows.shape != (q.shape[0],):
        raise ValueError(f"rows has shape {rows.shape}; expected ({q.shape[0]},)")
    impl = _resolve(impl)
    lengths = jnp.asarray(lengths, jnp.int32)
    if impl == "xla":
        return reference.dense_decode(q, k, v, lengths, return_logits=return_logits,
                                      layer=layer, rows=rows)
    if impl == "pallas_gpu":
        from sfi_jax.kernels import gpu as mod
    else:
        from sfi_jax.kernels import tpu as mod
    return mod.dense_decode(q, k, v, lengths, layer, rows, return_logits=return_logits,
                            interpret=_interpret(impl))


def sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths, *, impl="auto", layer=None,
                  window=None):
    """Attention over the compact buffer prefix [0, c_len[b, h]) of ck, cv [B, Hkv, C, D]
    and the cache window [recent_start[b], lengths[b]) of k, v [B, Hkv, S, D], read in place.

    Equal to dense attention over the union of both segments; an empty union gives zeros.
    layer: all four caches stacked over layers, read in place. window: optional static
    bound on lengths - recent_start; the TPU kernel and the xla path then read only that
    much of the cache per row (a wrong bound gives wrong results).
    """
    _check(q, k, v, lengths, layer)
    _check_cache("ck", ck, layer)
    if ck.shape != cv.shape or ck.shape[-1] != k.shape[-1] or ck.shape[-3] != k.shape[-3]:
        raise ValueError(f"ck {ck.shape}, cv {cv.shape} do not match the cache {k.shape}")
    if c_len.shape != (q.shape[0], k.shape[-3]):
        raise ValueError(f"c_len has shape {c_len.shape}; expected {(q.shape[0], k.shape[-3])}")
    if recent_start.shape != (q.shape[0],):
        raise ValueError(f"recent_start has shape {recent_start.shape}; expected ({q.shape[0]},)")
    if window is not None and int(window) < 0:
        raise ValueError(f"window={window}; expected a non-negative int or None")
    impl = _resolve(impl)
    c_len = jnp.asarray(c_len, jnp.int32)
    recent_start = jnp.asarray(recent_start, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    if impl == "xla":
        return reference.sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths,
                                       layer=layer, window=window)
    if impl == "pallas_gpu":
        from sfi_jax.kernels import gpu as mod
    else:
        from sfi_jax.kernels import tpu as mod
    return mod.sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths, layer,
                             window=window, interpret=_interpret(impl))
