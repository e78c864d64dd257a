"""Routed expert MLPs, dispatched: `lax.ragged_dot` ("xla", `moe_reference`), the Triton
kernels of `moe_gpu` ("kernel": grouped over expert-sorted rows; "tokens": every expert
multiplies all of a step's tokens, no sort) or their Mosaic GPU twin of "tokens" (`moe_mgpu`,
"mosaic_gpu": one program per touched expert); interpret mode off the GPU."""

from __future__ import annotations

import jax.numpy as jnp

from sfi_jax.kernels import moe_reference as reference
from sfi_jax.kernels.common import gpu_fallback, interpret_for

IMPLS = ("xla", "kernel", "tokens", "mosaic_gpu")


def routed_experts(x, we_gate, we_up, we_down, top_p, top_e, *, impl: str = "xla"):
    """sum_j top_p[t, j] * SwiGLU_{top_e[t, j]}(x[t]) for x [n, H] (see
    `moe_reference.routed_experts`). "tokens" takes at most `moe_gpu.TOKENS` tokens (more run
    as "kernel"); shapes the kernels do not tile run as "xla"."""
    if impl not in IMPLS:
        raise ValueError(f"moe impl must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        return reference.routed_experts(x, we_gate, we_up, we_down, top_p, top_e)
    if impl == "mosaic_gpu":
        from sfi_jax.kernels import moe_mgpu

        if moe_mgpu.supported(x, we_gate):
            return moe_mgpu.token_moe(x, we_gate, we_up, we_down, top_p, top_e,
                                      interpret=interpret_for("mosaic_gpu")).astype(x.dtype)
        # float32 experts, odd dims or more than 64 tokens: the Triton kernels (XLA's
        # ragged_dot on a jax without the Triton lowering)
        if gpu_fallback() == "xla":
            return reference.routed_experts(x, we_gate, we_up, we_down, top_p, top_e)
        impl = "tokens"
    from sfi_jax.kernels import moe_gpu  # Triton's Pallas lowering, imported only when used

    E, H, I = we_gate.shape
    tile = moe_gpu.tile(H, I)
    if tile is None:
        return reference.routed_experts(x, we_gate, we_up, we_down, top_p, top_e)
    kw = dict(interpret=interpret_for("pallas_gpu"), block_n=tile[0], block_k=tile[1])
    n, k = top_e.shape
    if impl == "tokens" and n <= moe_gpu.TOKENS:
        # [n, E]: token t's weight for expert e (0 where unrouted), no scatter
        onehot = top_e[..., None] == jnp.arange(E)
        weights = jnp.sum(jnp.where(onehot, top_p[..., None], 0.0), axis=1)
        return moe_gpu.token_moe(x, we_gate, we_up, we_down, weights, **kw).astype(x.dtype)
    order, token_of, group_sizes = reference.sort_by_expert(top_e, E)
    hidden = moe_gpu.grouped_matmul(x[token_of], we_gate, group_sizes, we_up, **kw)
    ys = moe_gpu.grouped_matmul(hidden, we_down, group_sizes, **kw)[:n * k]
    return reference.combine_experts(ys.astype(jnp.float32), top_p, order, token_of, x)
