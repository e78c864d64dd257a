"""Split-K multi-query decode attention for NVIDIA GPUs: Pallas with the Triton lowering.

One program per (row, KV head, split) holds that KV head's G*T query rows (the group's heads
times the T queries, padded to 16 or the next power of two) and reads each K/V block of its
split once for all of them, so a verify of a few tokens costs about one decode step. Each
query row masks its own causal edge; a row's programs stop at the end of its last valid
query, so a row without one does next to no work. A second small kernel merges the splits.

Row i of a program is query t = i % T of head h * G + i // T: the logits come out as
[B, Hq, T, S] (T inner) without a transpose.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sfi_jax.kernels.common import (as_layer_stacks, decode_splits, dot_precision, merge_splits,
                                    pow2, row_end)
from sfi_jax.kernels.triton_lowering import NUM_SMS as _NUM_SMS, M_INIT as _M_INIT, plgpu_triton

_MIN_ROWS = 16  # smallest M of tl.dot
MAX_ROWS = 256  # G * T rows per program at most (register file)


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning knobs: block_k a power of two; programs is the grid size aimed for."""

    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 2
    programs: int = 8 * _NUM_SMS


def default_config(rows: int, logits: bool) -> Config:
    """Starting point by padded row count: 16 rows as the dense decode kernel's tuning; more
    rows hold a larger score tile, so the key block shrinks to keep it in registers."""
    if rows <= 16:
        return Config(128, 4 if logits else 8, 2, (16 if logits else 8) * _NUM_SMS)
    if rows <= 32:
        return Config(128, 8, 2, (16 if logits else 8) * _NUM_SMS)
    return Config(64 if rows <= 64 else 32, 8, 2, 8 * _NUM_SMS)


def _kernel(layer_ref, qs_ref, len_ref, lq_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref,
            *logit_ref, n_q, hq, group, rows, group_rows, split, s_len, d, dp, bk, scale,
            precision, one_query):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    gt = group * n_q
    i = jnp.arange(rows)
    t = i % n_q
    live = i < gt
    qs = qs_ref[b]
    kvl = jnp.clip(len_ref[b], 0, s_len)
    pos = qs + t
    limit = jnp.where(live & (pos < kvl), pos + 1, 0)  # row i reads keys [0, limit)
    start = j * split
    end = jnp.minimum(start + split, s_len)
    hi = jnp.minimum(end, row_end(qs, kvl, n_q))
    dmask = None if dp == d else jnp.arange(dp) < d
    qmask = live[:, None] if dmask is None else live[:, None] & dmask[None, :]
    # q is [B, T * Hq, D]: row i reads q[b, t, h * G + i // T] (a gather of T * G rows)
    qrow = jnp.where(live, t * hq + h * group + i // n_q, 0)
    q = plgpu_triton.load(q_ref.at[b, qrow[:, None], jnp.arange(dp)[None, :]], mask=qmask,
                          other=0.0).astype(k_ref.dtype)
    idx = jnp.arange(bk)
    out_rows = pl.ds(h * gt, rows)
    if one_query:
        # only query lq's logits: its G heads' rows of q, scored by one more small dot per
        # block (the block's keys are loaded already) and written as rows h * G + g
        lq = lq_ref[b]
        has = (lq >= 0) & (lq < n_q)
        g = jnp.arange(group_rows)
        writes = (g < group) & has
        pos1 = qs + lq
        limit1 = jnp.where(has & (pos1 < kvl), pos1 + 1, 0)
        q1row = jnp.where(writes, jnp.clip(lq, 0, n_q - 1) * hq + h * group + g, 0)
        q1mask = writes[:, None] if dmask is None else writes[:, None] & dmask[None, :]
        q1 = plgpu_triton.load(q_ref.at[b, q1row[:, None], jnp.arange(dp)[None, :]],
                               mask=q1mask, other=0.0).astype(k_ref.dtype)
        logit_rows, logit_live = pl.ds(h * group, group_rows), writes
    else:
        logit_rows, logit_live = out_rows, live

    def store_logits(blk, s):
        cmask = (blk + idx) < end
        plgpu_triton.store(logit_ref[0].at[b, logit_rows, pl.ds(blk, bk)], s,
                           mask=logit_live[:, None] & cmask[None, :])

    def body(n, carry):
        acc, m, l = carry
        blk = start + n * bk
        cols = blk + idx
        kmask = cols < hi
        lmask = kmask[:, None] if dmask is None else kmask[:, None] & dmask[None, :]
        at = (layer, b, h, pl.ds(blk, bk), pl.ds(0, dp))
        kb = plgpu_triton.load(k_ref.at[at], mask=lmask, other=0.0)
        s = plgpu_triton.dot(q, kb, trans_b=True, precision=precision) * scale
        s = jnp.where(cols[None, :] < limit[:, None], s, -jnp.inf)
        if logit_ref and one_query:
            s1 = plgpu_triton.dot(q1, kb, trans_b=True, precision=precision) * scale
            store_logits(blk, jnp.where(cols[None, :] < limit1, s1, -jnp.inf))
        elif logit_ref:
            store_logits(blk, s)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        vb = plgpu_triton.load(v_ref.at[at], mask=lmask, other=0.0)
        acc = acc * alpha[:, None] + plgpu_triton.dot(p.astype(vb.dtype), vb,
                                                      precision=precision)
        return acc, m_new, l

    init = (jnp.zeros((rows, dp), jnp.float32), jnp.full((rows,), _M_INIT, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    n_blocks = pl.cdiv(jnp.maximum(hi - start, 0), bk)
    acc, m, l = lax.fori_loop(0, n_blocks, body, init)
    if logit_ref:
        # the split's blocks past the row's end: -inf, without reading K
        done = start + n_blocks * bk
        neg = jnp.full((group_rows if one_query else rows, bk), -jnp.inf, jnp.float32)

        def fill(n, c):
            store_logits(done + n * bk, neg)
            return c

        lax.fori_loop(0, pl.cdiv(jnp.maximum(end - done, 0), bk), fill, 0)
    keep = start < hi  # the merge reads only the splits that start before the row's end
    plgpu_triton.store(o_ref.at[b, j, out_rows, pl.ds(0, dp)], acc,
                       mask=(live[:, None] if dmask is None else qmask) & keep)
    plgpu_triton.store(m_ref.at[b, j, out_rows], m, mask=live & keep)
    plgpu_triton.store(l_ref.at[b, j, out_rows], l, mask=live & keep)


def _combine_kernel(qs_ref, len_ref, o_ref, m_ref, l_ref, out_ref, lse_ref, *, n_q, hq, split,
                    n_splits, nsp, s_len, d, dp):
    """Query row i = head * T + t of row b: merge the splits its row wrote, exactly."""
    b, i = pl.program_id(0), pl.program_id(1)
    end = row_end(qs_ref[b], jnp.clip(len_ref[b], 0, s_len), n_q)
    jmask = jnp.arange(nsp) < jnp.minimum(pl.cdiv(end, split), n_splits)
    dmask = jnp.arange(dp) < d
    m = plgpu_triton.load(m_ref.at[b, pl.ds(0, nsp), i], mask=jmask, other=-jnp.inf)
    l = plgpu_triton.load(l_ref.at[b, pl.ds(0, nsp), i], mask=jmask, other=0.0)
    o = plgpu_triton.load(o_ref.at[b, pl.ds(0, nsp), i, pl.ds(0, dp)],
                          mask=jmask[:, None] & dmask[None, :], other=0.0)
    out, mx, lsum, ok = merge_splits(m, l, o, jmask)
    # out is [B, T * Hq, D]: query t of head i // T
    plgpu_triton.store(out_ref.at[b, (i % n_q) * hq + i // n_q, pl.ds(0, dp)],
                       out.astype(out_ref.dtype), mask=dmask)
    plgpu_triton.store(lse_ref.at[b, i],
                       jnp.where(ok, mx + jnp.log(jnp.where(ok, lsum, 1.0)), -jnp.inf))


@functools.partial(jax.jit, static_argnames=("return_logits", "interpret", "config"))
def multi_query_decode(q, k, v, q_start, kv_len, layer=None, *, return_logits=False,
                       logits_query=None, interpret=False, config=None):
    """Multi-query decode attention (see kernels.multi_query_decode); one pass over K and V.

    q [B, T, Hq, D]; k, v [B, Hkv, S, D] or stacked [L, B, Hkv, S, D] read at `layer`.
    logits_query: int32 [B] (with return_logits): logits [B, Hq, S] of that query alone, none
    written for rows whose value is outside [0, T).
    config: a Config (None: default_config for the padded row count).
    """
    k, v, layer_arr = as_layer_stacks(layer, k, v)
    n_rows, n_q, hq, d = q.shape
    _, _, hkv, s_len, _ = k.shape
    group = hq // hkv
    rows = max(_MIN_ROWS, pow2(group * n_q))
    if rows > MAX_ROWS:
        raise ValueError(f"GQA group {group} x {n_q} queries = {group * n_q} rows per KV head; "
                         f"the GPU kernel takes at most {MAX_ROWS}")
    cfg = config or default_config(rows, return_logits)
    dp = pow2(d)
    bk = min(cfg.block_k, max(16, pow2(s_len)))
    split, n_splits = decode_splits(s_len, n_rows * hkv, bk, cfg.programs)
    q_start = q_start.astype(jnp.int32)
    kv_len = kv_len.astype(jnp.int32)
    kernel = functools.partial(
        _kernel, n_q=n_q, hq=hq, group=group, rows=rows, group_rows=max(_MIN_ROWS, pow2(group)),
        split=split, s_len=s_len, d=d, dp=dp,
        bk=bk, scale=1.0 / math.sqrt(d), precision=dot_precision(k.dtype),
        one_query=logits_query is not None)
    n_out = hq * n_q
    out_shape = [jax.ShapeDtypeStruct((n_rows, n_splits, n_out, d), jnp.float32),
                 jax.ShapeDtypeStruct((n_rows, n_splits, n_out), jnp.float32),
                 jax.ShapeDtypeStruct((n_rows, n_splits, n_out), jnp.float32)]
    if return_logits:
        n_logits = hq if logits_query is not None else n_out
        out_shape.append(jax.ShapeDtypeStruct((n_rows, n_logits, s_len), jnp.float32))
    lq = (jnp.full((n_rows,), -1, jnp.int32) if logits_query is None
          else logits_query.astype(jnp.int32))
    res = pl.pallas_call(
        kernel, grid=(n_rows, hkv, n_splits), out_shape=out_shape,
        compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps,
                                                    num_stages=cfg.num_stages),
        interpret=interpret, name="sfi_multi_query_decode",
    )(layer_arr, q_start, kv_len, lq, q.reshape(n_rows, n_q * hq, d), k, v)
    nsp = max(2, pow2(n_splits))
    combine = functools.partial(_combine_kernel, n_q=n_q, hq=hq, split=split,
                                n_splits=n_splits, nsp=nsp, s_len=s_len, d=d, dp=dp)
    out, lse = pl.pallas_call(
        combine, grid=(n_rows, n_out),
        out_shape=[jax.ShapeDtypeStruct((n_rows, n_q * hq, d), q.dtype),
                   jax.ShapeDtypeStruct((n_rows, n_out), jnp.float32)],
        compiler_params=plgpu_triton.CompilerParams(num_warps=1 if nsp * dp <= 4096 else 4,
                                                    num_stages=1),
        interpret=interpret, name="sfi_multi_query_combine",
    )(q_start, kv_len, res[0], res[1], res[2])
    out = out.reshape(n_rows, n_q, hq, d)
    if return_logits:
        logits = res[3] if logits_query is not None else res[3].reshape(n_rows, hq, n_q, s_len)
        return out, logits, lse.reshape(n_rows, hq, n_q)
    return out
