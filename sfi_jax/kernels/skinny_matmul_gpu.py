"""Weight-streaming matmul for a few rows (a decode step's 1-64 tokens): Pallas with the
Triton lowering.

At decode batch sizes a projection reads its whole weight for a handful of rows, so its time is
the weight's bytes over the bandwidth. XLA's gemm fusions for one row do not stream at that
limit (benchmarks/profile_batch1.md). Here program (j, s) reads one column block of the weight
over one K split, so the grid has enough programs to keep every SM's loads in flight; each
split writes float32 partial sums that the caller's next elementwise fusion adds up.

Optional prologue: the RMSNorm of the input rows (their float32 sum of squares over the whole
row, then the normed block rounded to the input dtype as `models.modeling.rms_norm` rounds it),
so the norm costs no launch of its own. Optional second weight of the same shape (gate and up
projections): both read with one load of the input block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sfi_jax.kernels.triton_lowering import NUM_SMS as _NUM_SMS, plgpu_triton

_MIN_ROWS = 16  # smallest M of tl.dot
MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning knobs: block_n, block_k powers of two >= 16; programs the grid size aimed for."""

    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    programs: int = 4 * _NUM_SMS


def _pow2(n):
    return 1 << max(int(n) - 1, 0).bit_length()


def plan(n: int, k: int, config: Config) -> tuple[int, int]:
    """(K per split, a multiple of block_k; number of splits) for an [k, n] weight."""
    bk = config.block_k
    n_blocks = -(-n // config.block_n)
    want = max(1, min(-(-config.programs // n_blocks), -(-k // bk)))
    k_split = -(-(-(-k // want)) // bk) * bk
    return k_split, -(-k // k_split)


def _kernel(x_ref, nw_ref, *refs, n_w, rows, n_rows, k, n, bn, bk, k_split, normed, eps,
            trans, precision):
    w_refs, o_refs = refs[:n_w], refs[n_w:]
    j, s = pl.program_id(0), pl.program_id(1)
    r = jnp.arange(rows)
    rmask = r < n_rows
    cols = j * bn + jnp.arange(bn)
    cmask = cols < n
    idx = jnp.arange(bk)

    def x_block(k0):
        m = rmask[:, None] & (k0 + idx < k)[None, :]
        return plgpu_triton.load(x_ref.at[pl.ds(0, rows), pl.ds(k0, bk)], mask=m, other=0.0)

    if normed:
        def sum_squares(i, acc):
            xb = x_block(i * bk).astype(jnp.float32)
            return acc + jnp.sum(xb * xb, axis=1)

        ss = lax.fori_loop(0, pl.cdiv(k, bk), sum_squares, jnp.zeros((rows,), jnp.float32))
        inv = lax.rsqrt(ss / k + eps)

    start = s * k_split
    n_iter = pl.cdiv(jnp.minimum(k_split, k - start), bk)

    def body(i, accs):
        k0 = start + i * bk
        kmask = k0 + idx < k
        xb = x_block(k0)
        if normed:
            nw = plgpu_triton.load(nw_ref.at[pl.ds(k0, bk)], mask=kmask, other=0.0)
            xb = (xb.astype(jnp.float32) * inv[:, None]
                  * nw.astype(jnp.float32)[None, :]).astype(x_ref.dtype)
        xb = xb.astype(w_refs[0].dtype)
        out = []
        for w_ref, acc in zip(w_refs, accs):
            if trans:  # weight [n, k]: the tied output head read from the embedding
                wb = plgpu_triton.load(w_ref.at[pl.ds(j * bn, bn), pl.ds(k0, bk)],
                                       mask=cmask[:, None] & kmask[None, :], other=0.0)
                out.append(acc + plgpu_triton.dot(xb, wb, trans_b=True, precision=precision))
            else:
                wb = plgpu_triton.load(w_ref.at[pl.ds(k0, bk), pl.ds(j * bn, bn)],
                                       mask=kmask[:, None] & cmask[None, :], other=0.0)
                out.append(acc + plgpu_triton.dot(xb, wb, precision=precision))
        return tuple(out)

    accs = lax.fori_loop(0, n_iter, body,
                         tuple(jnp.zeros((rows, bn), jnp.float32) for _ in w_refs))
    for o_ref, acc in zip(o_refs, accs):
        plgpu_triton.store(o_ref.at[s, pl.ds(0, rows), pl.ds(j * bn, bn)], acc,
                           mask=rmask[:, None] & cmask[None, :])


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


@functools.partial(jax.jit, static_argnames=("eps", "transpose_w", "interpret", "config"))
def skinny_matmul_partials(x, weights, norm=None, *, eps=1e-6, transpose_w=False,
                           interpret=False, config=None):
    """Float32 partial sums [splits, R, N] of x [R, K] (RMS-normed by `norm` [K] first, when
    given) times each weight [K, N] ([N, K] with transpose_w); their sum over axis 0 is the
    product. weights: a tuple of one or two same-shape weights; returns a tuple to match."""
    n_rows, k = x.shape
    if n_rows > MAX_ROWS:
        raise ValueError(f"skinny_matmul takes at most {MAX_ROWS} rows, got {n_rows}")
    shape = weights[0].shape
    if any(w.shape != shape for w in weights) or len(weights) not in (1, 2):
        raise ValueError(f"expected one or two weights of one shape, got "
                         f"{[w.shape for w in weights]}")
    n = shape[0] if transpose_w else shape[1]
    if (shape[1] if transpose_w else shape[0]) != k:
        raise ValueError(f"x [{n_rows}, {k}] does not match weight {shape}"
                         f"{' (transposed)' if transpose_w else ''}")
    cfg = config or Config()
    bn = min(cfg.block_n, max(16, _pow2(n)))
    bk = min(cfg.block_k, max(16, _pow2(k)))
    cfg = dataclasses.replace(cfg, block_n=bn, block_k=bk)
    k_split, n_splits = plan(n, k, cfg)
    rows = max(_MIN_ROWS, _pow2(n_rows))
    normed = norm is not None
    kernel = functools.partial(
        _kernel, n_w=len(weights), rows=rows, n_rows=n_rows, k=k, n=n, bn=bn, bk=bk,
        k_split=k_split, normed=normed, eps=float(eps), trans=transpose_w,
        precision=_precision(weights[0].dtype))
    out = jax.ShapeDtypeStruct((n_splits, n_rows, n), jnp.float32)
    return tuple(pl.pallas_call(
        kernel, grid=(pl.cdiv(n, bn), n_splits), out_shape=[out] * len(weights),
        compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps,
                                                    num_stages=cfg.num_stages),
        interpret=interpret, name="sfi_skinny_matmul",
    )(x, norm if normed else jnp.zeros((1,), x.dtype), *weights))
