"""Flash prefill attention for TPU: Pallas with the Mosaic TPU lowering.

Grid (row, KV head, query block, key block). q_start, kv_len, the layer and the first cache
row are scalar prefetch, so the K/V index maps clamp to the last key block a query block
needs (its causal edge or the row's filled length): past it the block index repeats, Pallas
skips the copy, and `pl.when` skips the compute. Key blocks that every query of the block
sees whole take an unmasked step. The query group's G heads share each K/V block; the
online-softmax state lives in VMEM scratch.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sfi_jax.kernels.common import as_layer_stacks, cache_origin

BLOCK_Q = 128
BLOCK_K = 512
_LANES = 128
_M_INIT = -1e30  # finite, so exp(m_old - m_new) is never NaN


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _reach(first, kv, bq, t_len, i, s_len):
    """One past the last key position query block i needs (0 when none)."""
    return jnp.clip(jnp.minimum(first + jnp.minimum(bq, t_len - i * bq), kv), 0, s_len)


def _kernel(qs_ref, kv_ref, at_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *,
            t_len, s_len, scale, group):
    del at_ref
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    bq, bk = q_ref.shape[1], k_ref.shape[0]
    kv = jnp.clip(kv_ref[b], 0, s_len)
    first = qs_ref[b] + i * bq
    hi = _reach(first, kv, bq, t_len, i, s_len)
    start = j * bk
    whole = (start + bk <= first + 1) & (start + bk <= kv)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, _M_INIT, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def update(masked):
        k = k_ref[...]
        v = v_ref[...]
        prec = _precision(k.dtype)
        if masked:
            key = start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
            pos = first + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
            ok = (key <= pos) & (key < kv)
            # rows past kv may be padding or stale: zero them so 0 * NaN cannot leak
            vkey = start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
            v = jnp.where(vkey < kv, v, 0)
        for g in range(group):
            s = lax.dot_general(q_ref[g].astype(k.dtype), k, (((1,), (1,)), ((), ())),
                                precision=prec, preferred_element_type=jnp.float32) * scale
            if masked:
                s = jnp.where(ok, s, -jnp.inf)
            m_prev = m_sc[g]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.exp(s - m_new[:, :1])
            l_sc[g] = alpha * l_sc[g] + jnp.sum(p, axis=1, keepdims=True)
            m_sc[g] = m_new
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                                 preferred_element_type=jnp.float32)
            acc_sc[g] = acc_sc[g] * alpha[:, :1] + pv

    pl.when(whole)(lambda: update(False))
    pl.when(jnp.logical_not(whole) & (start < hi))(lambda: update(True))

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        for g in range(group):
            l = l_sc[g][:, :1]
            ok = l != 0  # no valid key: 0; NaN inputs stay NaN
            o_ref[g] = jnp.where(ok, acc_sc[g] / jnp.where(ok, l, 1.0), 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "interpret"))
def prefill_attention(q, k, v, q_start, kv_len, layer=None, row=None, *, block_q=None,
                      block_k=None, interpret=None):
    """Flash prefill attention (see kernels.prefill_attention.prefill_attention)."""
    b, t, hq, d = q.shape
    k, v, layer = as_layer_stacks(layer, k, v)
    hkv, s_len = k.shape[2], k.shape[3]
    group = hq // hkv
    bq = min(block_q or BLOCK_Q, -(-t // 8) * 8)
    bk = block_k or BLOCK_K
    bk = s_len if s_len <= bk else bk  # the whole axis, or (8, 128)-aligned blocks
    nq, nk = -(-t // bq), -(-s_len // bk)
    # [B, Hkv, G, T, D]: a block is G heads x bq positions, (8, 128)-aligned
    qg = jnp.pad(q, ((0, 0), (0, nq * bq - t), (0, 0), (0, 0)))
    qg = qg.reshape(b, nq * bq, hkv, group, d).transpose(0, 2, 3, 1, 4)

    def kv_map(r, h, i, j, qs, kvl, at):
        first = qs[r] + i * bq
        hi = _reach(first, jnp.clip(kvl[r], 0, s_len), bq, t, i, s_len)
        return at[0], at[1] + r, h, jnp.minimum(j, jnp.maximum(pl.cdiv(hi, bk) - 1, 0)), 0

    q_spec = pl.BlockSpec((None, None, group, bq, d), lambda r, h, i, j, *_: (r, h, 0, i, 0))
    kv_spec = pl.BlockSpec((None, None, None, bk, d), kv_map)
    kernel = functools.partial(_kernel, t_len=t, s_len=s_len, scale=1.0 / math.sqrt(d),
                               group=group)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(b, hkv, nq, nk), in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((group, bq, _LANES), jnp.float32),
                            pltpu.VMEM((group, bq, _LANES), jnp.float32),
                            pltpu.VMEM((group, bq, d), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="sfi_prefill_attention",
    )(q_start.astype(jnp.int32), kv_len.astype(jnp.int32), cache_origin(layer, row), qg, k, v)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, nq * bq, hq, d)[:, :t]
