"""Decode attention kernels for TPU: Pallas with the Mosaic TPU lowering.

One grid step per (query row, KV head, key block). Lengths, window starts, the layer
and the row map are scalar-prefetched, so index maps can clamp to the last block a
row needs: past that, the block index repeats and Pallas skips the copy, and
`pl.when` skips the compute. The online-softmax state lives in VMEM scratch.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sfi_jax.kernels.common import as_layer_stacks, dot_precision

BLOCK_K = 512
_LANES = 128


def _block(size, bk):
    """Key block: bk (a multiple of 128) or the whole axis when it is shorter."""
    return size if size <= bk else bk


def _last(n, bk):
    """Index of the last block holding one of n keys (0 when n == 0)."""
    return jnp.maximum(pl.cdiv(n, bk) - 1, 0)


def _init(m_sc, l_sc, acc_sc):
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


def _update(q_ref, k_ref, v_ref, m_sc, l_sc, acc_sc, start, lo, hi, scale):
    """Fold keys [lo, hi) of the block at `start` into the running softmax; returns scores."""
    bk = k_ref.shape[0]
    k = k_ref[...]
    s = lax.dot_general(q_ref[...].astype(k.dtype), k, (((1,), (1,)), ((), ())),
                        precision=dot_precision(k.dtype), preferred_element_type=jnp.float32)
    pos = start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    s = jnp.where((pos >= lo) & (pos < hi), s * scale, -jnp.inf)
    fold_scores(s, v_ref, m_sc, l_sc, acc_sc, start, lo, hi)
    return s


def fold_scores(s, v_ref, m_sc, l_sc, acc_sc, start, lo, hi):
    """Online softmax: fold the masked scores s [rows, bk] of the key block at `start` (keys
    [lo, hi) valid) into the running max m_sc, sum l_sc and output acc_sc."""
    bk = v_ref.shape[0]
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    # a row that has seen no valid key yet (max -inf) folds zeros, not exp(-inf + inf) = NaN,
    # so finish_rows tells it (l == 0) from a row fed NaN (l NaN)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe[:, :1])
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    m_sc[...] = m_new
    # Rows outside [lo, hi) may be padding or stale data: zero them so 0 * NaN cannot leak.
    vpos = start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
    v = jnp.where((vpos >= lo) & (vpos < hi), v_ref[...], 0)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         precision=dot_precision(v.dtype), preferred_element_type=jnp.float32)
    acc_sc[...] = acc_sc[...] * alpha[:, :1] + pv


def finish_rows(o_ref, lse_ref, m_sc, l_sc, acc_sc):
    """The softmax's output (acc / l, 0 for a row that saw no key) and, unless lse_ref is
    None, its log-sum-exp."""
    l = l_sc[...][:, :1]
    ok = l != 0  # no valid key: 0; NaN inputs stay NaN
    safe = jnp.where(ok, l, 1.0)
    o_ref[...] = jnp.where(ok, acc_sc[...] / safe, 0.0).astype(o_ref.dtype)
    if lse_ref is not None:
        lse_ref[...] = jnp.where(ok, m_sc[...][:, :1] + jnp.log(safe), -jnp.inf)


def _dense_kernel(len_ref, layer_ref, rows_ref, q_ref, k_ref, v_ref, o_ref, *rest, s_len, scale,
                  with_logits):
    if with_logits:
        lg_ref, lse_ref, m_sc, l_sc, acc_sc = rest
    else:
        (m_sc, l_sc, acc_sc), lg_ref, lse_ref = rest, None, None
    del layer_ref, rows_ref
    r, j = pl.program_id(0), pl.program_id(2)
    bk = k_ref.shape[0]
    length = jnp.clip(len_ref[r], 0, s_len)
    start = j * bk

    @pl.when(j == 0)
    def _():
        _init(m_sc, l_sc, acc_sc)

    @pl.when(start < length)
    def _():
        s = _update(q_ref, k_ref, v_ref, m_sc, l_sc, acc_sc, start, 0, length, scale)
        if with_logits:
            lg_ref[...] = s

    if with_logits:
        @pl.when(start >= length)
        def _():
            lg_ref[...] = jnp.full(lg_ref.shape, -jnp.inf, jnp.float32)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        finish_rows(o_ref, lse_ref, m_sc, l_sc, acc_sc)


def _scratch(group, d):
    return [pltpu.VMEM((group, _LANES), jnp.float32), pltpu.VMEM((group, _LANES), jnp.float32),
            pltpu.VMEM((group, d), jnp.float32)]


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


@functools.partial(jax.jit, static_argnames=("return_logits", "interpret", "block_k"))
def dense_decode(q, k, v, lengths, layer=None, rows=None, *, return_logits=False,
                 interpret=None, block_k=BLOCK_K):
    """Dense decode attention (see kernels.attention.dense_decode)."""
    k, v, layer_arr = as_layer_stacks(layer, k, v)
    n_rows, hq, d = q.shape
    hkv, s_len = k.shape[2], k.shape[3]
    group = hq // hkv
    rows = jnp.arange(n_rows, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
    bk = _block(s_len, block_k)
    nb = pl.cdiv(s_len, bk)

    def kv_map(r, h, j, lens, lay, rws):
        return lay[0], rws[r], h, jnp.minimum(j, _last(jnp.clip(lens[r], 0, s_len), bk)), 0

    in_specs = [pl.BlockSpec((None, None, group, d), lambda r, h, j, *_: (r, h, 0, 0)),
                pl.BlockSpec((None, None, None, bk, d), kv_map),
                pl.BlockSpec((None, None, None, bk, d), kv_map)]
    out_specs = [pl.BlockSpec((None, None, group, d), lambda r, h, j, *_: (r, h, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((n_rows, hkv, group, d), q.dtype)]
    if return_logits:
        out_specs += [pl.BlockSpec((None, None, group, bk), lambda r, h, j, *_: (r, h, 0, j)),
                      pl.BlockSpec((None, None, group, 1), lambda r, h, j, *_: (r, h, 0, 0))]
        out_shape += [jax.ShapeDtypeStruct((n_rows, hkv, group, s_len), jnp.float32),
                      jax.ShapeDtypeStruct((n_rows, hkv, group, 1), jnp.float32)]
    kernel = functools.partial(_dense_kernel, s_len=s_len, scale=1.0 / math.sqrt(d),
                               with_logits=return_logits)
    res = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(n_rows, hkv, nb), in_specs=in_specs,
            out_specs=out_specs, scratch_shapes=_scratch(group, d)),
        out_shape=out_shape, compiler_params=_params(), interpret=interpret,
        name="sfi_dense_decode",
    )(lengths.astype(jnp.int32), layer_arr, rows, q.reshape(n_rows, hkv, group, d), k, v)
    out = res[0].reshape(n_rows, hq, d)
    if return_logits:
        return out, res[1].reshape(n_rows, hq, s_len), res[2].reshape(n_rows, hq)
    return out


def _sparse_kernel(clen_ref, rs_ref, len_ref, layer_ref, q_ref, ck_ref, cv_ref, k_ref, v_ref,
                   o_ref, m_sc, l_sc, acc_sc, *, n_c, hkv, s_len, c_size, scale):
    del layer_ref
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bc, br = ck_ref.shape[0], k_ref.shape[0]
    c_len = jnp.clip(clen_ref[b * hkv + h], 0, c_size)
    length = jnp.clip(len_ref[b], 0, s_len)
    rs = jnp.clip(rs_ref[b], 0, length)

    @pl.when(j == 0)
    def _():
        _init(m_sc, l_sc, acc_sc)

    @pl.when((j < n_c) & (j * bc < c_len))
    def _():
        _update(q_ref, ck_ref, cv_ref, m_sc, l_sc, acc_sc, j * bc, 0, c_len, scale)

    start = (lax.div(rs, br) + j - n_c) * br

    @pl.when((j >= n_c) & (start < length))
    def _():
        _update(q_ref, k_ref, v_ref, m_sc, l_sc, acc_sc, start, rs, length, scale)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        finish_rows(o_ref, None, m_sc, l_sc, acc_sc)


@functools.partial(jax.jit, static_argnames=("window", "interpret", "block_k"))
def sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths, layer=None, *, window=None,
                  interpret=None, block_k=BLOCK_K):
    """Compact + recent-window decode attention (see kernels.attention.sparse_decode).

    The grid covers ceil(C / block) compact steps plus enough recent steps for `window`
    keys at any alignment (the whole cache when window is None).
    """
    ck, cv, k, v, layer_arr = as_layer_stacks(layer, ck, cv, k, v)
    n_rows, hq, d = q.shape
    hkv, s_len, c_size = k.shape[2], k.shape[3], ck.shape[3]
    group = hq // hkv
    bc, br = _block(c_size, block_k), _block(s_len, block_k)
    n_c = pl.cdiv(c_size, bc)
    n_s = pl.cdiv(s_len, br)
    n_r = n_s if window is None else min(n_s, (max(window, 1) + br - 2) // br + 1)

    def c_map(b, h, j, clen, rs, lens, lay):
        last = _last(jnp.clip(clen[b * hkv + h], 0, c_size), bc)
        return lay[0], b, h, jnp.minimum(j, last), 0

    def r_map(b, h, j, clen, rs, lens, lay):
        length = jnp.clip(lens[b], 0, s_len)
        first = lax.div(jnp.clip(rs[b], 0, length), br)
        return lay[0], b, h, jnp.minimum(first + jnp.maximum(j - n_c, 0), _last(length, br)), 0

    in_specs = [pl.BlockSpec((None, None, group, d), lambda b, h, j, *_: (b, h, 0, 0)),
                pl.BlockSpec((None, None, None, bc, d), c_map),
                pl.BlockSpec((None, None, None, bc, d), c_map),
                pl.BlockSpec((None, None, None, br, d), r_map),
                pl.BlockSpec((None, None, None, br, d), r_map)]
    kernel = functools.partial(_sparse_kernel, n_c=n_c, hkv=hkv, s_len=s_len, c_size=c_size,
                               scale=1.0 / math.sqrt(d))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(n_rows, hkv, n_c + n_r), in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, group, d), lambda b, h, j, *_: (b, h, 0, 0)),
            scratch_shapes=_scratch(group, d)),
        out_shape=jax.ShapeDtypeStruct((n_rows, hkv, group, d), q.dtype),
        compiler_params=_params(), interpret=interpret, name="sfi_sparse_decode",
    )(c_len.reshape(-1).astype(jnp.int32), recent_start.astype(jnp.int32),
      lengths.astype(jnp.int32), layer_arr, q.reshape(n_rows, hkv, group, d), ck, cv, k, v)
    return out.reshape(n_rows, hq, d)
