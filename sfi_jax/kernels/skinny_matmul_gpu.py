"""Weight-streaming matmul for a few rows (a decode step's 1-64 tokens): Pallas with the
Triton lowering.

At decode batch sizes a projection reads its whole weight for a handful of rows, so its time is
the weight's bytes over the bandwidth. XLA's gemm fusions for one row do not stream at that
limit (benchmarks/profile_batch1.md). Here program (j, s) reads one column block of the weight
over one K split, so the grid has enough programs to keep every SM's loads in flight; each
split writes float32 partial sums that the caller's next elementwise fusion adds up.

Optional RMSNorm of the input rows, so the norm costs no launch of its own: each block of the
rows is multiplied by the norm's weight (the product rounded to the input dtype) on its way
into the matmul, and each split also writes its part of the rows' sums of squares; the row scale
applies to the summed product (a per-row factor commutes with the product). Optional second
weight of the same shape (gate and up projections): both read with one load of the input block.
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
MODES = ("dot", "fma", "fma_defer")
MAX_ROWS = 64
_SMEM_BYTES = 200 * 1024  # of the H100/H200's 227 KiB per block, some left to Triton


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning knobs: block_n, block_k powers of two >= 16; programs the grid size aimed for;
    mode how a tile is multiplied: "dot" (tl.dot, rows padded to 16), "fma" (multiply-adds in
    registers, rows padded to a power of two, reduced over the tile's K every block) or
    "fma_defer" (the same, summed over K once at the end: more registers, no per-block
    reduction across threads)."""

    block_n: int = 256
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    programs: int = 4 * _NUM_SMS
    mode: str = "dot"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


def default_config(n: int, k: int, rows: int = 1) -> Config:
    """The H200 sweeps' best (benchmarks/skinny_matmul.md). Out of the hidden state (q/k/v,
    gate/up: N > K): 256 x 32 tiles multiplied in registers for one row, 256 x 64 tl.dot tiles
    on 2 stages for more (the register product grows with the rows). Into it (o, down: N < K):
    128 x 64 tiles on 8 programs per SM up to K = 4096, 128 x 128 on 2 per SM beyond."""
    if n < k:
        if k <= 4096:
            return Config(block_n=128, block_k=64, num_warps=4, num_stages=2,
                          programs=8 * _NUM_SMS)
        return Config(block_n=128, block_k=128, num_warps=4, num_stages=4, programs=2 * _NUM_SMS)
    if rows == 1:
        return Config(block_n=256, block_k=32, num_warps=4, num_stages=3, programs=4 * _NUM_SMS,
                      mode="fma")
    return Config(block_n=256, block_k=64, num_warps=4, num_stages=2, programs=4 * _NUM_SMS)


def _pow2(n):
    return 1 << max(int(n) - 1, 0).bit_length()


def plan(n: int, k: int, config: Config) -> tuple[int, int]:
    """(K per split, a multiple of block_k; number of splits) for an [k, n] weight."""
    bk = config.block_k
    n_blocks = -(-n // config.block_n)
    want = max(1, min(-(-config.programs // n_blocks), -(-k // bk)))
    k_split = -(-(-(-k // want)) // bk) * bk
    return k_split, -(-k // k_split)


def _kernel(x_ref, nw_ref, *refs, n_w, rows, n_rows, k, n, bn, bk, k_split, normed,
            precision, mode):
    w_refs, o_refs = refs[:n_w], refs[n_w:]
    j, s = pl.program_id(0), pl.program_id(1)
    rmask = jnp.arange(rows) < n_rows
    cmask = j * bn + jnp.arange(bn) < n
    idx = jnp.arange(bk)
    start = s * k_split
    n_iter = pl.cdiv(jnp.minimum(k_split, k - start), bk)

    def body(i, carry):
        accs, sq = carry
        k0 = start + i * bk
        kmask = k0 + idx < k
        xb = plgpu_triton.load(x_ref.at[pl.ds(0, rows), pl.ds(k0, bk)],
                               mask=rmask[:, None] & kmask[None, :], other=0.0)
        if normed:  # the norm's weight now, its row scale after the sum over splits
            xf = xb.astype(jnp.float32)
            sq = sq + xf * xf
            nw = plgpu_triton.load(nw_ref.at[pl.ds(k0, bk)], mask=kmask, other=0.0)
            xb = (xf * nw.astype(jnp.float32)[None, :]).astype(x_ref.dtype)
        xb = xb.astype(w_refs[0].dtype)
        if mode != "dot":  # the rows as a column per row, broadcast over the tile's columns
            xcol = xb.astype(jnp.float32)[:, :, None]
        out = []
        for w_ref, acc in zip(w_refs, accs):
            wb = plgpu_triton.load(w_ref.at[pl.ds(k0, bk), pl.ds(j * bn, bn)],
                                   mask=kmask[:, None] & cmask[None, :], other=0.0)
            if mode == "dot":
                out.append(acc + plgpu_triton.dot(xb, wb, precision=precision))
            elif mode == "fma":
                out.append(acc + jnp.sum(xcol * wb.astype(jnp.float32)[None], axis=1))
            else:
                out.append(acc + xcol * wb.astype(jnp.float32)[None])
        return tuple(out), sq

    zeros = jnp.zeros((rows, bk, bn) if mode == "fma_defer" else (rows, bn), jnp.float32)
    accs, sq = lax.fori_loop(0, n_iter, body, (tuple(zeros for _ in w_refs),
                                               jnp.zeros((rows, bk) if normed else (1, 1),
                                                         jnp.float32)))
    if mode == "fma_defer":
        accs = tuple(jnp.sum(acc, axis=1) for acc in accs)
    for o_ref, acc in zip(o_refs[:n_w], accs):
        plgpu_triton.store(o_ref.at[s, pl.ds(0, rows), pl.ds(j * bn, bn)], acc,
                           mask=rmask[:, None] & cmask[None, :])
    if normed:  # this split's sum of squares of the rows, once (by the first column block)
        plgpu_triton.store(o_refs[n_w].at[s, pl.ds(0, rows)], jnp.sum(sq, axis=1),
                           mask=rmask & (j == 0))


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _fit(cfg: Config, rows: int, n_w: int, x_bytes: int, w_bytes: int) -> Config:
    """A config whose pipelined tiles fit in shared memory: fewer stages (down to 2), then a
    smaller block_k (float32 weights, two weights)."""
    cfg = dataclasses.replace(cfg, block_k=max(16, cfg.block_k))
    while True:
        stage = cfg.block_k * (rows * x_bytes + n_w * cfg.block_n * w_bytes)
        if stage * cfg.num_stages <= _SMEM_BYTES:
            return cfg
        if cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 16:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        else:
            return dataclasses.replace(cfg, num_stages=1)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def skinny_matmul_partials(x, weights, norm=None, *, interpret=False, config=None):
    """Float32 partial sums of x [R, K] times each weight [K, N] (one or two of one shape):
    a tuple of [splits, R, N], one per weight, whose sums over axis 0 are the products.

    With `norm` [K] the rows are multiplied by it before the product, and the tuple ends with
    the rows' float32 sums of squares per split [splits, R]: the RMSNorm's row scale
    rsqrt(sum / K + eps) applies to the summed product (`skinny_matmul.skinny_matmul`).
    config: a Config (None: `default_config` for the weight's shape)."""
    n_rows, k = x.shape
    if n_rows > MAX_ROWS:
        raise ValueError(f"skinny_matmul takes at most {MAX_ROWS} rows, got {n_rows}")
    shape = weights[0].shape
    if any(w.shape != shape for w in weights) or len(weights) not in (1, 2):
        raise ValueError(f"expected one or two weights of one shape, got "
                         f"{[w.shape for w in weights]}")
    if shape[0] != k:
        raise ValueError(f"x [{n_rows}, {k}] does not match weight {shape}")
    n = shape[1]
    cfg = config or default_config(n, k, n_rows)
    rows = _pow2(n_rows) if cfg.mode != "dot" else max(_MIN_ROWS, _pow2(n_rows))
    cfg = dataclasses.replace(cfg, block_n=min(cfg.block_n, max(16, _pow2(n))),
                              block_k=min(cfg.block_k, max(16, _pow2(k))))
    cfg = _fit(cfg, rows, len(weights), x.dtype.itemsize, weights[0].dtype.itemsize)
    k_split, n_splits = plan(n, k, cfg)
    normed = norm is not None
    kernel = functools.partial(
        _kernel, n_w=len(weights), rows=rows, n_rows=n_rows, k=k, n=n, bn=cfg.block_n,
        bk=cfg.block_k, k_split=k_split, normed=normed, precision=_precision(weights[0].dtype),
        mode=cfg.mode)
    out = [jax.ShapeDtypeStruct((n_splits, n_rows, n), jnp.float32)] * len(weights)
    if normed:
        out.append(jax.ShapeDtypeStruct((n_splits, n_rows), jnp.float32))
    return tuple(pl.pallas_call(
        kernel, grid=(pl.cdiv(n, cfg.block_n), n_splits), out_shape=out,
        compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps,
                                                    num_stages=cfg.num_stages),
        interpret=interpret, name="sfi_skinny_matmul",
    )(x, norm if normed else jnp.zeros((1,), x.dtype), *weights))
