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

from sfi_jax.kernels.attention_mgpu import (M_INIT, SMEM_BYTES, compiler_params,
                                            interpret_params, load)
from sfi_jax.kernels.common import sortable_keys
from sfi_jax.kernels.selector_reference import merge_chunk_fusion, merge_chunk_lse, prior_terms

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


def _const(value, shape, interpret, dtype=jnp.float32):
    """A constant block in the blocks' register layout (interpret mode has no layouts)."""
    x = jnp.full(shape, value, dtype)
    return x if interpret else plgpu.layout_cast(x, _layout(shape))


def _read(ref, interpret):
    """A shared-memory block into registers, in the blocks' layout."""
    return ref[...] if interpret else load(ref, _layout(ref.shape))


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
                keys = sortable_keys(_read(rows, interpret))
                return tuple(c + jnp.where(keys >= cand, 1, 0)
                             for c, cand in zip(counters, cands))

            return lax.fori_loop(0, copy // tile, tile_counts, counters)

        counters = plgpu.emit_pipeline(
            count, grid=(n_copies,),
            in_specs=[pl.BlockSpec((copy // _LANES, _LANES), lambda i: (i, 0))],
            max_concurrent_steps=stages,
            init_carry=tuple(_const(0, shape, interpret, jnp.int32) for _ in digits),
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


# ------------------------------------------------------------------- scores (steps 1-4)
# The twin of selector_gpu.base_scores: three passes, each one CTA per (n, KV head, chunk of
# positions), the chunks' partials merged by a few XLA ops in between (as the Triton kernels
# merge theirs). A chunk streams its positions by TMA as [lines, 128] tiles (the R query rows'
# [R, lines, 128]) through `emit_pipeline`, keeping its running sums per thread and position
# and reducing them once at its end. Passes 1 and 2 skip chunks outside J.


@dataclasses.dataclass(frozen=True)
class ScoresConfig:
    """lines: rows of 128 positions per TMA copy (None: up to 32 / R, at most 16); copies:
    copies per chunk (a CTA), at most; stages: copies in flight."""

    lines: int | None = None
    copies: int = 8
    stages: int = 2


def scores_supported(logits) -> bool:
    """float32 logits [N, M, H, R, S] with S a multiple of 128 (whole TMA rows) and R <= 128."""
    return (logits.ndim == 5 and jnp.dtype(logits.dtype) == jnp.float32
            and logits.shape[-1] % _LANES == 0 and logits.shape[3] <= _LANES)


class _Geo:
    """A call's static chunking: `lines` rows of 128 positions per copy, `cpc` copies per
    chunk, `n_chunks` chunks over S."""

    def __init__(self, r, s_len, cfg):
        total = s_len // _LANES
        most = cfg.lines or max(1, min(16, 32 // r))
        self.lines = 1
        while self.lines * 2 <= most and total % (self.lines * 2) == 0:
            self.lines *= 2
        n_copies = total // self.lines
        self.cpc = max(j for j in range(1, min(cfg.copies, n_copies) + 1) if n_copies % j == 0)
        self.copy = self.lines * _LANES
        self.chunk = self.copy * self.cpc
        self.n_chunks = s_len // self.chunk
        self.stages = max(1, min(cfg.stages, self.cpc))


def _iota2(shape, dim, interpret):
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=_layout(shape))


def _positions(start, shape, interpret):
    """Positions [lines, 128] of a tile starting at position `start`."""
    return (start + _iota2(shape, 0, interpret) * _LANES + _iota2(shape, 1, interpret))


def _write_scalars(values, out_ref, at):
    """Scalars values[k] to out_ref.at[at] [K, 128], each broadcast over its row (the store the
    top-k kernel makes), through shared memory."""
    def store(o_smem):
        for k, v in enumerate(values):
            o_smem.at[k][...] = jnp.broadcast_to(v, (_LANES,))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[at])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((len(values), _LANES), jnp.float32))


def _chunk(geo, lo, hi):
    """Chunk c's first position, and whether it meets J = [lo, hi)."""
    c0 = lax.axis_index("c") * geo.chunk
    return c0, (c0 < hi) & (c0 + geo.chunk > lo)


def _tile_spec(geo, lead=()):
    """A copy's block of a [..., S / 128, 128] view: copy i of chunk c."""
    c = lax.axis_index("c")
    zeros = (0,) * len(lead)
    return pl.BlockSpec((*lead, geo.lines, _LANES), lambda i: (*zeros, c * geo.cpc + i, 0))


def _row_stats_kernel(idx_ref, lo_ref, hi_ref, x_ref, out_ref, *, geo, r, interpret):
    """Chunk c of J: each query row's running max and sum of exp (its log-sum-exp's
    partials), to out [N, H, C, 2 R, 128]: rows 2 i and 2 i + 1 are row i's (m, l)."""
    n, h, c = (lax.axis_index(a) for a in "nhc")
    lo, hi = lo_ref[n], hi_ref[n]
    c0, live = _chunk(geo, lo, hi)
    shape = (geo.lines, _LANES)

    def body(idx, x_smem, carry):
        inj = _in_j(c0 + idx[0] * geo.copy, shape, lo, hi, interpret)
        out = []
        for i in range(r):
            m, l = carry[2 * i], carry[2 * i + 1]
            x = jnp.where(inj, _read(x_smem.at[i], interpret), -jnp.inf)
            m_new = jnp.maximum(m, x)
            out += [m_new, l * jnp.exp(m - m_new) + jnp.exp(x - m_new)]
        return tuple(out)

    @pl.when(live)
    def _stream():
        init = tuple(_const(v, shape, interpret) for _ in range(r) for v in (M_INIT, 0.0))
        carry = plgpu.emit_pipeline(body, grid=(geo.cpc,), in_specs=[_tile_spec(geo, (r,))],
                                    max_concurrent_steps=geo.stages, init_carry=init,
                                    )(x_ref.at[n, idx_ref[0], h])
        vals = []
        for i in range(r):
            m, l = carry[2 * i], carry[2 * i + 1]
            mx = jnp.max(m)
            vals += [mx, jnp.sum(l * jnp.exp(m - mx))]
        _write_scalars(vals, out_ref, (n, h, c))

    @pl.when(~live)
    def _outside():
        _write_scalars([M_INIT, 0.0] * r, out_ref, (n, h, c))


def _fusion_stats_kernel(idx_ref, lo_ref, hi_ref, lse_ref, x_ref, kn_ref, stats_ref, g_ref,
                         *pi_ref, geo, r, params, interpret):
    """Chunk c of J: g = log(sum_r p_r^a) / a and the prior pi per position (stored for pass
    3), and the chunk's max of g and sums of exp(g - max), exp(2 (g - max)),
    exp(g - max) pi, pi, pi^2 (the evidence normaliser's and f.f, f.r, r.r's partials), to
    stats [N, H, C, 6, 128]."""
    n, h, c = (lax.axis_index(a) for a in "nhc")
    lo, hi = lo_ref[n], hi_ref[n]
    c0, live = _chunk(geo, lo, hi)
    shape = (geo.lines, _LANES)
    a, with_prior = params.power_alpha, params.lam_clip > 0.0
    lse = [lse_ref[n, h, i] for i in range(r)]

    def body(idx, x_smem, *refs, tiles):
        *smem, carry = refs
        kn_smem = smem[0] if with_prior else None
        gm, s1, s2, s3, p1, p2 = carry
        rows = pl.ds(_line0(geo, idx[0]), geo.lines)
        start = c0 + idx[0] * geo.copy
        inj = _in_j(start, shape, lo, hi, interpret)
        mu = sum(jnp.exp(a * (jnp.where(inj, _read(x_smem.at[i], interpret), -jnp.inf) - lse[i]))
                 for i in range(r))
        ok = inj & (mu > 0)
        g = jnp.where(ok, jnp.log(jnp.where(ok, mu, 1.0)) / a, -jnp.inf)
        _store_tile(g, tiles.at[0], g_ref.at[n, h, rows])
        gm_new = jnp.maximum(gm, jnp.where(ok, g, M_INIT))
        sc = jnp.exp(gm - gm_new)
        e = jnp.where(ok, jnp.exp(g - gm_new), 0.0)
        s1, s2 = s1 * sc + e, s2 * sc * sc + e * e
        if with_prior:
            pos = _positions(start, shape, interpret)
            pi = prior_terms(_read(kn_smem, interpret), pos, inj, lo, hi, params)
            _store_tile(pi, tiles.at[1], pi_ref[0].at[n, h, rows])
            s3, p1, p2 = s3 * sc + e * pi, p1 + pi, p2 + pi * pi
        return gm_new, s1, s2, s3, p1, p2

    def stream(tiles):
        init = tuple(_const(v, shape, interpret) for v in (M_INIT, 0.0, 0.0, 0.0, 0.0, 0.0))
        ins = [x_ref.at[n, idx_ref[0], h]] + ([kn_ref.at[n, idx_ref[1], h]] if with_prior else [])
        return plgpu.emit_pipeline(
            functools.partial(body, tiles=tiles), grid=(geo.cpc,),
            in_specs=[_tile_spec(geo, (r,))] + [_tile_spec(geo)] * with_prior,
            max_concurrent_steps=geo.stages, init_carry=init)(*ins)

    @pl.when(live)
    def _stream():
        gm, s1, s2, s3, p1, p2 = pl.run_scoped(stream, plgpu.SMEM((2, *shape), jnp.float32))
        top = jnp.max(gm)
        w = jnp.exp(gm - top)
        _write_scalars([top, jnp.sum(s1 * w), jnp.sum(s2 * w * w), jnp.sum(s3 * w),
                        jnp.sum(p1), jnp.sum(p2)], stats_ref, (n, h, c))

    @pl.when(~live)
    def _outside():
        _write_scalars([M_INIT, 0.0, 0.0, 0.0, 0.0, 0.0], stats_ref, (n, h, c))


def _write_scores_kernel(lo_ref, hi_ref, fuse_ref, g_ref, *refs, geo, params, interpret):
    """Chunk c of all positions: z = log((1 - lambda) f + lambda r + eps) in J, -inf outside,
    from pass 2's g and pi and the merged (max g, 1 / normalisers, lambda)."""
    with_prior = params.lam_clip > 0.0
    pi_ref, z_ref = refs if with_prior else (None, refs[0])
    n, h = lax.axis_index("n"), lax.axis_index("h")
    lo, hi = lo_ref[n], hi_ref[n]
    c0, _ = _chunk(geo, lo, hi)
    gm, inv_s1, inv_p1, lam = (fuse_ref[n, h, k] for k in range(4))
    shape = (geo.lines, _LANES)

    def body(idx, g_smem, *refs, tile):
        pi_smem = refs[0] if with_prior else None
        inj = _in_j(c0 + idx[0] * geo.copy, shape, lo, hi, interpret)
        g = jnp.where(inj, _read(g_smem, interpret), -jnp.inf)  # (outside J never written)
        ok = inj & (g > -jnp.inf)
        s = (1.0 - lam) * jnp.where(ok, jnp.exp(jnp.where(ok, g, gm) - gm) * inv_s1, 0.0)
        if with_prior:
            s = s + lam * jnp.where(inj, _read(pi_smem, interpret), 0.0) * inv_p1
        _store_tile(jnp.where(inj, jnp.log(s + params.eps), -jnp.inf), tile,
                    z_ref.at[n, h, pl.ds(_line0(geo, idx[0]), geo.lines)])

    def stream(tile):
        ins = [g_ref.at[n, h]] + ([pi_ref.at[n, h]] if with_prior else [])
        plgpu.emit_pipeline(functools.partial(body, tile=tile), grid=(geo.cpc,),
                            in_specs=[_tile_spec(geo)] * len(ins),
                            max_concurrent_steps=geo.stages)(*ins)

    pl.run_scoped(stream, plgpu.SMEM(shape, jnp.float32))


def _store_tile(value, tile_smem, dst):
    """value [lines, 128] to dst (a GMEM tile) through tile_smem. (emit_pipeline's own output
    blocks are stored under a predicate that interpret mode does not take.)"""
    tile_smem[...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile_smem, dst)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (the tile is free again)


def _line0(geo, i):
    return pl.multiple_of((lax.axis_index("c") * geo.cpc + i) * geo.lines, geo.lines)


def _in_j(start, shape, lo, hi, interpret):
    pos = _positions(start, shape, interpret)
    return (pos >= lo) & (pos < hi)


@functools.partial(jax.jit, static_argnames=("params", "interpret", "config"))
def base_scores(logits, key_norms, lo, hi, slot, row, *, params, interpret=False, config=None):
    """z [N, H, S] float32 of SFI_METHOD.md §4 steps 1-4 (-inf outside J = [lo[n], hi[n])):
    selector_gpu.base_scores's contract (without its pads). logits [N, M, H, R, S] float32
    read at index `slot` of axis 1, key_norms [N, B, H, S] at `row`, both in place; S a
    multiple of 128 (`scores_supported`). config: a ScoresConfig (None: its defaults)."""
    n_sets, _, hkv, r, s_len = logits.shape
    if not scores_supported(logits) or key_norms.shape[0] != n_sets or \
            key_norms.shape[2:] != (hkv, s_len):
        raise ValueError(f"mosaic_gpu base_scores takes float32 logits [N, M, H, R <= 128, S] "
                         f"with S a multiple of {_LANES} and key_norms [N, B, H, S]; got "
                         f"{logits.dtype} {logits.shape} and {key_norms.shape}")
    geo = _Geo(r, s_len, config or ScoresConfig())
    lines = s_len // _LANES
    x = logits.reshape(logits.shape[:4] + (lines, _LANES))
    kn = key_norms.astype(jnp.float32).reshape(key_norms.shape[:3] + (lines, _LANES))
    idx = jnp.stack([jnp.asarray(slot, jnp.int32), jnp.asarray(row, jnp.int32)])
    lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
    f32 = jnp.float32
    kw = dict(grid=(n_sets, hkv, geo.n_chunks), grid_names=("n", "h", "c"),
              compiler_params=compiler_params(),
              interpret=interpret_params() if interpret else False)
    common = dict(geo=geo, interpret=interpret)
    part = plgpu.kernel(
        functools.partial(_row_stats_kernel, r=r, **common),
        out_type=jax.ShapeDtypeStruct((n_sets, hkv, geo.n_chunks, 2 * r, _LANES), f32),
        **kw)(idx, lo, hi, x)
    lse = merge_chunk_lse(part[..., 0::2, 0], part[..., 1::2, 0])
    per_position = jax.ShapeDtypeStruct((n_sets, hkv, lines, _LANES), f32)
    with_prior = params.lam_clip > 0.0
    stats, *g_pi = plgpu.kernel(
        functools.partial(_fusion_stats_kernel, r=r, params=params, **common),
        out_type=[jax.ShapeDtypeStruct((n_sets, hkv, geo.n_chunks, 6, _LANES), f32),
                  per_position] + [per_position] * with_prior,
        **kw)(idx, lo, hi, lse, x, kn)
    fuse = merge_chunk_fusion(stats[..., 0], params.lam_clip)
    z = plgpu.kernel(functools.partial(_write_scores_kernel, params=params, **common),
                     out_type=per_position, **kw)(lo, hi, fuse, *g_pi)
    return z.reshape(n_sets, hkv, s_len)
