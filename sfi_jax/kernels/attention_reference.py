"""Pure-jnp decode attention: the oracle for the kernels and the "xla" implementation.

Written for clarity, not speed: everything is accumulated in float32 and ignored
positions are masked with -inf before one softmax.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def _pick(cache, layer, rows):
    """The [B, Hkv, S, D] view of a (possibly layer-stacked) cache, rows gathered."""
    if layer is not None:
        cache = lax.dynamic_index_in_dim(cache, jnp.asarray(layer, jnp.int32), 0, keepdims=False)
    if rows is not None:
        cache = jnp.take(cache, rows, axis=0)
    return cache


def _scores(q, k):
    """Scaled q·k in float32: q [B, Hq, D], k [B, Hkv, S, D] -> [B, Hkv, G, S]."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d).astype(jnp.float32)
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, k.astype(jnp.float32), precision=_HI)
    return s * (1.0 / math.sqrt(d))


def _softmax_out(s, v, out_dtype):
    """Softmax over the last axis of masked scores s [B, Hkv, G, N] applied to v [B, Hkv, N, D].

    Returns (out [B, Hkv*G, D], lse [B, Hkv*G]); rows with nothing valid give 0 and -inf.
    """
    b, hkv, g, _ = s.shape
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgs,bhsd->bhgd", p, v.astype(jnp.float32), precision=_HI)
    ok = l != 0  # no valid key: 0; NaN inputs stay NaN (l is NaN, not 0)
    o = jnp.where(ok, o / jnp.where(ok, l, 1.0), 0.0)
    lse = jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), -jnp.inf)
    return o.reshape(b, hkv * g, -1).astype(out_dtype), lse.reshape(b, hkv * g)


@functools.partial(jax.jit, static_argnames=("return_logits",))
def dense_decode(q, k, v, lengths, *, return_logits=False, layer=None, rows=None):
    """Attention of one query per row over cache positions [0, lengths[b])."""
    k, v = _pick(k, layer, rows), _pick(v, layer, rows)
    b, hq, _ = q.shape
    s_len = k.shape[2]
    s = _scores(q, k)
    valid = jnp.arange(s_len)[None, :] < lengths[:, None]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    out, lse = _softmax_out(s, v, q.dtype)
    if return_logits:
        return out, s.reshape(b, hq, s_len), lse
    return out


def _window(cache, start, window):
    """Per row, `window` positions of cache [B, Hkv, S, D] from start[b] (clamped inside S)."""
    s_len = cache.shape[2]
    start = jnp.clip(start, 0, s_len - window)
    take = jax.vmap(lambda c, st: lax.dynamic_slice_in_dim(c, st, window, axis=1))
    return take(cache, start), start


@functools.partial(jax.jit, static_argnames=("window",))
def sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths, *, layer=None, window=None):
    """Attention over the compact prefix [0, c_len[b, h]) plus the recent window of the cache.

    With a static `window` >= max(lengths - recent_start), only that many cache positions
    per row are read (what the runtime wants on CPU); otherwise the whole cache is masked.
    """
    ck, cv = _pick(ck, layer, None), _pick(cv, layer, None)
    k, v = _pick(k, layer, None), _pick(v, layer, None)
    s_len = k.shape[2]
    c_size = ck.shape[2]
    sc = _scores(q, ck)
    c_valid = jnp.arange(c_size)[None, None, :] < c_len[:, :, None]
    sc = jnp.where(c_valid[:, :, None, :], sc, -jnp.inf)
    if window is not None and window < s_len:
        k, pos0 = _window(k, recent_start, window)
        v, _ = _window(v, recent_start, window)
        pos = pos0[:, None] + jnp.arange(window)[None, :]
    else:
        pos = jnp.broadcast_to(jnp.arange(s_len)[None, :], (k.shape[0], s_len))
    sr = _scores(q, k)
    r_valid = (pos >= recent_start[:, None]) & (pos < lengths[:, None])
    sr = jnp.where(r_valid[:, None, None, :], sr, -jnp.inf)
    s = jnp.concatenate([sc, sr], axis=-1)
    vv = jnp.concatenate([cv, v], axis=2)
    out, _ = _softmax_out(s, vv, q.dtype)
    return out
