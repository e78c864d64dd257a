"""Split-K flash-decoding kernels for NVIDIA Hopper GPUs: Pallas with the Mosaic GPU lowering.

The Mosaic GPU twins of the dense and sparse decode kernels of attention_gpu (Triton).
Layout: one CTA (one warpgroup) per (query row, KV head, split). The KV head's query group is
the M dimension of wgmma: 64 rows, padded with zeros (with zero_fill: those past the group
read as TMA's zeros, `copy_q`). The CTA streams the key and value blocks of its
split that lie inside the row's valid range from global to shared memory with TMA, `stages`
blocks in flight, runs q·Kᵀ and P·V on the tensor cores and keeps the online softmax in
registers. Each split writes a partial (acc, m, l) through shared memory that reuses the main
loop's (so a 64-key, two-stage CTA takes 88 KiB at head dim 128: two fit an SM); an exact
merge (jnp) follows.

Only half-precision caches with head dim 64, 128 or 256 and GQA groups up to 64 are taken
(`supported`); the public API sends other inputs (float32 caches: wgmma would round them to
TF32) to the Triton kernels. Off a GPU the kernels run in Mosaic GPU's interpret mode, where TMA
reads past an array's end give zeros, as on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sfi_jax.kernels.common import as_layer_stacks, decode_splits, row_split

_M = 64  # wgmma's M per warpgroup: a query group is padded to this
M_INIT = -1e30  # the running max's start: finite, so exp(m_old - m_new) is never NaN
_NUM_SMS = 132
HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Config:
    """block_k: keys per pipeline step (a multiple of 64); stages: blocks in flight;
    programs: the grid size aimed for (splits = programs / (rows * KV heads))."""

    block_k: int = 128
    stages: int = 2
    programs: int = 2 * _NUM_SMS
    by_length: bool = True  # dense: a row's splits share its own length (attention_gpu's)
    # with logits: shared-memory score blocks, so a block's scores are written while the
    # last block's store may still be reading its own (1: each write waits for that store)
    score_buffers: int = 1
    # P·V's left operand straight from registers (wgmma takes a register A), no shared-memory
    # copy of p: one store and fence less a block, and 8-16 KiB less a CTA (more CTAs an SM)
    p_regs: bool = False
    # programs = the SM count, and the split plan whose busiest SM finishes first
    # (`decode_splits` with `fixed_keys`): no few programs left to run after a wave, no SMs
    # left idle by too few splits
    whole_wave: bool = False


# Splits planned over the 132 SMs (whole_wave: 8 KV heads x 16), 64-key blocks two in
# flight, P·V from registers: the fastest of the H100 sweep for the dense read, with and
# without logits, at batch 1 and 16, and for the sparse read (benchmarks/kernels.md,
# 2026-12-07): fewer splits cost fewer CTAs' fixed time and partials to merge, and a grid of
# a wave and a few programs more takes two waves' time.
DENSE = Config(block_k=64, stages=2, programs=_NUM_SMS, p_regs=True, whole_wave=True)
DENSE_LOGITS = DENSE
SPARSE = DENSE


def interpret_params():
    """Mosaic GPU interpret mode as the kernels expect it: TMA reads past an array's end give
    zeros, as the hardware's bounds fill does."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")


def compiler_params(approx_math=False, lane=False):
    """Mosaic GPU compiler params with the lowering semantics pinned: jax 0.10 lowers with
    Lane semantics by default and jax 0.11 with Warpgroup semantics (layout inference), so a
    kernel lowered for CUDA on a CPU here (0.10) is lowered as on the GPU (0.11). Warpgroup,
    except for a kernel written for Lane's explicit layouts (lane=True: the matmul's fused
    epilogues, whose layouts Warpgroup inference finds no solution for)."""
    semantics = plgpu.LoweringSemantics.Lane if lane else plgpu.LoweringSemantics.Warpgroup
    return plgpu.CompilerParams(approx_math=approx_math, lowering_semantics=semantics)


# jax 0.11's plgpu.kernel writes a `jax.new_ref` operand in place, with no copy; jax 0.10.2 fails
# to trace one (docs/findings.md). The sparse read's in-kernel new-token stores need it.
KERNEL_REFS = jax.__version_info__ >= (0, 11)


def stores_in_kernel(interpret) -> bool:
    """Whether `sparse_decode(new_kv=...)` can run: jax 0.11 on, compiled (interpret mode's
    kernel is given no refs)."""
    return KERNEL_REFS and not interpret


# jax 0.10's plgpu.load takes the index as its second argument; 0.11 deprecates it (the ref
# comes indexed)
_LOAD_TAKES_INDEX = (inspect.signature(plgpu.load).parameters["idx"].default
                     is inspect.Parameter.empty)


def load(ref, layout, optimized=True):
    """All of ref (a shared-memory ref) into registers in `layout`, on jax 0.10 and 0.11."""
    if _LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def rows8_of(m):
    """A few rows as TMA copies them: a whole number of (8, 64) tiles."""
    return -(-m // 8) * 8


def pad_rows8(a, zero_fill):
    """a [m, ...] padded with zero rows to rows8_of(m), unless the kernel's TMA copies read
    those rows past a's end, filled with zeros (zero_fill: no XLA pad)."""
    m = a.shape[0]
    if zero_fill or rows8_of(m) == m:
        return a
    return jnp.pad(a, ((0, rows8_of(m) - m),) + ((0, 0),) * (a.ndim - 1))


def supported(q, k, ck=None) -> bool:
    """Whether the tensor-core kernels take these inputs (else the Triton twin runs): half
    precision, head dim 64/128/256, GQA groups up to 64, a cache length S a multiple of 8 (TMA
    into the tiled shared memory wgmma reads tiles the global array's key axis by 8) and a
    compact buffer whose Hkv * C is (its heads are read as one key axis)."""
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-3]
    return (jnp.dtype(k.dtype) in HALF and d in (64, 128, 256) and hq // hkv <= _M
            and k.shape[-2] % 8 == 0 and (ck is None or hkv * ck.shape[-2] % 8 == 0))


def _swizzle(d, itemsize):
    return min(128, d * itemsize)


def _smem_kv(shape, dtype):
    itemsize = jnp.dtype(dtype).itemsize
    sw = _swizzle(shape[-1], itemsize)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, sw // itemsize)),
                                                plgpu.SwizzleTransform(sw)))


SMEM_BYTES = 223 * 1024  # of the 227 KiB one CTA may take on Hopper: barriers, alignment aside


def smem_bytes(cfg, d, itemsize=2, logits=False):
    """Shared memory of one CTA: its main loop's K/V stages, q, p (and score blocks), then
    (the same memory, reused) the f32 partial and its m, l on their way out."""
    main = (2 * cfg.stages * cfg.block_k * d * itemsize + _M * d * itemsize
            + (not cfg.p_regs) * _M * cfg.block_k * itemsize
            + logits * cfg.score_buffers * _M * cfg.block_k * 4)
    return max(main, _M * d * 4 + 2 * _M * 4)


def plan_keys(cfg, d, dtype):
    """`decode_splits`' fixed_keys for cfg: with whole_wave, a program's fixed cost (its
    launch, barriers, the query's copy, its partial's store: about 3 us on an H100, the
    time an SM streams 64 KiB; benchmarks/kernels.md) in keys of head dim d; else None."""
    if not cfg.whole_wave:
        return None
    return max(1, (64 << 10) // (2 * d * jnp.dtype(dtype).itemsize))


def fit(cfg, d, logits=False):
    """cfg with fewer stages, then 64-key blocks, until one CTA's shared memory fits (a
    default tuned at d 128 applied to d 256)."""
    return shrink_to_fit(cfg, lambda c: smem_bytes(c, d, logits=logits))


def shrink_to_fit(cfg, size):
    """cfg (block_k, stages) with fewer stages, then 64-key blocks, until size(cfg), one CTA's
    shared memory, fits."""
    while size(cfg) > SMEM_BYTES:
        if cfg.stages > 2 or (cfg.block_k == 64 and cfg.stages > 1):
            cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
        elif cfg.block_k > 64:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        else:
            break
    return cfg


def _layout(x, layout, interpret):
    """x in register layout `layout` (interpret mode has no layouts)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def _iota(shape, dim, interpret):
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _qk(q_smem, k_smem, interpret, while_running=None):
    """q·kᵀ [64, block_k] in float32 on the tensor cores; while_running() runs after the
    asynchronous wgmma is issued, before its result is read. Interpret mode has no transposed
    wgmma operand: there the same product is a jnp dot of the shared-memory tiles."""
    if interpret:
        s = jnp.dot(q_smem[...], k_smem[...].T, preferred_element_type=jnp.float32)
        if while_running is not None:
            while_running()
        return s

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
        if while_running is not None:
            while_running()
        return acc_ref[...]

    return pl.run_scoped(qk, plgpu.ACC((_M, k_smem.shape[0]), jnp.float32))


def _flash(q_smem, k_smem, v_smem, p_smem, k_bar, v_bar, *, n, fetch, valid, stages,
           scale, interpret, on_scores=None, q_bar=None):
    """Online softmax over n key blocks, `stages` of them in flight: fetch(i, slot) starts
    block i's TMA copies into K/V slot `slot`; valid(i) is how many leading keys of block i
    count, a scalar or per query row ([64, block_k], from `_iota(.., 0, ..)`), or a pair
    (first, end): keys [first, end) of the block count (a block fetched from an 8-aligned
    start below its first key); the rest score -inf; on_scores(i, s) sees each block's
    masked, scaled scores. p_smem None: P·V reads p from registers.
    q_bar: the query's TMA barrier, waited for once the first blocks' copies are started (a
    short program's K/V loads then overlap its query's instead of queueing behind it).
    Returns (acc [64, D], m [64], l [64]) in registers; m starts at a finite M_INIT, so a row
    with no valid key in a block keeps exp(m - m_new) = 1 (and l = 0 if it never sees one)."""
    bk, d = k_smem.shape[1], k_smem.shape[2]
    dtype = k_smem.dtype
    for i in range(stages):  # (a traced block index: a static one past a short cache's end
        # fails the static bounds check, where the TMA copy would only clip)
        pl.when(i < n)(functools.partial(fetch, jnp.int32(i), i))
    if q_bar is not None:
        plgpu.barrier_wait(q_bar)

    def step(i, carry):
        acc, m, l = carry
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(k_bar.at[slot])
        s = _qk(q_smem, k_smem.at[slot], interpret) * scale
        key = _iota((_M, bk), 1, interpret)
        first, end = _bounds(valid(i))
        keep = key < end if first is None else (key >= first) & (key < end)
        s = jnp.where(keep, s, -jnp.inf)
        if on_scores is not None:
            on_scores(i, s)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        if p_smem is None:  # p as wgmma's register operand, accumulated into acc in place
            p16 = p.astype(dtype)
            plgpu.barrier_wait(v_bar.at[slot])
            if interpret:
                acc = acc + jnp.dot(p16, v_smem.at[slot][...],
                                    preferred_element_type=jnp.float32)
            else:
                acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p16, v_smem.at[slot]))(
                    plgpu.ACC.init(acc))
        else:
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]

            acc = acc + pl.run_scoped(pv, plgpu.ACC((_M, d), jnp.float32))
        # both wgmmas have read this slot: refill it
        pl.when(i + stages < n)(lambda: fetch(i + stages, slot))
        return acc, m_new, l

    acc = _layout(jnp.zeros((_M, d), jnp.float32), plgpu.Layout.WGMMA, interpret)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m = _layout(jnp.full((_M,), M_INIT, jnp.float32), row_layout, interpret)
    l = _layout(jnp.zeros((_M,), jnp.float32), row_layout, interpret)
    return lax.fori_loop(0, n, step, (acc, m, l))


def _store_new_token(kn_ref, vn_ref, k_out, v_out, at, src):
    """kn, vn [B, Hkv, D] at `src` = (r, h) to k_out, v_out at `at` = (layer, r, h, pos),
    through shared memory; returns once the stores are done (a TMA read issued after them
    sees the new values)."""
    d = kn_ref.shape[-1]

    def store(buf, bar):
        for i, (src_ref, out_ref) in enumerate(((kn_ref, k_out), (vn_ref, v_out))):
            plgpu.copy_gmem_to_smem(src_ref.at[src], buf.at[i], bar.at[i])
        for i, out_ref in enumerate((k_out, v_out)):
            plgpu.barrier_wait(bar.at[i])
            plgpu.copy_smem_to_gmem(buf.at[i], out_ref.at[at])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((2, d), kn_ref.dtype), plgpu.Barrier(num_barriers=2))


def _bounds(valid):
    """(first, end) of a valid(i) result: a count means (None, count)."""
    return valid if isinstance(valid, tuple) else (None, valid)


def aligned(x, m=8):
    """A dynamic TMA start along a tiled axis, told to the compiler to be a multiple of m
    (the layout inference proves a tiled copy's offsets from such hints); a Python int (a
    static block index) is returned as it is: multiple_of takes traced values only."""
    if isinstance(x, int):
        return x
    return pl.multiple_of(x, m)


def _store_partials(carry, o_ref, m_ref, l_ref, group, ids):
    """A split's (acc, m, l): acc's group rows to o [R, n, Hq, D], m, l to [R, n, Hkv, 64],
    through shared memory of its own scope (the main loop's, reused)."""
    acc, m, l = carry
    r, h, j = ids()

    def store(o_smem, ml_smem):
        o_smem[...] = acc
        ml_smem[0] = m
        ml_smem[1] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)],
                                o_ref.at[r, j, pl.ds(h * group, group)])
        plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[r, j, h])
        plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[r, j, h])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM(acc.shape, jnp.float32), plgpu.SMEM((2, _M), jnp.float32))


def _store_output(carry, out_ref, group, ids):
    """A read in one split: its (acc, m, l) normalised (acc / l, 0 where no key counted, NaN
    staying NaN, as `_combine`) and the group's rows stored to out [R, Hq, D] float32 (a
    half-precision store from wgmma's layout finds no layout): no merge of splits after the
    kernel, only the cast."""
    acc, _, l = carry
    r, h, _ = ids()

    def store(out_smem):
        inv = 1.0 / jnp.where(l != 0, l, 1.0)
        lb = lax.broadcast_in_dim(l, acc.shape, [0])
        out = jnp.where(lb != 0, acc * lax.broadcast_in_dim(inv, acc.shape, [0]), 0.0)
        out_smem[...] = out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, group)],
                                out_ref.at[r, pl.ds(h * group, group)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM(acc.shape, jnp.float32))


def score_scratch(cfg):
    """The shared-memory score blocks a kernel with logits stores from."""
    return plgpu.SMEM((cfg.score_buffers, _M, cfg.block_k), jnp.float32)


def score_writer(s_smem, store):
    """_flash's on_scores for a kernel that returns logits: block i's masked scores go into
    score block i % n of s_smem ([n, 64, bk]) and out by store(i, block) (a TMA copy); a
    block is rewritten once the store that last read it is done, so with n > 1 a block's
    write overlaps the last store."""
    n = s_smem.shape[0]

    def on_scores(i, s):
        at = lax.rem(i, n) if n > 1 else 0
        plgpu.wait_smem_to_gmem(n - 1, wait_read_only=True)
        s_smem.at[at][...] = s
        plgpu.commit_smem()
        store(i, at)

    return on_scores


def store_neg_inf(s_smem, store, lo, hi, interpret):
    """Blocks [lo, hi) (a split's blocks past its row's end): -inf scores, without reading K."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    neg = jnp.full(s_smem.shape[1:], -jnp.inf, jnp.float32)
    s_smem.at[0][...] = _layout(neg, plgpu.Layout.WGMMA, interpret)
    plgpu.commit_smem()

    @pl.loop(lo, jnp.maximum(lo, hi))
    def _fill(i):
        store(i, 0)


def _dense_kernel(layer_ref, len_ref, rows_ref, q_ref, k_ref, v_ref, *rest, group, split,
                  n_splits, by_length, s_len, bk, stages, scale, logits, interpret, zero_fill,
                  ids):
    """Program (r, h, j): keys [j * split, min(+split, length)) of cache row rows[r], KV head h
    (by_length: split = the row's length over n_splits, in whole blocks).
    Returns the split's (acc, m, l) (`_launch` stores them); logits: also stores the scaled
    scores [R, Hq, S], -inf from the row's length on."""
    if logits:
        lg_ref, s_smem, *scratch = rest
    else:
        lg_ref, s_smem, scratch = None, None, rest
    (q_smem, k_smem, v_smem, p_smem, q_bar, k_bar, v_bar) = scratch
    r, h, j = ids()
    layer, row = layer_ref[0], rows_ref[r]
    length = jnp.clip(len_ref[r], 0, s_len)
    if by_length:
        split = row_split(length, n_splits, bk)
    start = j * split
    end = jnp.minimum(start + split, s_len)
    hi = jnp.minimum(end, length)
    n = lax.div(jnp.maximum(hi - start, 0) + (bk - 1), bk)
    kv = (layer, row, h)

    copy_q(q_ref, r, h, j, q_smem, q_bar, zero_fill)

    def fetch(i, slot):
        blk = (*kv, pl.ds(aligned(start + i * bk, bk), bk))
        plgpu.copy_gmem_to_smem(k_ref.at[blk], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[blk], v_smem.at[slot], v_bar.at[slot])

    def store_logits(i, at):
        """The group's rows of score block `at` to logits [start + i * bk, +bk): the logits
        are padded to whole blocks (logits_length), so every store is in bounds and
        tile-aligned."""
        col = pl.ds(aligned(start + i * bk, bk), bk)
        plgpu.copy_smem_to_gmem(s_smem.at[at, pl.ds(0, group)],
                                lg_ref.at[r, pl.ds(h * group, group), col])

    carry = _flash(q_smem, k_smem, v_smem, p_smem, k_bar, v_bar, n=n, fetch=fetch,
                   valid=lambda i: hi - (start + i * bk), stages=stages, scale=scale,
                   interpret=interpret, q_bar=q_bar,
                   on_scores=score_writer(s_smem, store_logits) if logits else None)

    if logits:  # blocks of this split past the row's length: -inf, without reading K
        store_neg_inf(s_smem, store_logits, n, lax.div(end - start + (bk - 1), bk), interpret)
    return carry


def _sparse_kernel(layer_ref, clen_ref, rs_ref, len_ref, q_ref, ck_ref, cv_ref, k_ref, v_ref,
                   *rest, group, n_splits, s_len, c_size, bk, stages, scale, clen_stacked,
                   interpret, zero_fill, new_kv, ids):
    """Program (r, h, j) over a virtual sequence of key blocks: the compact prefix
    [0, c_len) of ck, cv in whole blocks, then the cache window [rs, length) of k, v (from rs
    on, in place); the row's blocks are shared out evenly over the n_splits splits. ck, cv
    come as [L, B, Hkv * C, D] (a free reshape): head h's keys start at h * C, and a block
    that runs past them reads the next head's (or zeros), masked.
    new_kv: rest starts with kn, vn [B, Hkv, D], and k_ref, v_ref are `jax.new_ref` caches
    (written in place): the program whose split holds the window's last block first stores
    the step's key and value at position length - 1, waits for the stores, then reads that
    block, so no program reads the position before it is written and no XLA scatter runs
    before."""
    if new_kv:  # (k_ref, v_ref: `jax.new_ref` caches, written in place)
        kn_ref, vn_ref, *rest = rest
        k_out, v_out = k_ref, v_ref
    q_smem, k_smem, v_smem, p_smem, q_bar, k_bar, v_bar = rest
    r, h, j = ids()
    layer = layer_ref[0]
    c_len = jnp.clip(clen_ref[layer, r, h] if clen_stacked else clen_ref[r, h], 0, c_size)
    length = jnp.clip(len_ref[r], 0, s_len)
    rs = jnp.clip(rs_ref[r], 0, length)
    # TMA reads tiles of 8 keys: each segment is fetched from its 8-aligned start below it,
    # the keys before its first one masked (c_off, w_off)
    c_base = lax.div(h * c_size, 8) * 8
    c_off = h * c_size - c_base
    w_base = lax.div(rs, 8) * 8
    w_off = rs - w_base
    n_c = jnp.where(c_len > 0, lax.div(c_off + c_len + (bk - 1), bk), 0)
    n_w = jnp.where(length > rs, lax.div(w_off + length - rs + (bk - 1), bk), 0)
    n_all = n_c + n_w
    chunk = lax.div(n_all + (n_splits - 1), n_splits)
    first = j * chunk
    n = jnp.clip(n_all - first, 0, chunk)
    at = (layer, r, h)

    copy_q(q_ref, r, h, j, q_smem, q_bar, zero_fill)
    if new_kv:  # (the window holds position length - 1: recent_start < length)
        pl.when((n_w > 0) & (first < n_all) & (first + chunk >= n_all))(functools.partial(
            _store_new_token, kn_ref, vn_ref, k_out, v_out, (*at, length - 1), (r, h)))

    def fetch(i, slot):
        b = first + i

        @pl.when(b < n_c)
        def _compact():
            blk = (layer, r, pl.ds(aligned(c_base + b * bk), bk))
            plgpu.copy_gmem_to_smem(ck_ref.at[blk], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(cv_ref.at[blk], v_smem.at[slot], v_bar.at[slot])

        @pl.when(b >= n_c)
        def _window():
            blk = (*at, pl.ds(aligned(w_base + (b - n_c) * bk), bk))
            plgpu.copy_gmem_to_smem(k_ref.at[blk], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[blk], v_smem.at[slot], v_bar.at[slot])

    def valid(i):
        b = first + i
        lo = jnp.where(b < n_c, c_off - b * bk, w_off - (b - n_c) * bk)
        hi = jnp.where(b < n_c, c_off + c_len - b * bk, w_off + length - rs - (b - n_c) * bk)
        return lo, hi

    return _flash(q_smem, k_smem, v_smem, p_smem, k_bar, v_bar, n=n, fetch=fetch,
                  valid=valid, stages=stages, scale=scale, interpret=interpret, q_bar=q_bar)


def _combine(o, m, l, group, dtype):
    """Exact merge of the splits: o [R, n, Hq, D], m, l [R, n, Hkv, 64] -> (out, lse)."""
    n_rows, n_splits, hq, _ = o.shape
    m = m[..., :group].reshape(n_rows, n_splits, hq)
    l = l[..., :group].reshape(n_rows, n_splits, hq)
    mx = jnp.max(m, axis=1)
    w = jnp.exp(m - jnp.where(jnp.isfinite(mx), mx, 0.0)[:, None])
    lsum = jnp.sum(l * w, axis=1)
    acc = jnp.sum(o * w[..., None], axis=1)
    ok = lsum != 0  # no valid key: 0; NaN inputs stay NaN
    out = jnp.where(ok[..., None], acc / jnp.where(ok, lsum, 1.0)[..., None], 0.0)
    lse = jnp.where(ok, mx + jnp.log(jnp.where(ok, lsum, 1.0)), -jnp.inf)
    return out.astype(dtype), lse


def _grouped_q(q, hkv, zero_fill):
    """q [R, Hq, D] -> [R, Hkv, G, D], each KV head's query group (a free reshape), which
    `copy_q` reads as wgmma's 64 rows; without zero_fill padded with zero rows to 64 (an XLA
    pad)."""
    n_rows, hq, d = q.shape
    qg = q.reshape(n_rows, hkv, hq // hkv, d)
    if zero_fill:
        return qg
    return jnp.pad(qg, ((0, 0), (0, 0), (0, _M - hq // hkv), (0, 0)))


def copy_q(q_ref, r, h, j, q_smem, q_bar, zero_fill):
    """Start the TMA copy of row r's query group for KV head h into the 64 rows of q_smem.
    zero_fill: q_ref [R, Hkv, G, D] is read from a traced 0, so the rows past G, read past
    the group axis's end, come as TMA's zeros (a static slice past the end fails the static
    bounds check); else q_ref is padded to 64 rows."""
    src = q_ref.at[r, h]
    if zero_fill:
        src = q_ref.at[r, h, pl.ds(aligned(j * 0), _M)]
    plgpu.copy_gmem_to_smem(src, q_smem, q_bar)


def logits_length(s_len, bk):
    """The logits' padded length: whole key blocks, so each block's store is in bounds and
    aligned to the f32 tile TMA splits it into (the result is sliced back to S)."""
    return -(-s_len // bk) * bk


def _check_config(cfg, d, logits=False):
    if cfg.block_k % 64 or cfg.stages < 1 or cfg.score_buffers < 1 \
            or smem_bytes(cfg, d, logits=logits) > SMEM_BYTES:
        raise ValueError(f"mosaic_gpu config {cfg}: block_k must be a multiple of 64, "
                         "stages and score_buffers positive and the "
                         f"CTA's shared memory ({smem_bytes(cfg, d, logits=logits)} B at "
                         f"d={d}) at most {SMEM_BYTES} B")


def _check_inputs(name, q, k, ck=None):
    if not supported(q, k, ck):
        c = "" if ck is None else f", C={ck.shape[-2]}"
        raise ValueError(f"mosaic_gpu {name} takes bf16/f16 caches, head dim 64/128/256, GQA "
                         f"groups <= {_M}, S and Hkv * C multiples of 8; got {k.dtype}, "
                         f"d={q.shape[-1]}, group={q.shape[-2] // k.shape[-3]}, "
                         f"S={k.shape[-2]}{c}")


def _launch(kernel, args, *, n_rows, hq, hkv, d, n_splits, bk, stages, dtype, interpret,
            group, extra_out=(), extra_scratch=(), p_regs=False, direct=False):
    """One program per (row, KV head, split): kernel(*inputs, *extra_out, *scratch, ids=)
    runs the main loop over its scratch (extra_scratch, q, the K/V stages, p (None with
    p_regs), the TMA barriers) and returns its split's (acc, m, l); these go out as the
    partials (o, m, l; extra_out after them) through shared memory that reuses the main
    loop's. direct (one split): the float32 output [R, Hq, D] instead of the partials
    (`_store_output`). ids() gives the program's (r, h, j)."""
    assert not direct or n_splits == 1
    partials = [jax.ShapeDtypeStruct((n_rows, n_splits, hq, d), jnp.float32),
                jax.ShapeDtypeStruct((n_rows, n_splits, hkv, _M), jnp.float32),
                jax.ShapeDtypeStruct((n_rows, n_splits, hkv, _M), jnp.float32)]
    n_out = 1 if direct else 3
    out_type = [*([jax.ShapeDtypeStruct((n_rows, hq, d), jnp.float32)] if direct else partials),
                *extra_out]
    scratch = [
        *extra_scratch,
        _smem_kv((_M, d), dtype),
        _smem_kv((stages, bk, d), dtype),
        _smem_kv((stages, bk, d), dtype),
        *(() if p_regs else (_smem_kv((_M, bk), dtype),)),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
    ]

    def ids():
        return lax.axis_index("r"), lax.axis_index("h"), lax.axis_index("j")

    def body(*refs):
        outs = refs[len(args):len(args) + n_out]

        def main(*scratch_refs):
            if p_regs:  # (p's place in the kernel's scratch)
                at = len(extra_scratch) + 3
                scratch_refs = (*scratch_refs[:at], None, *scratch_refs[at:])
            carry = kernel(*refs[:len(args)], *refs[len(args) + n_out:], *scratch_refs,
                           ids=ids)
            # (stores still reading this scope's memory end before it is reused)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            return carry

        carry = pl.run_scoped(main, *scratch)
        if direct:
            _store_output(carry, outs[0], group, ids)
        else:
            _store_partials(carry, *outs, group, ids)

    interpret = interpret_params() if interpret else False
    return plgpu.kernel(
        body, out_type=out_type, grid=(n_rows, hkv, n_splits), grid_names=("r", "h", "j"),
        compiler_params=compiler_params(), interpret=interpret)(*args)


@functools.partial(jax.jit, static_argnames=("return_logits", "interpret", "config",
                                             "zero_fill"))
def dense_decode(q, k, v, lengths, layer=None, rows=None, *, return_logits=False,
                 interpret=False, config=None, zero_fill=False):
    """Dense decode attention (see kernels.attention.dense_decode) of q [R, Hq, D] over cache
    rows `rows` (default: row r) of k, v [(L,) B, Hkv, S, D], half precision. Returns out, or
    (out, logits [R, Hq, S] float32 with -inf from each row's length on, lse [R, Hq]).
    zero_fill: the query group's rows past G come from TMA's zero fill past the array's end
    instead of a padded copy of q (`copy_q`)."""
    cfg = config or fit(DENSE_LOGITS if return_logits else DENSE, q.shape[-1], return_logits)
    k, v, layer_arr = as_layer_stacks(layer, k, v)
    n_rows, hq, d = q.shape
    _, _, hkv, s_len, _ = k.shape
    group = hq // hkv
    _check_inputs("dense_decode", q, k)
    _check_config(cfg, d, return_logits)
    bk = cfg.block_k
    split, n_splits = decode_splits(s_len, n_rows * hkv, bk, cfg.programs,
                                    plan_keys(cfg, d, k.dtype))
    rows = jnp.arange(n_rows, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
    # (the logits fill each split's positions past the length with -inf: cache-sized splits)
    by_length = cfg.by_length and n_splits > 1 and not return_logits
    kernel = functools.partial(
        _dense_kernel, group=group, split=split, n_splits=n_splits, by_length=by_length,
        s_len=s_len, bk=bk, stages=cfg.stages,
        scale=1.0 / math.sqrt(d), logits=return_logits, interpret=interpret,
        zero_fill=zero_fill)
    s_lg = logits_length(s_len, bk)
    extra_out, extra_scratch = (), ()
    if return_logits:  # and the score blocks they are stored from
        extra_out = (jax.ShapeDtypeStruct((n_rows, hq, s_lg), jnp.float32),)
        extra_scratch = (score_scratch(cfg),)
    res = _launch(kernel, (layer_arr, lengths.astype(jnp.int32), rows,
                           _grouped_q(q.astype(k.dtype), hkv, zero_fill), k, v),
                  n_rows=n_rows, hq=hq, hkv=hkv, d=d, n_splits=n_splits, bk=bk,
                  stages=cfg.stages, dtype=k.dtype, interpret=interpret, group=group,
                  extra_out=extra_out, extra_scratch=extra_scratch, p_regs=cfg.p_regs,
                  direct=n_splits == 1 and not return_logits)
    if not return_logits:
        return res[0].astype(q.dtype) if n_splits == 1 else _combine(*res, group, q.dtype)[0]
    out, lse = _combine(res[0], res[1], res[2], group, q.dtype)
    return out, res[3] if s_lg == s_len else res[3][..., :s_len], lse


@functools.partial(jax.jit, static_argnames=("window", "interpret", "config", "zero_fill"))
def sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths, layer=None, *, window=None,
                  interpret=False, config=None, zero_fill=False, new_kv=None):
    """Compact + recent-window decode attention (see kernels.attention.sparse_decode): the
    prefix [0, c_len[b, h]) of ck, cv [(L,) B, Hkv, C, D] and the positions
    [recent_start[b], lengths[b]) of k, v [(L,) B, Hkv, S, D], read in place; half precision.
    c_len may be stacked [L, B, Hkv] like the caches. window: a bound on lengths -
    recent_start that sizes the splits (the kernel reads only the window either way).
    zero_fill: as in `dense_decode`. new_kv: (kn, vn) [B, Hkv, D], stored by the kernel at
    position lengths - 1 of k, v (layer `layer`) before it is read (lengths >= 1,
    recent_start < lengths), into `jax.new_ref` caches (in place inside a jitted caller that
    donates them; only where `stores_in_kernel`); returns (out, k, v)."""
    cfg = config or fit(SPARSE, q.shape[-1])
    if new_kv is not None and not stores_in_kernel(interpret):
        raise ValueError(f"sparse_decode(new_kv=...) needs jax >= 0.11 and a compiled kernel "
                         f"(jax {jax.__version__}, interpret={interpret}): store the token "
                         "first (kernels.common.write_new_token)")
    cache_shape = k.shape
    ck, cv, k, v, layer_arr = as_layer_stacks(layer, ck, cv, k, v)
    n_rows, hq, d = q.shape
    _, _, hkv, s_len, _ = k.shape
    c_size = ck.shape[3]
    group = hq // hkv
    _check_inputs("sparse_decode", q, k, ck)
    _check_config(cfg, d)
    bk = cfg.block_k
    keys = -(-c_size // bk) * bk + (s_len if window is None else min(int(window), s_len))
    _, n_splits = decode_splits(keys, n_rows * hkv, cfg.block_k, cfg.programs,
                                 plan_keys(cfg, d, k.dtype))
    kernel = functools.partial(
        _sparse_kernel, group=group, n_splits=n_splits, s_len=s_len, c_size=c_size, bk=bk,
        stages=cfg.stages, scale=1.0 / math.sqrt(d), clen_stacked=c_len.ndim == 3,
        interpret=interpret, zero_fill=zero_fill, new_kv=new_kv is not None)
    heads_c = ck.shape[:2] + (hkv * c_size, d)  # the heads' buffers as one key axis
    args = (layer_arr, c_len.astype(jnp.int32), recent_start.astype(jnp.int32),
            lengths.astype(jnp.int32), _grouped_q(q.astype(k.dtype), hkv, zero_fill),
            ck.reshape(heads_c), cv.reshape(heads_c), k, v)
    if new_kv is not None:  # (the kernel writes the caches: refs, not values)
        k, v = jax.new_ref(k), jax.new_ref(v)
        args = args[:-2] + (k, v) + tuple(x.astype(ck.dtype) for x in new_kv)
    res = _launch(kernel, args, n_rows=n_rows, hq=hq, hkv=hkv, d=d, n_splits=n_splits, bk=bk,
                  stages=cfg.stages, dtype=ck.dtype, interpret=interpret, group=group,
                  p_regs=cfg.p_regs, direct=n_splits == 1)
    if n_splits == 1:  # (the kernel wrote the output)
        out = res[0].astype(q.dtype)
    else:
        out = _combine(res[0], res[1], res[2], group, q.dtype)[0]
    if new_kv is None:
        return out
    return out, k[...].reshape(cache_shape), v[...].reshape(cache_shape)


def _repack_kernel(slots_ref, pos_ref, k_ref, v_ref, ck_out, cv_out, *, n_rows, n_layers,
                   block):
    """Program (slot s x layer, KV head h, block c): the cache rows of slot s's row at its
    positions [c * block, +block) copied one by one (TMA has no gather) into shared memory,
    then stored as one [block, D] tile of the slot's compact rows. An empty slot moves
    nothing; a position of -1 copies row 0 (unspecified, as the contract allows)."""
    sl, h, c = (lax.axis_index(a) for a in ("sl", "h", "c"))
    s, layer = lax.div(sl, n_layers), lax.rem(sl, n_layers)
    row = slots_ref[s]

    @pl.when(row < n_rows)
    def _occupied():
        def body(k_smem, v_smem, bar):
            for i in range(block):
                p = jnp.maximum(pos_ref[layer, s, h, c * block + i], 0)
                plgpu.copy_gmem_to_smem(k_ref.at[layer, row, h, p], k_smem.at[i], bar.at[0])
                plgpu.copy_gmem_to_smem(v_ref.at[layer, row, h, p], v_smem.at[i], bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            dst = (layer, s, h, pl.ds(pl.multiple_of(c * block, block), block))
            plgpu.copy_smem_to_gmem(k_smem, ck_out.at[dst])
            plgpu.copy_smem_to_gmem(v_smem, cv_out.at[dst])
            plgpu.wait_smem_to_gmem(0)

        tile = plgpu.SMEM((block, k_ref.shape[-1]), k_ref.dtype)
        pl.run_scoped(body, tile, tile, plgpu.Barrier(num_arrivals=2 * block, num_barriers=1))


REPACK_BLOCK = 64  # positions per program at most (a power of two dividing C)


def repack_supported(ck) -> bool:
    """A compact row of D elements is a whole number of 16-byte TMA units."""
    return ck.shape[-1] * jnp.dtype(ck.dtype).itemsize % 16 == 0


@functools.partial(jax.jit, static_argnames=("interpret", "block"))
def repack(ck, cv, k, v, positions, slots, *, interpret=False, block=REPACK_BLOCK):
    """kernels.attention.repack's contract: the refreshed slots' compact rows gathered from
    the cache by one kernel into a [L, n_slots, Hkv, C, D] buffer per tensor (no work for an
    empty slot), then written into ck, cv by XLA's scatter (in place in a jitted caller that
    owns them)."""
    n_layers, n_rows, hkv, c_size, d = ck.shape
    n_slots = slots.shape[0]
    blk = 1
    while blk * 2 <= block and c_size % (blk * 2) == 0:
        blk *= 2
    out = [jax.ShapeDtypeStruct((n_layers, n_slots, hkv, c_size, d), ck.dtype)] * 2
    new_k, new_v = plgpu.kernel(
        functools.partial(_repack_kernel, n_rows=n_rows, n_layers=n_layers, block=blk),
        out_type=out, grid=(n_slots * n_layers, hkv, c_size // blk), grid_names=("sl", "h", "c"),
        compiler_params=compiler_params(),
        interpret=interpret_params() if interpret else False,
    )(slots.astype(jnp.int32), positions.astype(jnp.int32), k, v)
    kw = dict(mode="drop", unique_indices=True)
    return ck.at[:, slots].set(new_k, **kw), cv.at[:, slots].set(new_v, **kw)
