"""One decode step's attention heads from the fused q/k/v matmul output, in jnp: q and k heads
RMS-normed per head (float32, rounded to the activation dtype) and rotated (rotate-half rope,
float32, rounded again), v heads split off. The reference of `heads_gpu`; the same arithmetic
as `models.modeling.attention_inputs`."""

from __future__ import annotations

import jax.numpy as jnp

from sfi_jax.kernels.common import rms_norm


def _rope(x, cos, sin):
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    cos, sin = cos[:, None], sin[:, None]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def norm_rope_heads(qkv, cos, sin, q_norm, k_norm, *, num_q_heads, num_kv_heads, eps):
    """qkv [B, (Hq + 2 Hkv) * D] -> q [B, Hq, D], k, v [B, Hkv, D]; cos, sin float32 [B, D/2];
    q_norm, k_norm [D] or None (no per-head norms)."""
    b, width = qkv.shape
    d = width // (num_q_heads + 2 * num_kv_heads)
    heads = qkv.reshape(b, num_q_heads + 2 * num_kv_heads, d)
    q, k = heads[:, :num_q_heads], heads[:, num_q_heads:num_q_heads + num_kv_heads]
    v = heads[:, num_q_heads + num_kv_heads:]
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return _rope(q, cos, sin), _rope(k, cos, sin), v
