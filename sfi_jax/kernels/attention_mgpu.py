"""Split-K flash-decoding kernels for NVIDIA Hopper GPUs: Pallas with the Mosaic GPU lowering.

Layout: one CTA (one warpgroup) per (query row, KV head, split). The KV head's query group is
the M dimension of wgmma, padded to 64 rows. The CTA streams the bf16/f16 key and value blocks of
its split that lie inside the row's valid range from global to shared memory with TMA, `stages`
blocks in flight, runs q·Kᵀ and P·V on the tensor cores and keeps the online softmax in
registers. Each split writes a partial (acc, m, l); an exact merge follows.

Only half-precision caches with head dim 64, 128 or 256 and GQA groups up to 64 take the tensor
core path; other inputs (float32 caches: wgmma would round them to TF32) run the Triton kernel.
Off a GPU the kernels run in Mosaic GPU's interpret mode (TMA reads past the end give zeros,
as on the GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sfi_jax.kernels.common import as_layer_stack

_M = 64  # wgmma's M per warpgroup: a query group is padded to this
_NUM_SMS = 132
HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Config:
    """block_k: keys per pipeline step (a multiple of 64); stages: blocks in flight;
    programs: the grid size aimed for (splits = programs / (rows * KV heads))."""

    block_k: int = 128
    stages: int = 2
    programs: int = 2 * _NUM_SMS


DENSE = Config(block_k=128, stages=2, programs=2 * _NUM_SMS)


def interpret_params():
    """Mosaic GPU interpret mode as the kernels expect it: TMA reads past an array's end give
    zeros, as the hardware's bounds fill does."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")


def supported(q, k) -> bool:
    """Whether the tensor-core kernels take these inputs (else the Triton twin runs)."""
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-3]
    return (jnp.dtype(k.dtype) in HALF and d in (64, 128, 256) and hq // hkv <= _M)


def _swizzle(d, itemsize):
    return min(128, d * itemsize)


def _smem_kv(shape, dtype):
    itemsize = jnp.dtype(dtype).itemsize
    sw = _swizzle(shape[-1], itemsize)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, sw // itemsize)),
                                                plgpu.SwizzleTransform(sw)))


def _splits(total, pairs, cfg):
    """Split length (a multiple of block_k) and count covering `total` keys per (row, head)."""
    bk = cfg.block_k
    want = max(1, -(-cfg.programs // max(pairs, 1)))
    split = max(bk, -(-max(total, 1) // want))
    split = -(-split // bk) * bk
    return split, max(1, -(-max(total, 1) // split))


def _layout(x, layout, interpret):
    """x in register layout `layout` (interpret mode has no layouts)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def _iota(shape, dim, interpret):
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _qk(q_smem, k_smem, interpret):
    """q·kᵀ [64, block_k] in float32 on the tensor cores. Interpret mode has no transposed
    wgmma operand: there the same product is a jnp dot of the shared-memory tiles."""
    if interpret:
        return jnp.dot(q_smem[...], k_smem[...].T, preferred_element_type=jnp.float32)

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
        return acc_ref[...]

    return pl.run_scoped(qk, plgpu.ACC((_M, k_smem.shape[0]), jnp.float32))


def _dense_kernel(layer_ref, len_ref, rows_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref,
                  *rest, group, split, s_len, bk, stages, scale, logits, interpret):
    """Program (r, h, j): keys [j * split, min(+split, length)) of cache row rows[r], KV head h.
    Partials: o [R, n, Hq, D] (the group's rows), m, l [R, n, Hkv, 64] (padded rows too).
    logits: also the scaled scores [R, Hq, S], -inf from the row's length on."""
    if logits:
        lg_ref, scratch = rest[0], rest[1:]
    else:
        lg_ref, scratch = None, rest
    (q_smem, k_smem, v_smem, p_smem, s_smem, o_smem, ml_smem, q_bar, k_bar, v_bar) = scratch
    r, h, j = lax.axis_index("r"), lax.axis_index("h"), lax.axis_index("j")
    layer, row = layer_ref[0], rows_ref[r]
    length = jnp.clip(len_ref[r], 0, s_len)
    start = j * split
    end = jnp.minimum(start + split, s_len)
    hi = jnp.minimum(end, length)
    n = lax.div(jnp.maximum(hi - start, 0) + (bk - 1), bk)
    kv = (layer, row, h)
    dtype = k_smem.dtype

    plgpu.copy_gmem_to_smem(q_ref.at[r, h], q_smem, q_bar)

    def fetch(i, slot):
        blk = (*kv, pl.ds(start + i * bk, bk))
        plgpu.copy_gmem_to_smem(k_ref.at[blk], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[blk], v_smem.at[slot], v_bar.at[slot])

    for i in range(stages):
        pl.when(i < n)(functools.partial(fetch, i, i))
    plgpu.barrier_wait(q_bar)

    def store_logits(at):
        """The group's rows of s_smem to logits [at, at + bk). The hardware clips a block past
        S; interpret mode drops such a store, so there the last block is stored at its size."""
        def store(size):
            plgpu.copy_smem_to_gmem(s_smem.at[pl.ds(0, group), pl.ds(0, size)],
                                    lg_ref.at[r, pl.ds(h * group, group), pl.ds(at, size)])

        tail = s_len % bk
        if interpret and tail:
            pl.when(at + bk <= s_len)(lambda: store(bk))
            pl.when(at + bk > s_len)(lambda: store(tail))
        else:
            store(bk)

    def step(i, carry):
        acc, m, l = carry
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(k_bar.at[slot])

        s = _qk(q_smem, k_smem.at[slot], interpret) * scale
        col = _iota((_M, bk), 1, interpret)
        s = jnp.where(col < hi - (start + i * bk), s, -jnp.inf)
        if logits:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last block's store read it
            s_smem[...] = s
            plgpu.commit_smem()
            store_logits(start + i * bk)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(v_bar.at[slot])
        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        acc = acc + pl.run_scoped(pv, plgpu.ACC((_M, acc.shape[1]), jnp.float32))
        # both wgmmas have read this slot: refill it
        pl.when(i + stages < n)(lambda: fetch(i + stages, slot))
        return acc, m_new, l

    d = q_smem.shape[-1]
    acc = _layout(jnp.zeros((_M, d), jnp.float32), plgpu.Layout.WGMMA, interpret)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m = _layout(jnp.full((_M,), -jnp.inf, jnp.float32), row_layout, interpret)
    l = _layout(jnp.zeros((_M,), jnp.float32), row_layout, interpret)
    acc, m, l = lax.fori_loop(0, n, step, (acc, m, l))

    if logits:  # blocks of this split past the row's length: -inf, without reading K
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        neg = jnp.full((_M, bk), -jnp.inf, jnp.float32)
        s_smem[...] = _layout(neg, plgpu.Layout.WGMMA, interpret)
        plgpu.commit_smem()
        n_all = lax.div(end - start + (bk - 1), bk)

        @pl.loop(n, jnp.maximum(n, n_all))
        def _fill(i):
            store_logits(start + i * bk)

    o_smem[...] = acc
    ml_smem[0] = m
    ml_smem[1] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], o_ref.at[r, j, pl.ds(h * group, group)])
    plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[r, j, h])
    plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[r, j, h])
    plgpu.wait_smem_to_gmem(0)


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


def _pad_q(q, hkv):
    """q [R, Hq, D] -> [R, Hkv, 64, D]: each KV head's query group, zero rows below."""
    n_rows, hq, d = q.shape
    qg = q.reshape(n_rows, hkv, hq // hkv, d)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, _M - hq // hkv), (0, 0)))


@functools.partial(jax.jit, static_argnames=("return_logits", "interpret", "config"))
def dense_decode(q, k, v, lengths, layer=None, rows=None, *, return_logits=False,
                 interpret=False, config=None):
    """Dense decode attention (see kernels.attention.dense_decode) of q [R, Hq, D] over cache
    rows `rows` (default: row r) of k, v [(L,) B, Hkv, S, D], half precision. Returns out, or
    (out, logits [R, Hq, S] float32 with -inf from each row's length on, lse [R, Hq])."""
    cfg = config or DENSE
    k, layer_arr = as_layer_stack(k, layer)
    v, _ = as_layer_stack(v, layer)
    n_rows, hq, d = q.shape
    _, _, hkv, s_len, _ = k.shape
    group = hq // hkv
    if not supported(q, k):
        raise ValueError(f"mosaic_gpu dense_decode takes bf16/f16 caches, head dim 64/128/256 "
                         f"and groups <= {_M}; got {k.dtype}, d={d}, group={group}")
    bk = cfg.block_k
    split, n_splits = _splits(s_len, n_rows * hkv, cfg)
    rows = jnp.arange(n_rows, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
    kernel = functools.partial(
        _dense_kernel, group=group, split=split, s_len=s_len, bk=bk, stages=cfg.stages,
        scale=1.0 / math.sqrt(d), logits=return_logits, interpret=interpret)
    out_type = [jax.ShapeDtypeStruct((n_rows, n_splits, hq, d), jnp.float32),
                jax.ShapeDtypeStruct((n_rows, n_splits, hkv, _M), jnp.float32),
                jax.ShapeDtypeStruct((n_rows, n_splits, hkv, _M), jnp.float32)]
    s_lg = -(-s_len // 4) * 4  # TMA: the logits' row stride a multiple of 16 bytes
    if return_logits:
        out_type.append(jax.ShapeDtypeStruct((n_rows, hq, s_lg), jnp.float32))
    scratch = [
        _smem_kv((_M, d), k.dtype),
        _smem_kv((cfg.stages, bk, d), k.dtype),
        _smem_kv((cfg.stages, bk, d), k.dtype),
        _smem_kv((_M, bk), k.dtype),
        plgpu.SMEM((_M, bk), jnp.float32),
        plgpu.SMEM((_M, d), jnp.float32),
        plgpu.SMEM((2, _M), jnp.float32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=cfg.stages),
        plgpu.Barrier(num_barriers=cfg.stages),
    ]
    res = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch,
        grid=(n_rows, hkv, n_splits), grid_names=("r", "h", "j"),
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=interpret_params() if interpret else False,
    )(layer_arr, lengths.astype(jnp.int32), rows, _pad_q(q.astype(k.dtype), hkv), k, v)
    out, lse = _combine(res[0], res[1], res[2], group, q.dtype)
    if not return_logits:
        return out
    return out, res[3] if s_lg == s_len else res[3][..., :s_len], lse
