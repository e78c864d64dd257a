"""A few rows times a weight in jnp: the optional RMSNorm of the rows (float32, rounded to their
dtype: `kernels.common.rms_norm`), then a float32-accumulated matmul. The reference of
`skinny_matmul_gpu`."""

from __future__ import annotations

import jax.numpy as jnp

from sfi_jax.kernels.common import dot_precision, rms_norm


def skinny_matmul(x, weights, norm=None, *, eps=1e-6, transposed=False):
    """x [..., K] -> one float32 [..., N] per weight [K, N] ([N, K] when transposed)."""
    h = x if norm is None else rms_norm(x, norm, eps)
    prec = dot_precision(h.dtype)
    if transposed:
        return tuple(jnp.einsum("...k,nk->...n", h, w, preferred_element_type=jnp.float32,
                                precision=prec) for w in weights)
    return tuple(jnp.matmul(h, w, preferred_element_type=jnp.float32, precision=prec)
                 for w in weights)
