"""Multi-query decode attention for TPU: Pallas with the Mosaic TPU lowering.

One grid step per (row, KV head, key block); the block of G*T query rows (head-major, T
inner) is folded into an online softmax held in VMEM scratch. q_start and kv_len are
scalar-prefetched: index maps clamp the key block to the last one a row needs, so past it
the block index repeats and Pallas skips the copy, and `pl.when` skips the compute.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sfi_jax.kernels.attention_tpu import finish_rows, fold_scores
from sfi_jax.kernels.common import as_layer_stacks, dot_precision, row_end

BLOCK_K = 512
_LANES = 128
_M_INIT = -1e30  # finite: a padding query row (no valid key anywhere) never makes NaN


def _kernel(qs_ref, len_ref, layer_ref, q_ref, k_ref, v_ref, o_ref, *rest, n_q, s_len, scale,
            with_logits):
    if with_logits:
        lg_ref, lse_ref, m_sc, l_sc, acc_sc = rest
    else:
        (m_sc, l_sc, acc_sc), lg_ref, lse_ref = rest, None, None
    del layer_ref
    b, j = pl.program_id(0), pl.program_id(2)
    gt, bk = q_ref.shape[0], k_ref.shape[0]
    qs = qs_ref[b]
    kvl = jnp.clip(len_ref[b], 0, s_len)
    hi = row_end(qs, kvl, n_q)
    start = j * bk

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, _M_INIT, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(start < hi)
    def _():
        k = k_ref[...]
        s = lax.dot_general(q_ref[...].astype(k.dtype), k, (((1,), (1,)), ((), ())),
                            precision=dot_precision(k.dtype),
                            preferred_element_type=jnp.float32) * scale
        pos = qs + lax.rem(lax.broadcasted_iota(jnp.int32, (gt, 1), 0), n_q)  # row's query
        limit = jnp.where(pos < kvl, pos + 1, 0)
        cols = start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        s = jnp.where(cols < limit, s, -jnp.inf)
        fold_scores(s, v_ref, m_sc, l_sc, acc_sc, start, 0, hi)
        if with_logits:
            lg_ref[...] = s

    if with_logits:
        @pl.when(start >= hi)
        def _():
            lg_ref[...] = jnp.full(lg_ref.shape, -jnp.inf, jnp.float32)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        finish_rows(o_ref, lse_ref, m_sc, l_sc, acc_sc)


@functools.partial(jax.jit, static_argnames=("return_logits", "interpret", "block_k"))
def multi_query_decode(q, k, v, q_start, kv_len, layer=None, *, return_logits=False,
                       interpret=None, block_k=BLOCK_K):
    """Multi-query decode attention (see kernels.multi_query_decode).

    block_k: key block, a multiple of 128 (the whole cache when it is shorter).
    """
    k, v, layer_arr = as_layer_stacks(layer, k, v)
    n_rows, n_q, hq, d = q.shape
    hkv, s_len = k.shape[2], k.shape[3]
    group = hq // hkv
    gt = group * n_q
    bk = s_len if s_len <= block_k else block_k
    nb = pl.cdiv(s_len, bk)
    # rows of a KV head: its G heads, each with T queries (T inner, as the logits)
    qh = q.reshape(n_rows, n_q, hkv, group, d).transpose(0, 2, 3, 1, 4).reshape(
        n_rows, hkv, gt, d)

    def kv_map(b, h, j, qs, lens, lay):
        end = row_end(qs[b], jnp.clip(lens[b], 0, s_len), n_q)
        return lay[0], b, h, jnp.minimum(j, jnp.maximum(pl.cdiv(end, bk) - 1, 0)), 0

    row_spec = pl.BlockSpec((None, None, gt, d), lambda b, h, j, *_: (b, h, 0, 0))
    in_specs = [row_spec, pl.BlockSpec((None, None, None, bk, d), kv_map),
                pl.BlockSpec((None, None, None, bk, d), kv_map)]
    out_specs = [row_spec]
    out_shape = [jax.ShapeDtypeStruct((n_rows, hkv, gt, d), q.dtype)]
    if return_logits:
        out_specs += [pl.BlockSpec((None, None, gt, bk), lambda b, h, j, *_: (b, h, 0, j)),
                      pl.BlockSpec((None, None, gt, 1), lambda b, h, j, *_: (b, h, 0, 0))]
        out_shape += [jax.ShapeDtypeStruct((n_rows, hkv, gt, s_len), jnp.float32),
                      jax.ShapeDtypeStruct((n_rows, hkv, gt, 1), jnp.float32)]
    kernel = functools.partial(_kernel, n_q=n_q, s_len=s_len, scale=1.0 / math.sqrt(d),
                               with_logits=return_logits)
    scratch = [pltpu.VMEM((gt, _LANES), jnp.float32), pltpu.VMEM((gt, _LANES), jnp.float32),
               pltpu.VMEM((gt, d), jnp.float32)]
    res = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(n_rows, hkv, nb), in_specs=in_specs,
            out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret, name="sfi_multi_query_decode",
    )(q_start.astype(jnp.int32), kv_len.astype(jnp.int32), layer_arr, qh, k, v)
    out = res[0].reshape(n_rows, hkv, group, n_q, d).transpose(0, 3, 1, 2, 4).reshape(
        n_rows, n_q, hq, d)
    if return_logits:
        return out, res[1].reshape(n_rows, hq, n_q, s_len), res[2].reshape(n_rows, hq, n_q)
    return out
