"""Dense prefill attention in plain jnp: the oracle the prefill kernels are tested against.

Materialises the float32 scores [B, Hkv, G, T, S] and takes one masked softmax, so it is
only for small shapes; the blockwise "xla" path in prefill_attention.py is what runs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def _layer(cache, layer):
    if layer is None:
        return cache
    return lax.dynamic_index_in_dim(cache, jnp.asarray(layer, jnp.int32), 0, keepdims=False)


@jax.jit
def prefill_attention(q, k, v, q_start, kv_len, layer=None):
    """q [B, T, Hq, D] at positions q_start[b] + t over k, v [B, Hkv, S, D] ([L, ...] with
    `layer`): key j is seen by a query at position p iff j <= p and j < kv_len[b].

    Returns out [B, T, Hq, D] in q's dtype; a query that sees no key gives zeros.
    """
    k, v = _layer(k, layer), _layer(v, layer)
    b, t, hq, d = q.shape
    hkv, s_len = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d).astype(jnp.float32)
    s = jnp.einsum("bthgd,bhsd->bhgts", qg, k.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) / math.sqrt(d)
    pos = q_start.astype(jnp.int32)[:, None] + jnp.arange(t)[None, :]  # [B, T]
    key = jnp.arange(s_len)[None, None, :]
    valid = (key <= pos[:, :, None]) & (key < kv_len.astype(jnp.int32)[:, None, None])
    s = jnp.where(valid[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgts,bhsd->bthgd", p / jnp.where(l != 0, l, 1.0), v.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
    return o.reshape(b, t, hq, d).astype(q.dtype)
