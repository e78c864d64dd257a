"""Weight-streaming matmul for a few rows (a decode step's 1-64 tokens) on NVIDIA Hopper GPUs:
Pallas with the Mosaic GPU lowering.

The Mosaic GPU twin of `skinny_matmul_gpu.skinny_matmul_partials` (Triton): the same split-K
grid and float32 partials, so the caller's next elementwise fusion adds the splits up. Why a
twin: at decode batch sizes a projection's time is its weight's bytes over the bandwidth, and on
Hopper the bulk tensor copy engine (TMA) streams a weight tile into shared memory with one
instruction and no registers, an mbarrier saying when it landed; and Triton's Pallas lowering is
deprecated from jax 0.11 on, Mosaic GPU being JAX's supported GPU backend for Pallas.

Layout: program (j, s) (one warpgroup) owns column block j (block_n columns) over K split s
(`steps` blocks of block_k). It copies its split of the rows once, as `steps` [rows8, block_k]
blocks (rows8: the rows rounded up to 8, a whole swizzle atom: the rows are padded to rows8
by XLA, or with `zero_fill` the copy engine fills the rows past the array's end with zeros)
stacked in shared memory, and streams the split's weight blocks [block_k, block_n] through
`stages` shared-memory slots, each slot refilled as soon as its wgmma has read it,
accumulating in float32 registers. wgmma's A operand is 64 rows:
step i's tile is the 64 rows from row block i on, so its rows past rows8 are the next blocks'
rows (or never-written memory), which feed only accumulator rows that are never stored; the row
blocks thus take rows8 / 64 of the shared memory of padded tiles. The split length keeps each
CTA within its share of an SM's shared memory, so the grid's `programs` CTAs run in one wave
(`plan`). The accumulators go out through shared memory with TMA, the real rows only (the same
memory, reused).

Fused epilogues (`skinny_matmul_fused`: the residual add, the SiLU product;
`skinny_matmul_heads`: the heads' norms and rope): a column block's K splits meet in its last
split through a global semaphore per block, the other splits' partials read back from global
memory, so no XLA fusion follows the kernel (`_fused_kernel`). They lower with Lane semantics
(`attention_mgpu.compiler_params`) and are opt-in: slower in the decode step than the
unfused twin (docs/findings.md).

`supported`: half-precision weights with K and N multiples of 64 (the 128-byte swizzled tiles
of wgmma's operands): a block that does not divide K or N is halved down to 64. Off a GPU the
kernel runs in Mosaic GPU's interpret mode (`attention_mgpu.interpret_params`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sfi_jax.kernels.attention_mgpu import (HALF, SMEM_BYTES, compiler_params, interpret_params,
                                            pad_rows8, rows8_of)
from sfi_jax.kernels.attention_mgpu import load as load_all
from sfi_jax.kernels.heads_mgpu import norm_rope_into
from sfi_jax.kernels.common import signals_dependents

_M = 64  # wgmma's M per warpgroup: the rows are computed as 64
_NUM_SMS = 132
SM_SMEM_BYTES = 228 * 1024  # one Hopper SM's shared memory, shared by its resident CTAs
MAX_ROWS = _M
_GRAIN = 64  # K and N tile: 64 half-precision elements make a 128-byte swizzled row


@dataclasses.dataclass(frozen=True)
class Config:
    """block_n: columns per program (a multiple of 64; halved until it divides N); block_k:
    K per pipeline step (a multiple of 64; halved until it divides K); stages: weight blocks
    in flight (fewer when shared memory is short); programs: the grid size aimed for (splits
    = programs / column blocks, more when a split's rows would not fit shared memory)."""

    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    programs: int = 2 * _NUM_SMS


DEFAULT = Config()


def supported(x, w) -> bool:
    """Whether the kernel takes x [M, K] times w [K, N]: half-precision weights, 1 to 64 rows,
    K and N multiples of 64."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        return False
    m, k = x.shape
    n = w.shape[1]
    return (jnp.dtype(w.dtype) in HALF and 1 <= m <= MAX_ROWS and k % _GRAIN == 0
            and n % _GRAIN == 0)


def _divisor_block(block, dim):
    """block halved (down to 64) until it divides dim."""
    while block > _GRAIN and dim % block:
        block //= 2
    return block


def _swizzled(shape, dtype):
    """A shared-memory tile wgmma reads: (8, 64) tiles, 128-byte swizzle (half precision)."""
    itemsize = jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 128 // itemsize)),
                                                plgpu.SwizzleTransform(128)))


def x_rows(steps, rows8):
    """Rows of the shared-memory buffer that holds a split's `steps` row blocks: block i at rows
    [i * rows8, +rows8), and wgmma's 64-row tile for block i starting there, so the tiles
    overlap; the last one's rows past the data are allocated, never written."""
    return steps * rows8 + _M - rows8


def smem_bytes(rows8, steps, bn, bk, stages, n_w, itemsize=2):
    """One CTA's shared memory: the split's row blocks and the weight slots in the main loop,
    then (the same memory, reused) the float32 partials on their way out."""
    main = x_rows(steps, rows8) * bk * itemsize + stages * n_w * bk * bn * itemsize
    return max(main, n_w * _M * bn * 4)


@dataclasses.dataclass(frozen=True)
class Plan:
    bn: int
    bk: int
    stages: int
    steps: int  # K blocks per split (the last split may have fewer)
    n_splits: int
    n_blocks: int  # column blocks


def smem_budget(programs) -> int:
    """Shared memory one CTA may take so that `programs` CTAs are resident at once (one wave:
    programs / SMs CTAs per SM, 1 KiB of each reserved by the driver, a little more for
    barriers and alignment), within the most one CTA may take."""
    per_sm = max(1, round(programs / _NUM_SMS))
    return min(SMEM_BYTES, SM_SMEM_BYTES // per_sm - 2048)


def plan(m, k, n, n_w, config=None, itemsize=2) -> Plan:
    """The blocks, stages and split-K plan for x [m, k] times n_w weights [k, n]: at most
    config.programs programs where the K blocks allow (the splits rounded down), each split's
    row blocks and `stages` weight slots in `smem_budget(programs)`, so that they all run in
    one wave: fewer stages (down to 2), then shorter splits (more programs) where they don't."""
    cfg = config or DEFAULT
    if cfg.block_n % _GRAIN or cfg.block_k % _GRAIN or cfg.stages < 1 or cfg.programs < 1:
        raise ValueError(f"mosaic_gpu skinny_matmul config {cfg}: block_n and block_k must be "
                         f"multiples of {_GRAIN}, stages and programs positive")
    bn, bk = _divisor_block(cfg.block_n, n), _divisor_block(cfg.block_k, k)
    n_blocks, n_kb = n // bn, k // bk
    want = max(1, min(n_kb, cfg.programs // n_blocks))
    steps = -(-n_kb // want)
    stages, r8 = cfg.stages, rows8_of(m)
    budget = smem_budget(cfg.programs)

    def size():
        return smem_bytes(r8, steps, bn, bk, stages, n_w, itemsize)

    while stages > 2 and size() > budget:
        stages -= 1
    while steps > 1 and size() > budget:
        steps -= 1
    if size() > SMEM_BYTES:
        raise ValueError(f"mosaic_gpu skinny_matmul: blocks {bk} x {bn} with {n_w} weights do "
                         f"not fit {SMEM_BYTES} B of shared memory")
    return Plan(bn=bn, bk=bk, stages=min(stages, steps), steps=steps,
                n_splits=-(-n_kb // steps), n_blocks=n_blocks)


def stream_product(x_block, w_blocks, n, *, steps, stages, rows8, bk, bn, dtype,
                   weights_first=False, pdl=False):
    """Float32 accumulators [64, bn], one per weight: the sum over blocks i < n (traced, at
    most the static `steps`) of x_block(i) [rows8, bk] times w_blocks[w](i) [bk, bn], both
    GMEM refs. The n row blocks are copied once (stacked in shared memory, see x_rows); the
    weight blocks stream through `stages` slots, each refilled as soon as its wgmma has read
    it.

    weights_first: the first `stages` weight blocks are asked for before any row block; with
    pdl (programmatic dependent launch, on the GPU only) a `griddepcontrol.wait` then holds
    the row copies until the kernel ahead, which writes the rows, has finished, and
    `griddepcontrol.launch_dependents` follows the main loop. The weights are never written
    by a decode step, so a kernel launched early streams them while the kernel ahead ends."""

    def main_loop(x_smem, w_smem, x_bar, w_bar):
        def fetch_x(i):
            plgpu.copy_gmem_to_smem(x_block(i), x_smem.at[pl.ds(i * rows8, rows8)], x_bar.at[i])

        def fetch_w(i, slot):
            for w_block, w_slot in zip(w_blocks, w_smem):
                plgpu.copy_gmem_to_smem(w_block(i), w_slot.at[slot], w_bar.at[slot])

        if weights_first:  # the first weight blocks, then (after the kernel ahead) the rows
            for i in range(stages):
                pl.when(i < n)(functools.partial(fetch_w, i, i))
            if pdl:
                plgpu.griddepcontrol_wait()
            pl.loop(0, n)(fetch_x)
        else:  # the first blocks' rows and weights, then the rest of the rows
            for i in range(stages):
                @pl.when(i < n)
                def _first():
                    fetch_x(i)
                    fetch_w(i, i)

            pl.loop(stages, n)(fetch_x)

        def accumulate(*acc_refs):  # (registers: a scope of their own)
            @pl.loop(0, n)
            def _step(i):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(x_bar.at[i])
                plgpu.barrier_wait(w_bar.at[slot])
                x_tile = x_smem.at[pl.ds(i * rows8, _M)]
                for acc_ref, w_slot in zip(acc_refs, w_smem):
                    plgpu.wgmma(acc_ref, x_tile, w_slot.at[slot])
                plgpu.wgmma_wait(0)  # the slot is read: refill it

                @pl.when(i + stages < n)
                def _refill():
                    fetch_w(i + stages, slot)

            if pdl:  # the main loop's reads are done: the next kernel may be scheduled
                plgpu.griddepcontrol_launch_dependents()
            return tuple(acc_ref[...] for acc_ref in acc_refs)

        return pl.run_scoped(accumulate,
                             *[plgpu.ACC((_M, bn), jnp.float32) for _ in w_blocks])

    return pl.run_scoped(
        main_loop,
        _swizzled((x_rows(steps, rows8), bk), dtype),
        [_swizzled((stages, bk, bn), dtype) for _ in w_blocks],
        plgpu.Barrier(num_barriers=steps),
        plgpu.Barrier(num_arrivals=len(w_blocks), num_barriers=stages),
    )


def _block_product(x_ref, w_refs, *, rows8, n_kb, p, weights_first, pdl):
    """Program (j, s)'s float32 accumulators [64, bn], one per weight: columns [j * bn, +bn)
    over K blocks [s * steps, +steps) (fewer in the last split); with j, s, the first column
    and the rows' first row (a traced 0: rows8 rows are read, those past the array's end
    filled with zeros by TMA; a static slice past the end fails the static bounds check)."""
    bn, bk = p.bn, p.bk
    j, s = lax.axis_index("j"), lax.axis_index("s")
    first = s * p.steps
    n = jnp.minimum(p.steps, n_kb - first)  # this split's K blocks (>= 1)
    col = pl.multiple_of(j * bn, bn)
    row0 = pl.multiple_of(j * 0, 8)

    def k0(i):
        return pl.multiple_of((first + i) * bk, bk)

    accs = stream_product(
        lambda i: x_ref.at[pl.ds(row0, rows8), pl.ds(k0(i), bk)],
        [lambda i, w=w: w.at[pl.ds(k0(i), bk), pl.ds(col, bn)] for w in w_refs],
        n, steps=p.steps, stages=p.stages, rows8=rows8, bk=bk, bn=bn, dtype=w_refs[0].dtype,
        weights_first=weights_first, pdl=pdl)
    return accs, j, s, col, row0


def _kernel(x_ref, *refs, n_w, m, rows8, n_kb, p, weights_first, pdl):
    """Program (j, s) (`_block_product`) writes its partials. refs: the weights [K, N], then
    the partials [n_splits, m, N]."""
    w_refs, o_refs = refs[:n_w], refs[n_w:]
    bn = p.bn
    accs, j, s, col, _ = _block_product(x_ref, w_refs, rows8=rows8, n_kb=n_kb, p=p,
                                        weights_first=weights_first, pdl=pdl)

    def store(o_smem):
        for acc, o_buf in zip(accs, o_smem):
            o_buf[...] = acc
        plgpu.commit_smem()
        for o_ref, o_buf in zip(o_refs, o_smem):
            plgpu.copy_smem_to_gmem(o_buf.at[pl.ds(0, m)], o_ref.at[s, :, pl.ds(col, bn)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, [plgpu.SMEM((_M, bn), jnp.float32) for _ in range(n_w)])


def _check(x, weights):
    if len(weights) not in (1, 2) or any(w.shape != weights[0].shape or w.dtype != weights[0].dtype
                                         for w in weights):
        raise ValueError(f"expected one or two weights of one shape and dtype, got "
                         f"{[(w.shape, w.dtype) for w in weights]}")
    if not supported(x, weights[0]):
        raise ValueError(f"mosaic_gpu skinny_matmul takes x [M <= {MAX_ROWS}, K] times "
                         f"bf16/f16 weights [K, N], K and N multiples of {_GRAIN}; got x "
                         f"{x.shape} and weights {weights[0].shape} {weights[0].dtype}")


@functools.partial(jax.jit, static_argnames=("interpret", "config", "launch_dependents",
                                             "zero_fill"))
def skinny_matmul_partials(x, weights, *, interpret=False, config=None, launch_dependents=None,
                           zero_fill=False):
    """Float32 partial sums of x [M, K] (M <= 64) times each weight [K, N] (one or two of one
    shape, half precision; x is cast to their dtype): a tuple of [n_splits, M, N], one per
    weight, whose sums over axis 0 are the products. config: a Config (None: DEFAULT).
    launch_dependents: programmatic dependent launch (`common.signals_dependents`; None: on a
    Hopper): the first weight blocks are fetched before waiting for the kernel ahead (see
    `stream_product`). True in interpret mode takes the same order without the waits.
    zero_fill: the rows read unpadded (`attention_mgpu.pad_rows8`)."""
    weights = tuple(weights)
    _check(x, weights)
    m, k = x.shape
    n = weights[0].shape[1]
    dtype = weights[0].dtype
    p = plan(m, k, n, len(weights), config, jnp.dtype(dtype).itemsize)
    rows8 = rows8_of(m)
    xp = pad_rows8(x.astype(dtype), zero_fill)
    pdl = signals_dependents(launch_dependents, interpret)
    kernel = functools.partial(_kernel, n_w=len(weights), m=m, rows8=rows8, n_kb=k // p.bk, p=p,
                               weights_first=pdl or launch_dependents is True, pdl=pdl)
    out = plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct((p.n_splits, m, n), jnp.float32)] * len(weights),
        grid=(p.n_blocks, p.n_splits), grid_names=("j", "s"),
        compiler_params=compiler_params(),
        interpret=interpret_params() if interpret else False,
    )(xp, *weights)
    return tuple(out)


# -- the fused epilogues ----------------------------------------------------------------------

EPILOGUES = ("residual", "silu")  # skinny_matmul_fused's (the heads: skinny_matmul_heads)


def epilogue_smem_bytes(rows8, bn, n_w, itemsize=2, epilogue="residual"):
    """The last split's shared memory for the epilogue: its own accumulators, then the
    residual's block and the output's, or ("heads") the rope's cos and sin, the head norm's
    rows and the head (the other splits' partials are read from global memory)."""
    if epilogue == "heads":
        return _M * bn * 4 + _M * bn * 4 + 2 * _M * bn * itemsize
    return n_w * _M * bn * 4 + 2 * rows8 * bn * itemsize


def fused_plan(m, k, n, n_w, config=None, itemsize=2, epilogue="residual") -> Plan | None:
    """`plan`, or None where the grid would not be resident at once: the K splits' last
    program waits for the others, so every program of the grid must fit the SMs together
    (one wave, counted by shared memory: one warpgroup a CTA leaves registers to spare)."""
    p = plan(m, k, n, n_w, config, itemsize)
    r8 = rows8_of(m)
    per_cta = max(smem_bytes(r8, p.steps, p.bn, p.bk, p.stages, n_w, itemsize),
                  epilogue_smem_bytes(r8, p.bn, n_w, itemsize, epilogue)) + 2048
    if per_cta > SMEM_BYTES or p.n_blocks * p.n_splits > _NUM_SMS * (SM_SMEM_BYTES // per_cta):
        return None
    return p


def _fused_kernel(x_ref, *refs, n_w, m, rows8, n_kb, p, epilogue, heads, weights_first, pdl,
                  sync):
    """Program (j, s) (`_block_product`); then every split but the last writes its float32
    partials [rows8, bn] and signals column block j's semaphore (sync: on the GPU; interpret
    mode runs the grid in order, s fastest, so the last split comes after the others), and the
    last split waits for the others, adds their partials to its own, applies the epilogue
    and writes the block's m output rows. refs: the weights; the epilogue's inputs (the
    residual; or cos, sin and, with qk_norm, the q and k norms); its outputs ([m, N]; or q, k,
    v as [m, heads * d]); the partials [column blocks, n_splits - 1 (at least 1), rows8, bn]
    per weight (each block's contiguous: the last split loads them straight into registers).
    heads ("heads"): hq, hkv, d (= bn: a column block is one head), qk_norm, eps."""
    w_refs, refs = refs[:n_w], refs[n_w:]
    n_in = {"residual": 1, "silu": 0, "heads": 4 if heads and heads["qk_norm"] else 2}[epilogue]
    n_out = 3 if epilogue == "heads" else 1
    in_refs, out_refs = refs[:n_in], refs[n_in:n_in + n_out]
    part_refs = refs[n_in + n_out:n_in + n_out + n_w]
    bn, last = p.bn, p.n_splits - 1
    accs, j, s, col, row0 = _block_product(x_ref, w_refs, rows8=rows8, n_kb=n_kb, p=p,
                                           weights_first=weights_first, pdl=pdl)
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR((p.n_blocks,))) if sync else None
    f32, dt = jnp.float32, out_refs[0].dtype

    def write_partials(o_smem):
        for acc, o_buf in zip(accs, o_smem):
            o_buf[...] = acc
        plgpu.commit_smem()
        for part_ref, o_buf in zip(part_refs, o_smem):
            plgpu.copy_smem_to_gmem(o_buf.at[pl.ds(0, rows8)], part_ref.at[j, s])
        plgpu.wait_smem_to_gmem(0)  # (the writes done, not only read: then the signal)

    def load(ref, layout=None):  # every dtype in one register layout (interpret mode: none)
        if not sync:
            return ref[...]
        layout = layout or plgpu.Layout.WG_STRIDED(tuple(ref.shape), 2)
        return load_all(ref, layout, optimized=False)

    def totals(acc_smem):  # the products [rows8, bn], rounded as the unfused path rounds them
        out = []
        for acc, a_buf, part_ref in zip(accs, acc_smem, part_refs):
            a_buf[...] = acc
            plgpu.commit_smem()  # (the accumulators' stores seen by every thread)
            t = load(a_buf.at[pl.ds(0, rows8)])
            for i in range(last):
                t = t + load(part_ref.at[j, i])
            out.append(t.astype(dt).astype(f32))
        return out

    def store(out_smem, out_ref, c):  # the block's m rows, from shared memory
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, m)], out_ref.at[:, pl.ds(c, bn)])
        plgpu.wait_smem_to_gmem(0)

    def finish(acc_smem, res_smem, out_smem, bar):
        if epilogue == "residual":
            plgpu.copy_gmem_to_smem(in_refs[0].at[pl.ds(row0, rows8), pl.ds(col, bn)],
                                    res_smem, bar.at[0])
        tots = totals(acc_smem)
        if epilogue == "residual":  # x + o(attn) or x + down(h)
            plgpu.barrier_wait(bar.at[0])
            y = load(res_smem).astype(f32) + tots[0]
        else:  # silu(gate) * up
            g, u = tots
            y = g / (1.0 + jnp.exp(-g)) * u
        out_smem[...] = y.astype(dt)
        store(out_smem, out_refs[0], col)

    def finish_heads(acc_smem, cs_smem, nw_smem, out_smem, bar):
        """Head j: q and k heads RMS-normed over d (their norm's weight) and rotated
        (rotate-half), v heads as they are, each step rounded as `modeling.attention_inputs`
        rounds it. The row reductions run in wgmma's register layout on [64, d / 2] halves
        (rows past rows8 are never stored)."""
        hq, hkv, d, qk_norm, eps = (heads[k] for k in ("hq", "hkv", "d", "qk_norm", "eps"))
        half = d // 2
        is_qk = j < hq + hkv
        wl = plgpu.Layout.WGMMA

        @pl.when(is_qk)
        def _inputs():  # cos, sin and (each of rows8 rows) the head's norm weight
            for i, ref in enumerate(in_refs[:2]):
                plgpu.copy_gmem_to_smem(ref.at[pl.ds(row0, rows8)],
                                        cs_smem.at[i, pl.ds(0, rows8)], bar.at[0])
            if qk_norm:
                for norm_ref, this in ((in_refs[2], j < hq), (in_refs[3], j >= hq)):
                    @pl.when(this)
                    def _norm_rows():
                        for r in range(rows8):
                            plgpu.copy_gmem_to_smem(norm_ref, nw_smem.at[r], bar.at[0])

        acc_smem[0].at[pl.ds(0, rows8)][...] = totals(acc_smem)[0]
        plgpu.commit_smem()
        x1, x2 = (load(acc_smem[0].at[:, pl.ds(h * half, half)], wl) for h in (0, 1))

        @pl.when(is_qk)
        def _norm_rope():
            plgpu.barrier_wait(bar.at[0])
            norm_rope_into(out_smem, x1, x2, nw_smem, cs_smem, lambda ref: load(ref, wl),
                           d=d, eps=eps, qk_norm=qk_norm, dt=dt)

        @pl.when(~is_qk)
        def _v():
            out_smem.at[:, pl.ds(0, half)][...] = x1.astype(dt)
            out_smem.at[:, pl.ds(half, half)][...] = x2.astype(dt)

        for out_ref, lo, hi in ((out_refs[0], 0, hq), (out_refs[1], hq, hq + hkv),
                                (out_refs[2], hq + hkv, hq + 2 * hkv)):
            @pl.when((j >= lo) & (j < hi))
            def _store():
                store(out_smem, out_ref, pl.multiple_of((j - lo) * d, d))

    @pl.when(s < last)
    def _partials():
        pl.run_scoped(write_partials, [plgpu.SMEM((_M, bn), jnp.float32) for _ in range(n_w)])
        if sync:
            pl.semaphore_signal(sem.at[j])

    @pl.when(s == last)
    def _epilogue():
        if sync and last:
            pl.semaphore_wait(sem.at[j], last)  # (back to 0 for the next call)
        if epilogue == "heads":
            n_copies = 2 + (rows8 if heads["qk_norm"] else 0)
            pl.run_scoped(finish_heads, [plgpu.SMEM((_M, bn), jnp.float32)],
                          plgpu.SMEM((2, _M, bn // 2), jnp.float32),
                          plgpu.SMEM((_M, bn), in_refs[-1].dtype if heads["qk_norm"] else dt),
                          plgpu.SMEM((_M, bn), dt),
                          plgpu.Barrier(num_arrivals=n_copies, num_barriers=1))
            return
        pl.run_scoped(finish, [plgpu.SMEM((_M, bn), jnp.float32) for _ in range(n_w)],
                      plgpu.SMEM((rows8, bn), dt), plgpu.SMEM((rows8, bn), dt),
                      plgpu.Barrier(num_barriers=1))


def _fused_call(x, weights, epilogue, ins, outs, heads, config, interpret, launch_dependents,
                zero_fill):
    _check(x, weights)
    m, k = x.shape
    n = weights[0].shape[1]
    dtype = weights[0].dtype
    p = fused_plan(m, k, n, len(weights), config, jnp.dtype(dtype).itemsize, epilogue)
    if p is None or (heads and p.bn != heads["d"]):
        raise ValueError(f"mosaic_gpu skinny_matmul_fused: the grid for x {x.shape} times "
                         f"{len(weights)} x {weights[0].shape} does not fit the SMs at once"
                         + (f" in blocks of one head ({heads['d']} columns)" if heads else ""))
    rows8 = rows8_of(m)
    pdl = signals_dependents(launch_dependents, interpret)
    kernel = functools.partial(_fused_kernel, n_w=len(weights), m=m, rows8=rows8,
                               n_kb=k // p.bk, p=p, epilogue=epilogue, heads=heads,
                               weights_first=pdl or launch_dependents is True, pdl=pdl,
                               sync=not interpret)
    n_row_ins = {"residual": 1, "heads": 2}.get(epilogue, 0)  # the residual; cos and sin
    ins = tuple(pad_rows8(a, zero_fill) if i < n_row_ins else a
                for i, a in enumerate(ins))
    parts = jax.ShapeDtypeStruct((p.n_blocks, max(1, p.n_splits - 1), rows8, p.bn), jnp.float32)
    out = plgpu.kernel(
        kernel, out_type=list(outs) + [parts] * len(weights),
        grid=(p.n_blocks, p.n_splits), grid_names=("j", "s"),
        compiler_params=compiler_params(lane=True),  # (Warpgroup: no layout solution)
        interpret=interpret_params() if interpret else False,
    )(pad_rows8(x.astype(dtype), zero_fill), *weights, *ins)
    return out[:len(outs)]


@functools.partial(jax.jit, static_argnames=("epilogue", "interpret", "config",
                                             "launch_dependents", "zero_fill"))
def skinny_matmul_fused(x, weights, *, epilogue, residual=None, interpret=False, config=None,
                        launch_dependents=None, zero_fill=False):
    """x [M, K] (M <= 64) times each weight [K, N] (half precision) with the epilogue applied
    in the kernel, in x's dtype [M, N]:
      "residual": residual [M, N] + x @ w;
      "silu": silu(x @ w_gate) * (x @ w_up).
    Each product is rounded to x's dtype first, as the unfused path rounds it. Each column
    block's K splits meet in its last split (a semaphore per block, `_fused_kernel`), so no
    XLA fusion adds the partials up after the kernel. ValueError where the grid would not be
    resident at once (`fused_plan`); config, launch_dependents and zero_fill as in
    `skinny_matmul_partials`. The heads' epilogue: `skinny_matmul_heads`."""
    weights = tuple(weights)
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if len(weights) != (2 if epilogue == "silu" else 1):
        raise ValueError(f"epilogue {epilogue!r} takes {2 if epilogue == 'silu' else 1} "
                         f"weight(s), got {len(weights)}")
    _check(x, weights)
    m, n = x.shape[0], weights[0].shape[1]
    ins = ()
    if epilogue == "residual":
        if residual is None or residual.shape != (m, n):
            raise ValueError(f"the residual epilogue takes residual [{m}, {n}], got "
                             f"{None if residual is None else residual.shape}")
        ins = (residual.astype(x.dtype),)
    out, = _fused_call(x, weights, epilogue, ins, [jax.ShapeDtypeStruct((m, n), x.dtype)],
                       None, config, interpret, launch_dependents, zero_fill)
    return out


@functools.partial(jax.jit, static_argnames=("num_q_heads", "num_kv_heads", "eps", "interpret",
                                             "config", "launch_dependents", "zero_fill"))
def skinny_matmul_heads(x, w_qkv, cos, sin, q_norm=None, k_norm=None, *, num_q_heads,
                        num_kv_heads, eps=1e-6, interpret=False, config=None,
                        launch_dependents=None, zero_fill=False):
    """A decode step's heads from x [M, K] times the fused q/k/v weight [K, (Hq + 2 Hkv) D]
    in one kernel: q [M, Hq, D] and k [M, Hkv, D] RMS-normed per head by q_norm / k_norm [D]
    (both or neither) and rotated by cos, sin [M, D / 2] (float32, rotate-half), v as it is;
    each step rounded to x's dtype as `modeling.attention_inputs` rounds it. One column block
    per head (block_n = D, a multiple of 64). config, launch_dependents, zero_fill: as in
    `skinny_matmul_fused`."""
    _check(x, (w_qkv,))
    m, n = x.shape[0], w_qkv.shape[1]
    hq, hkv = num_q_heads, num_kv_heads
    d = n // (hq + 2 * hkv)
    if (hq + 2 * hkv) * d != n or d % _GRAIN:
        raise ValueError(f"w_qkv's {n} columns are not {hq} + 2 x {hkv} heads of a multiple "
                         f"of {_GRAIN}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together (or neither)")
    if cos.shape != (m, d // 2) or sin.shape != (m, d // 2):
        raise ValueError(f"cos and sin must be [{m}, {d // 2}], got {cos.shape}, {sin.shape}")
    qk_norm = q_norm is not None
    ins = (cos.astype(jnp.float32), sin.astype(jnp.float32))
    if qk_norm:
        ins += (q_norm, k_norm)
    cfg = dataclasses.replace(config or DEFAULT, block_n=d)
    heads = dict(hq=hq, hkv=hkv, d=d, qk_norm=qk_norm, eps=eps)
    outs = [jax.ShapeDtypeStruct((m, h * d), x.dtype) for h in (hq, hkv, hkv)]
    q, k, v = _fused_call(x, (w_qkv,), "heads", ins, outs, heads, cfg, interpret,
                          launch_dependents, zero_fill)
    return q.reshape(m, hq, d), k.reshape(m, hkv, d), v.reshape(m, hkv, d)
