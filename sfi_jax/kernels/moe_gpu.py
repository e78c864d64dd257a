"""Grouped expert matmuls for MoE decoding as Triton-lowered Pallas kernels.

In a decode step a few tokens each pick a few experts, so most routed experts hold one or two
token rows. The kernels walk blocks of up to 16 expert-sorted rows ("row blocks", each inside
one expert's group) and read each routed expert's weights once per output column block:
the bytes of the experts touched, no more. Row blocks past the step's count do no work. The
gate and up projections share one kernel whose epilogue applies SiLU(gate) * up, so the
hidden activations are written once.

The rounding follows `models.modeling.moe_mlp` (each projection accumulated in float32 and
rounded to the activation dtype, SiLU and the product in that dtype).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sfi_jax.kernels.common import dot_precision, swiglu_rounded
from sfi_jax.kernels.triton_lowering import plgpu_triton

ROWS = 16  # rows per block: the smallest M of tl.dot
BLOCK_N = 64  # the smallest weight tile (columns x inner dim); scripts/diag/diag_moe_kernel.py
BLOCK_K = 64  # sweeps them
# Tiles the models use, fastest first (128 x 64 for both layouts at Qwen3-30B-A3B's expert
# shapes: docs/findings.md).
TILES = ((128, 64), (BLOCK_N, BLOCK_K))


def _dot(a, b):
    return plgpu_triton.dot(a, b, precision=dot_precision(b.dtype))


def supported(hidden: int, inter: int, block_n: int = BLOCK_N, block_k: int = BLOCK_K) -> bool:
    """The weight blocks tile both matrix dims exactly (pl.ds past the end would clamp)."""
    return all(d % block_n == 0 and d % block_k == 0 for d in (hidden, inter))


def tile(hidden: int, inter: int):
    """The fastest weight tile (block_n, block_k) that tiles these expert shapes, or None."""
    return next(((n, k) for n, k in TILES if supported(hidden, inter, n, k)), None)


def row_blocks(group_sizes, n_rows: int):
    """Per row block b (a static upper bound of them): its expert, first sorted row and row
    count (0 for blocks past the last, which start at n_rows). group_sizes [E] int32 counts
    rows per expert, rows sorted by expert."""
    n_experts = group_sizes.shape[0]
    n_blocks = -(-n_rows // ROWS) + min(n_experts, n_rows)  # sum of ceil(c_e / 16) <= this
    per_expert = -(-group_sizes // ROWS)
    ends = jnp.cumsum(per_expert)
    b = jnp.arange(n_blocks, dtype=jnp.int32)
    expert = jnp.searchsorted(ends, b, side="right").astype(jnp.int32)
    e = jnp.minimum(expert, n_experts - 1)
    first_block = ends[e] - per_expert[e]
    row_start = jnp.cumsum(group_sizes) - group_sizes
    within = (b - first_block) * ROWS
    rows = jnp.where(expert < n_experts, jnp.clip(group_sizes[e] - within, 0, ROWS), 0)
    # an empty block points at the scratch rows past the last (see `grouped_matmul`)
    start = jnp.where(rows > 0, row_start[e] + within, n_rows)
    return e, start.astype(jnp.int32), rows.astype(jnp.int32)


def _kernel(expert_ref, start_ref, rows_ref, x_ref, w_ref, *refs, k_dim, swiglu, block_n,
            block_k):
    """Program (b, n): rows [start, start + rows) of x times columns block n of expert e's
    weight (two weights and SiLU(a) * b with swiglu)."""
    if swiglu:
        w2_ref, o_ref = refs
    else:
        (o_ref,) = refs
    b, n = pl.program_id(0), pl.program_id(1)
    e, start, rows = expert_ref[b], start_ref[b], rows_ref[b]
    ridx = jnp.arange(ROWS)
    rmask = ridx < rows
    src = start + ridx  # masked lanes: distinct rows, never read or written
    cols = pl.ds(n * block_n, block_n)
    zero = jnp.zeros((ROWS, block_n), jnp.float32)

    def body(i, acc):
        kk = i * block_k
        x = plgpu_triton.load(x_ref.at[src[:, None], kk + jnp.arange(block_k)[None, :]],
                              mask=rmask[:, None], other=0.0)
        a = acc[0] + _dot(x, plgpu_triton.load(w_ref.at[e, pl.ds(kk, block_k), cols]))
        if not swiglu:
            return (a,)
        return a, acc[1] + _dot(
            x, plgpu_triton.load(w2_ref.at[e, pl.ds(kk, block_k), cols]))

    # a block past the step's rows loads nothing. (Arithmetic, not jnp.where: Triton's
    # lowering gives a select of two constants the condition's i1 type, an invalid loop bound.)
    n_k = (rows > 0).astype(jnp.int32) * (k_dim // block_k)
    acc = lax.fori_loop(0, n_k, body, (zero, zero) if swiglu else (zero,))
    dtype = o_ref.dtype
    out = swiglu_rounded(acc[0], acc[1], dtype) if swiglu else acc[0].astype(dtype)
    dst = (src[:, None], n * block_n + jnp.arange(block_n)[None, :])
    plgpu_triton.store(o_ref.at[dst], out, mask=rmask[:, None])


@functools.partial(jax.jit, static_argnames=("interpret", "block_n", "block_k", "num_warps",
                                             "num_stages"))
def grouped_matmul(x, w, group_sizes, w2=None, *, interpret=False, block_n=BLOCK_N,
                   block_k=BLOCK_K, num_warps=4, num_stages=3):
    """x [M, K] rows sorted by expert (group_sizes [E] rows each, summing to at most M) times
    w [E, K, N] per group: [M + 16, N] in x's dtype (float32 accumulation), of which the rows
    past the groups' total are scratch (a block's lanes past its rows address distinct rows, so
    interpret mode's masked stores never collide). With w2 [E, K, N]: SiLU(x @ w) * (x @ w2).
    block_n x block_k: the weight tile; num_warps, num_stages: Triton's."""
    m, k_dim = x.shape
    n_experts, kw, n_dim = w.shape
    if kw != k_dim or not supported(k_dim, n_dim, block_n, block_k):
        raise ValueError(f"x {x.shape} and w {w.shape}: inner dims must match and both dims "
                         f"be multiples of {block_k} / {block_n}")
    expert, start, rows = row_blocks(group_sizes.astype(jnp.int32), m)
    swiglu = w2 is not None
    kernel = functools.partial(_kernel, k_dim=k_dim, swiglu=swiglu, block_n=block_n,
                               block_k=block_k)
    args = [expert, start, rows, x, w] + ([w2] if swiglu else [])
    return pl.pallas_call(
        kernel, grid=(expert.shape[0], n_dim // block_n),
        out_shape=jax.ShapeDtypeStruct((m + ROWS, n_dim), x.dtype),
        compiler_params=plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="sfi_moe_swiglu" if swiglu else "sfi_moe_matmul",
    )(*args)


# --------------------------------------------------------------------------- per-expert tiles
# The layout for a decode step of at most 16 tokens (the engine's GPU default): every
# expert's program multiplies all the step's tokens (one 16-row tile) and the routing weights
# select the results, so no sort, gather, group count or row-block plan runs between the
# router and the kernels; untouched experts' programs load no weights.
TOKENS = ROWS  # most tokens per step this path takes (one tl.dot tile)
EXPERTS_PER_PROGRAM = 8  # experts one down-projection program sums (its partials: E / 8)


def _token_swiglu_kernel(used_ref, x_ref, wg_ref, wu_ref, h_ref, *, k_dim, block_n, block_k):
    """Program (e, n): SiLU(x @ gate_e) * (x @ up_e), columns block n, for all 16 (padded)
    tokens; an expert no token uses loads no weights and stores zeros."""
    e, n = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(n * block_n, block_n)
    zero = jnp.zeros((ROWS, block_n), jnp.float32)

    def body(i, acc):
        kk = i * block_k
        x = plgpu_triton.load(x_ref.at[pl.ds(0, ROWS), pl.ds(kk, block_k)])
        return (acc[0] + _dot(x, plgpu_triton.load(wg_ref.at[e, pl.ds(kk, block_k),
                                                                          cols])),
                acc[1] + _dot(x, plgpu_triton.load(wu_ref.at[e, pl.ds(kk, block_k),
                                                                          cols])))

    n_k = (used_ref[e] > 0).astype(jnp.int32) * (k_dim // block_k)
    gate, up = lax.fori_loop(0, n_k, body, (zero, zero))
    dtype = h_ref.dtype
    out = swiglu_rounded(gate, up, dtype)
    plgpu_triton.store(h_ref.at[e, pl.ds(0, ROWS), cols], out)


def _token_down_kernel(used_ref, wts_ref, h_ref, wd_ref, o_ref, *, k_dim, n_experts, per,
                       block_n, block_k):
    """Program (n, g): sum over experts e of group g of wts[e] * (h_e @ down_e), columns
    block n, each expert's product rounded to h's dtype first (as the ragged_dot path does);
    wts [E, 16] holds each token's routing weight (0 where unrouted and for padded tokens)."""
    n, g = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(n * block_n, block_n)

    def expert(j, total):
        e = g * per + j
        live = (e < n_experts) & (used_ref[jnp.minimum(e, n_experts - 1)] > 0)
        e = jnp.minimum(e, n_experts - 1)

        def body(i, acc):
            kk = i * block_k
            h = plgpu_triton.load(h_ref.at[e, pl.ds(0, ROWS), pl.ds(kk, block_k)])
            return acc + _dot(h, plgpu_triton.load(wd_ref.at[e, pl.ds(kk, block_k),
                                                                           cols]))

        n_k = live.astype(jnp.int32) * (k_dim // block_k)
        y = lax.fori_loop(0, n_k, body, jnp.zeros((ROWS, block_n), jnp.float32))
        w = plgpu_triton.load(wts_ref.at[e, pl.ds(0, ROWS)]) * live.astype(jnp.float32)
        return total + w[:, None] * y.astype(h_ref.dtype).astype(jnp.float32)

    total = lax.fori_loop(0, per, expert, jnp.zeros((ROWS, block_n), jnp.float32))
    plgpu_triton.store(o_ref.at[g, pl.ds(0, ROWS), cols], total)


@functools.partial(jax.jit, static_argnames=("interpret", "block_n", "block_k", "num_warps",
                                             "num_stages"))
def token_moe(x, w_gate, w_up, w_down, weights, *, interpret=False, block_n=BLOCK_N,
              block_k=BLOCK_K, num_warps=4, num_stages=3):
    """The routed experts of at most 16 tokens: x [T, H]; weights [T, E] float32 (token t's
    routing weight for expert e, 0 where unrouted); expert weights [E, H, I] (gate, up) and
    [E, I, H] (down). Returns float32 [T, H] = sum_e weights[:, e] * expert_e(x), each expert's
    output rounded to x's dtype (as `models.modeling.moe_mlp` does)."""
    n_tokens, hidden = x.shape
    n_experts, _, inter = w_gate.shape
    if n_tokens > TOKENS:
        raise ValueError(f"token_moe takes at most {TOKENS} tokens, got {n_tokens}")
    if weights.shape != (n_tokens, n_experts):
        raise ValueError(f"weights {weights.shape}: expected {(n_tokens, n_experts)}")
    if not supported(hidden, inter, block_n, block_k):
        raise ValueError(f"expert dims {hidden} x {inter} must be multiples of {block_k} / "
                         f"{block_n}")
    params = plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    # 16 token rows (zeros past T): one tile, no masked rows; weights per expert, [E, 16]
    x16 = jnp.zeros((ROWS, hidden), x.dtype).at[:n_tokens].set(x)
    wts = jnp.zeros((n_experts, ROWS), jnp.float32).at[:, :n_tokens].set(
        weights.astype(jnp.float32).T)
    used = jnp.sum(weights != 0, axis=0).astype(jnp.int32)  # tokens per expert
    h = pl.pallas_call(
        functools.partial(_token_swiglu_kernel, k_dim=hidden, block_n=block_n,
                          block_k=block_k),
        grid=(n_experts, inter // block_n),
        out_shape=jax.ShapeDtypeStruct((n_experts, ROWS, inter), x.dtype),
        compiler_params=params, interpret=interpret, name="sfi_moe_token_swiglu",
    )(used, x16, w_gate, w_up)
    per = EXPERTS_PER_PROGRAM
    groups = pl.cdiv(n_experts, per)
    parts = pl.pallas_call(
        functools.partial(_token_down_kernel, k_dim=inter, n_experts=n_experts, per=per,
                          block_n=block_n, block_k=block_k),
        grid=(hidden // block_n, groups),
        out_shape=jax.ShapeDtypeStruct((groups, ROWS, hidden), jnp.float32),
        compiler_params=params, interpret=interpret, name="sfi_moe_token_down",
    )(used, wts, h, w_down)
    return jnp.sum(parts[:, :n_tokens], axis=0)
