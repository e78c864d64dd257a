"""The selector's radix top-k threshold on NVIDIA Hopper GPUs: Pallas with the Mosaic GPU
lowering (the twin of selector_gpu's `kth_largest_key`, Triton).

One CTA (one warpgroup) per row. Each radix round streams the row from global to shared
memory with TMA (copies of `Config.copy` positions, `stages` in flight; after the first round
the row comes from L2) and counts, a register tile at a time, the keys at or above each of the
round's candidate digits in per-thread registers; one reduction per digit ends the round. So
a round reads the row once, whatever the number of digits. A row whose length 128 does not
divide is padded with zeros, whose keys are then taken off the counts, so no position mask is
needed in the loop.

Off a GPU the kernel runs in Mosaic GPU's interpret mode (`attention_mgpu.interpret_params`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sfi_jax.kernels.attention_mgpu import SMEM_BYTES, compiler_params, interpret_params, load
from sfi_jax.kernels.common import sortable_keys

RADIX_BITS = (1, 2, 4)  # as the Triton twin: 1, 3 or 15 counters per thread and position
_LANES = 128  # threads of the warpgroup: a block is a multiple of them
_COUNTERS = 8192  # candidate counters of a block (digits x positions): 64 registers a thread
_MAX_BLOCK = 4096
_ZERO_KEY = 0x80000000  # sortable_keys(0.0): the key of a pad


def block_of(s_len: int, radix_bits: int, most: int | None = None) -> int:
    """Positions counted at once (the register tile): the largest power of two up to the
    counters' budget (or `most`) that divides the (padded) row, at least one key per thread."""
    digits = (1 << radix_bits) - 1
    top = min(_MAX_BLOCK, _COUNTERS // digits) if most is None else most
    blk = _LANES
    while blk * 2 <= top and s_len % (blk * 2) == 0:
        blk *= 2
    return blk


@dataclasses.dataclass(frozen=True)
class Config:
    """copy: positions per TMA copy (a pipeline step; None: one register tile), counted a
    register tile at a time; stages: copies in flight. More bytes in flight hide more of the
    L2's latency (each round re-reads the row from there)."""

    copy: int | None = None
    stages: int = 3


DEFAULT = Config(copy=8192, stages=3)  # H100 sweep: docs/findings.md


def _layout(shape):
    """The register layout of a block and its counters: each thread holds runs of 4 (one
    128-bit shared-memory load) where the block has enough of them."""
    vec = 4 if shape[0] * shape[1] % (_LANES * 4) == 0 else 1
    return plgpu.Layout.WG_STRIDED(shape, vec_size=vec)


def _zeros(shape, interpret):
    """A zero counter block in the block's layout (interpret mode has no layouts)."""
    z = jnp.zeros(shape, jnp.int32)
    return z if interpret else plgpu.layout_cast(z, _layout(shape))


def _load(x_smem, interpret):
    return x_smem[...] if interpret else load(x_smem, _layout(x_smem.shape))


def _kernel(x_ref, out_ref, *, k, radix_bits, n_copies, copy, tile, pad, stages, interpret):
    """Row n's k-th largest key, radix_bits per round, written to out[n, :] (all lanes)."""
    n = lax.axis_index("n")
    digits = range(1, 1 << radix_bits)
    shape = (tile // _LANES, _LANES)  # a TMA box has at most 256 elements a dimension
    prefix = jnp.uint32(0)  # count(keys >= prefix) >= k holds throughout
    for shift in range(32 - radix_bits, -1, -radix_bits):
        cands = [prefix + jnp.uint32(d << shift) for d in digits]

        def count(_, x_smem, counters, cands=cands):
            def tile_counts(t, counters):
                rows = x_smem.at[pl.ds(t * shape[0], shape[0])]
                keys = sortable_keys(_load(rows, interpret))
                return tuple(c + jnp.where(keys >= cand, 1, 0)
                             for c, cand in zip(counters, cands))

            return lax.fori_loop(0, copy // tile, tile_counts, counters)

        counters = plgpu.emit_pipeline(
            count, grid=(n_copies,),
            in_specs=[pl.BlockSpec((copy // _LANES, _LANES), lambda i: (i, 0))],
            max_concurrent_steps=stages,
            init_carry=tuple(_zeros(shape, interpret) for _ in digits),
        )(x_ref.at[n])
        step = jnp.int32(0)
        for c, cand in zip(counters, cands):
            total = jnp.sum(c)
            if pad:  # the pads' zeros counted where 0.0 is at or above the digit
                total = total - jnp.where(jnp.uint32(_ZERO_KEY) >= cand, pad, 0)
            step = step + jnp.where(total >= k, 1, 0)
        prefix = prefix + (step.astype(jnp.uint32) << shift)

    def store(o_smem):
        o_smem[...] = jnp.broadcast_to(prefix, (_LANES,))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[n])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((_LANES,), jnp.uint32))


@functools.partial(jax.jit, static_argnames=("k", "radix_bits", "interpret", "config"))
def kth_largest_key(scores, k: int, *, radix_bits: int = 2, interpret=False, config=None):
    """The k-th largest sortable key (`kernels.common.sortable_keys`) of each row of float32
    scores [N, S], uint32 [N]: selector_gpu.kth_largest_key's radix search on Mosaic GPU.
    config: a Config (None: DEFAULT)."""
    cfg = config or DEFAULT
    if radix_bits not in RADIX_BITS:
        raise ValueError(f"radix_bits must be one of {RADIX_BITS}, got {radix_bits!r}")
    n_rows, s_len = scores.shape
    if not 1 <= k <= s_len:
        raise ValueError(f"k={k} must be in [1, {s_len}] (the row length)")
    x = scores.astype(jnp.float32)
    pad = -s_len % _LANES
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)))
    size = s_len + pad
    tile = block_of(size, radix_bits)
    copy = tile if cfg.copy is None else max(tile, block_of(size, radix_bits, cfg.copy))
    if copy // _LANES > 256 or cfg.stages < 1 or copy * 4 * cfg.stages > SMEM_BYTES:
        raise ValueError(f"selector_mgpu {cfg}: a copy of at most {256 * _LANES} positions "
                         f"(TMA's 256 rows of 128), at least one stage, and the copies in "
                         f"flight within {SMEM_BYTES} B of shared memory")
    n_copies = size // copy
    x = x.reshape(n_rows, size // _LANES, _LANES)  # [N, S / 128, 128]: no copy
    out = plgpu.kernel(
        functools.partial(_kernel, k=k, radix_bits=radix_bits, n_copies=n_copies, copy=copy,
                          tile=tile, pad=pad, stages=max(1, min(cfg.stages, n_copies)),
                          interpret=interpret),
        out_type=jax.ShapeDtypeStruct((n_rows, _LANES), jnp.uint32),
        grid=(n_rows,), grid_names=("n",),
        compiler_params=compiler_params(),
        interpret=interpret_params() if interpret else False,
    )(x)
    return out[:, 0]
