"""Pure-jnp multi-query decode attention: the oracle for the kernels and the "xla" path.

T queries per row at consecutive positions q_start[b] + t, causal among themselves, over a
cache that already holds their keys. Written for clarity: scores are materialised in
float32 and masked with -inf before one softmax (T is small, so this is a decode step's size).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def _pick(cache, layer):
    """The [B, Hkv, S, D] view of a (possibly layer-stacked) cache."""
    if layer is None:
        return cache
    return lax.dynamic_index_in_dim(cache, jnp.asarray(layer, jnp.int32), 0, keepdims=False)


def key_mask(q_start, kv_len, n_queries, s_len):
    """bool [B, T, S]: query t of row b may read key j (j <= q_start + t, j < kv_len, and the
    query itself lies before kv_len; padding queries read nothing)."""
    pos = q_start[:, None] + jnp.arange(n_queries)[None, :]
    j = jnp.arange(s_len)[None, None, :]
    ok = (j <= pos[:, :, None]) & (j < kv_len[:, None, None])
    return ok & (pos < kv_len[:, None])[:, :, None]


@functools.partial(jax.jit, static_argnames=("return_logits",))
def multi_query_decode(q, k, v, q_start, kv_len, *, layer=None, return_logits=False):
    """q [B, T, Hq, D] over k, v [B, Hkv, S, D] (or stacked, read at `layer`).

    Returns out [B, T, Hq, D] in q's dtype; with return_logits also logits f32 [B, Hq, T, S]
    (-inf where masked) and lse f32 [B, Hq, T] (-inf for a query with nothing to read, whose
    output is zeros).
    """
    k, v = _pick(k, layer), _pick(v, layer)
    b, t, hq, d = q.shape
    hkv, s_len = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d).astype(jnp.float32)
    s = jnp.einsum("bthgd,bhsd->bhgts", qg, k.astype(jnp.float32), precision=_HI)
    s = s * (1.0 / math.sqrt(d))
    mask = key_mask(q_start.astype(jnp.int32), kv_len.astype(jnp.int32), t, s_len)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgts,bhsd->bhgtd", p, v.astype(jnp.float32), precision=_HI)
    ok = l != 0  # no valid key: 0; NaN inputs stay NaN
    o = jnp.where(ok, o / jnp.where(ok, l, 1.0), 0.0)
    out = o.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q.dtype)
    if not return_logits:
        return out
    lse = jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), -jnp.inf)
    return out, s.reshape(b, hq, t, s_len), lse.reshape(b, hq, t)
