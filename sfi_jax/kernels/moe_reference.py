"""Routed expert MLPs (SwiGLU) in jnp: grouped matmuls over expert-sorted token rows by
`lax.ragged_dot`, the reference of `moe_gpu` and the path off the GPU and on a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sfi_jax.kernels.common import dot_precision


def sort_by_expert(top_e, num_experts: int):
    """Rows of the routed (token, expert) pairs sorted by expert: the order, each row's token,
    and the rows per expert."""
    k = top_e.shape[-1]
    flat_e = top_e.reshape(-1)
    order = jnp.argsort(flat_e)
    group_sizes = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
    return order, order // k, group_sizes


def combine_experts(ys, top_p, order, token_of, x):
    """Each token's expert outputs (expert-sorted rows ys) weighted by its routing weights."""
    weights = top_p.reshape(-1)[order][:, None]
    out = jnp.zeros(x.shape, jnp.float32).at[token_of].add(ys * weights)
    return out.astype(x.dtype)


def routed_experts(x, we_gate, we_up, we_down, top_p, top_e):
    """sum_j top_p[t, j] * SwiGLU_{top_e[t, j]}(x[t]) for x [n, H], expert weights [E, H, I]
    (down [E, I, H]); each projection accumulated in float32 and rounded to x's dtype."""
    order, token_of, group_sizes = sort_by_expert(top_e, we_gate.shape[0])
    xs = x[token_of]

    def grouped(lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=dot_precision(lhs.dtype),
                                  preferred_element_type=jnp.float32).astype(x.dtype)

    hidden = jax.nn.silu(grouped(xs, we_gate)) * grouped(xs, we_up)
    ys = grouped(hidden, we_down).astype(jnp.float32)
    return combine_experts(ys, top_p, order, token_of, x)
