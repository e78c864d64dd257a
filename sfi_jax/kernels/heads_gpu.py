"""One decode step's attention heads from the fused q/k/v matmul output, in one launch: q and k
heads RMS-normed per head (Qwen3's q_norm / k_norm) and rotated (rotate-half rope), v heads
split off. XLA makes four or five small launches of the same jnp per layer (two norms, two
rotations, a slice), which at decode batch sizes cost more than the work.

The rounding follows `models.modeling.attention_inputs`: the norm in float32, rounded to the
activation dtype, then the rotation in float32, rounded again.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sfi_jax.kernels.triton_lowering import plgpu_triton


def supported(head_dim: int) -> bool:
    """Triton vectors need a power-of-two length of at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _kernel(qkv_ref, cos_ref, sin_ref, qn_ref, kn_ref, q_out, k_out, v_out, *, hq, hkv, d, eps,
            qk_norm):
    """Program (r, h): head h of row r, h < hq a query head, then hkv key heads, then hkv value
    heads (the column order of the fused weight)."""
    r, h = pl.program_id(0), pl.program_id(1)
    cols = jnp.arange(d)
    partner = (cols + d // 2) % d  # rotate-half: column i pairs with column i +- d/2
    raw = plgpu_triton.load(qkv_ref.at[r, h * d + cols])
    x = raw.astype(jnp.float32)
    xp = plgpu_triton.load(qkv_ref.at[r, h * d + partner]).astype(jnp.float32)
    is_q, is_k = h < hq, (h >= hq) & (h < hq + hkv)
    if qk_norm:
        w = jnp.where(is_q, plgpu_triton.load(qn_ref.at[cols]),
                      plgpu_triton.load(kn_ref.at[cols])).astype(jnp.float32)
        wp = jnp.where(is_q, plgpu_triton.load(qn_ref.at[partner]),
                       plgpu_triton.load(kn_ref.at[partner])).astype(jnp.float32)
        inv = lax.rsqrt(jnp.sum(x * x) / d + eps)
        x = (x * inv * w).astype(raw.dtype).astype(jnp.float32)
        xp = (xp * inv * wp).astype(raw.dtype).astype(jnp.float32)
    # sin carries the rotation's sign: -sin on the first half, +sin on the second
    rotated = (x * plgpu_triton.load(cos_ref.at[r, cols])
               + xp * plgpu_triton.load(sin_ref.at[r, cols])).astype(q_out.dtype)
    every = cols >= 0
    plgpu_triton.store(q_out.at[r, jnp.minimum(h, hq - 1), cols], rotated, mask=every & is_q)
    plgpu_triton.store(k_out.at[r, jnp.clip(h - hq, 0, hkv - 1), cols], rotated,
                       mask=every & is_k)
    plgpu_triton.store(v_out.at[r, jnp.clip(h - hq - hkv, 0, hkv - 1), cols], raw,
                       mask=every & (h >= hq + hkv))


@functools.partial(jax.jit, static_argnames=("num_q_heads", "num_kv_heads", "eps", "interpret"))
def norm_rope_heads(qkv, cos, sin, q_norm, k_norm, *, num_q_heads, num_kv_heads, eps,
                    interpret=False):
    """qkv [B, (Hq + 2 Hkv) * D] -> q [B, Hq, D], k, v [B, Hkv, D].

    cos, sin: float32 [B, D/2] (the attention scale applied), as `apply_rope` makes them;
    q_norm, k_norm: [D] weights, or None for models without per-head norms.
    """
    b, width = qkv.shape
    n_heads = num_q_heads + 2 * num_kv_heads
    d = width // n_heads
    if d * n_heads != width or not supported(d):
        raise ValueError(f"qkv width {width} is not {n_heads} heads of a power-of-two dim >= 16")
    qk_norm = q_norm is not None
    if not qk_norm:
        q_norm = k_norm = jnp.ones((d,), qkv.dtype)
    cos_full = jnp.concatenate([cos, cos], axis=-1).astype(jnp.float32)
    sin_signed = jnp.concatenate([-sin, sin], axis=-1).astype(jnp.float32)
    kernel = functools.partial(_kernel, hq=num_q_heads, hkv=num_kv_heads, d=d, eps=eps,
                               qk_norm=qk_norm)
    return pl.pallas_call(
        kernel, grid=(b, n_heads),
        out_shape=[jax.ShapeDtypeStruct((b, num_q_heads, d), qkv.dtype),
                   jax.ShapeDtypeStruct((b, num_kv_heads, d), qkv.dtype),
                   jax.ShapeDtypeStruct((b, num_kv_heads, d), qkv.dtype)],
        compiler_params=plgpu_triton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="sfi_norm_rope_heads",
    )(qkv, cos_full, sin_signed, q_norm, k_norm)
