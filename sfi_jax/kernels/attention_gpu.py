"""Split-K flash-decoding kernels for NVIDIA GPUs: Pallas with the Triton lowering.

This is the only module that touches `jax.experimental.pallas.triton`; the Triton
lowering is deprecated upstream in favour of Mosaic GPU, so it stays behind this file.

Layout: one program per (query row, KV head, split). The program loads the KV head's
query group padded to 16 rows (the smallest tl.dot), walks the key blocks of its split
that lie inside the row's valid range, and writes a partial (acc, m, l); a second small
kernel merges the splits exactly. Split counts aim at a few waves of the 132 SMs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sfi_jax.kernels.common import (as_layer_stacks, decode_splits, dot_precision,
                                    merge_splits, pow2, row_split)
from sfi_jax.kernels.triton_lowering import NUM_SMS as _NUM_SMS, M_INIT as _M_INIT, plgpu_triton
from sfi_jax.kernels.triton_lowering import dependents_mask, signals_dependents

_ROWS = 16  # smallest M of tl.dot: query groups are padded to this


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning knobs; block_k is a power of two, programs is the grid size aimed for."""

    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs: int = 8 * _NUM_SMS
    per_row: bool = False  # programs aimed for per query row instead of per call
    # dense: a row's splits share its own length, not the cache's (a row shorter than the
    # cache, e.g. an Engine slot's, then keeps every program busy); off only to compare
    by_length: bool = True


# Chosen by the sweep of scripts/bench/bench_kernels.py; neighbouring configurations were
# within a few percent. A call's `config=` replaces them (a sweep point).
DENSE = Config(block_k=128, num_warps=8, num_stages=2, programs=8 * _NUM_SMS)
DENSE_LOGITS = Config(block_k=128, num_warps=4, num_stages=2, programs=16 * _NUM_SMS)
# The engine's refresh call (logits written in place): its slots are mostly empty, and an
# empty slot's programs still cost a launch wave each, so split counts follow one row.
REFRESH = Config(block_k=128, num_warps=4, num_stages=2, programs=2 * _NUM_SMS, per_row=True)
SPARSE_SMALL = Config(block_k=32, num_warps=4, num_stages=2, programs=4 * _NUM_SMS)
SPARSE = Config(block_k=64, num_warps=4, num_stages=3, programs=2 * _NUM_SMS)
SMALL_KEYS = 1536  # keys per (row, head) up to which the sparse kernel uses SPARSE_SMALL


def _attend(q, k_ref, v_ref, at, lo, hi, carry, *, bk, dp, dmask, scale, precision, logits=None):
    """Online softmax of q [16, dp] over keys [lo, hi) of k_ref[at], v_ref[at], block by block.

    Each access is one indexer (`at` + the block), so interpret mode pads instead of clamping.

    `logits(start, s)` (optional) stores a block of scaled scores as they are made.
    """
    n = pl.cdiv(jnp.maximum(hi - lo, 0), bk)
    idx = jnp.arange(bk)

    def body(i, c):
        acc, m, l = c
        start = lo + i * bk
        kmask = (start + idx) < hi
        lmask = kmask[:, None] if dmask is None else kmask[:, None] & dmask[None, :]
        blk = (*at, pl.ds(start, bk), pl.ds(0, dp))
        k = plgpu_triton.load(k_ref.at[blk], mask=lmask, other=0.0)
        s = plgpu_triton.dot(q, k, trans_b=True, precision=precision) * scale
        s = jnp.where(kmask[None, :], s, -jnp.inf)
        if logits is not None:
            logits(start, s)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        v = plgpu_triton.load(v_ref.at[blk], mask=lmask, other=0.0)
        acc = acc * alpha[:, None] + plgpu_triton.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_new, l

    return lax.fori_loop(0, n, body, carry)


def _init(dp):
    return (jnp.zeros((_ROWS, dp), jnp.float32), jnp.full((_ROWS,), _M_INIT, jnp.float32),
            jnp.zeros((_ROWS,), jnp.float32))


def _load_q(q_ref, r, h, group, dp, dmask, dtype):
    gmask = jnp.arange(_ROWS) < group
    mask = gmask[:, None] if dmask is None else gmask[:, None] & dmask[None, :]
    q = plgpu_triton.load(q_ref.at[r, pl.ds(h * group, _ROWS), pl.ds(0, dp)], mask=mask, other=0.0)
    return q.astype(dtype), gmask, mask


def _store_partial(o_ref, m_ref, l_ref, r, h, j, group, dp, carry, gmask, omask, keep=True):
    """Store a split's (acc, m, l); keep=False (a traced bool) skips the stores of a split the
    merge will not read."""
    acc, m, l = carry
    rows = pl.ds(h * group, _ROWS)
    plgpu_triton.store(o_ref.at[r, j, rows, pl.ds(0, dp)], acc, mask=omask & keep)
    plgpu_triton.store(m_ref.at[r, j, rows], m, mask=gmask & keep)
    plgpu_triton.store(l_ref.at[r, j, rows], l, mask=gmask & keep)


def _dense_kernel(layer_ref, len_ref, q_ref, k_ref, v_ref, *refs, group, split, n_splits,
                  by_length, s_len, d, dp, bk, scale, precision, logits, into, gather_q,
                  with_rows, signal):
    """logits: also store the scaled scores; into: they go to layer `layer` of an aliased
    [L, rows, Hq, S] buffer, positions past the row's length left as they were (no -inf
    fill: the reader masks them). with_rows: the last input is the rows' cache indices (else
    program r reads cache row r: no index array to build per call). by_length: the splits
    share the row's length (`common.row_split`), else the cache's (`split` keys each)."""
    if with_rows:  # inputs ([logits_into,] rows), then the outputs
        rows_ref = refs[int(into)]
        refs = refs[:int(into)] + refs[int(into) + 1:]
    if into:
        _, o_ref, m_ref, l_ref, logit_ref = refs  # refs[0] is the aliased input
    else:
        o_ref, m_ref, l_ref = refs[:3]
        logit_ref = refs[3] if logits else None
    r, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, row = layer_ref[0], rows_ref[r] if with_rows else r
    dmask = None if dp == d else jnp.arange(dp) < d
    q, gmask, omask = _load_q(q_ref, row if gather_q else r, h, group, dp, dmask, k_ref.dtype)
    length = jnp.clip(len_ref[r], 0, s_len)
    if by_length:
        split = row_split(length, n_splits, bk)
    start = j * split
    end = jnp.minimum(start + split, s_len)
    hi = jnp.minimum(end, length)
    idx = jnp.arange(bk)
    at, limit = ((layer, r), hi) if into else ((r,), end)

    def store_logits(blk, s):
        cmask = (blk + idx) < limit
        plgpu_triton.store(logit_ref.at[(*at, pl.ds(h * group, _ROWS), pl.ds(blk, bk))], s,
                           mask=gmask[:, None] & cmask[None, :])

    carry = _attend(q, k_ref, v_ref, (layer, row, h), start, hi, _init(dp), bk=bk, dp=dp,
                    dmask=dmask, scale=scale, precision=precision,
                    logits=store_logits if logits else None)
    if logits and not into:
        # Blocks of this split past the row's length: -inf, without reading K.
        done = start + pl.cdiv(jnp.maximum(hi - start, 0), bk) * bk
        neg = jnp.full((_ROWS, bk), -jnp.inf, jnp.float32)

        def fill(i, c):
            store_logits(done + i * bk, neg)
            return c

        lax.fori_loop(0, pl.cdiv(jnp.maximum(end - done, 0), bk), fill, 0)
    # a split past the row's length stores nothing (the merge reads only the row's splits);
    # the stores' row mask passes through the dependents' signal, placed after the loop
    sig = dependents_mask(_ROWS, signal, carry[1])
    _store_partial(o_ref, m_ref, l_ref, r, h, j, group, dp, carry, gmask & sig, omask,
                   keep=start < hi)


def _new_token(q, kn_ref, vn_ref, r, h, carry, use, *, dp, dmask, scale, cache_dtype):
    """Online-softmax update with this step's key and value (one position, from registers)."""
    kw = {} if dmask is None else dict(mask=dmask, other=0.0)
    kn = plgpu_triton.load(kn_ref.at[r, h, pl.ds(0, dp)], **kw)
    vn = plgpu_triton.load(vn_ref.at[r, h, pl.ds(0, dp)], **kw)
    kc, vc = kn.astype(cache_dtype), vn.astype(cache_dtype)
    s = jnp.sum(q.astype(jnp.float32) * kc.astype(jnp.float32)[None, :], axis=1) * scale
    s = jnp.where(use, s, -jnp.inf)
    acc, m, l = carry
    m_new = jnp.maximum(m, s)
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    acc = acc * alpha[:, None] + p[:, None] * vc.astype(jnp.float32)[None, :]
    return (acc, m_new, l * alpha + p), kn, kc, vc


def _sparse_kernel(layer_ref, clen_ref, rs_ref, len_ref, q_ref, ck_ref, cv_ref, k_ref, v_ref,
                   *refs, group, n_splits, s_len, c_size, d, dp, bk, scale, precision,
                   write_kv, write_norms, clen_stacked, signal):
    """write_kv: this step's key/value (refs kn, vn) sit at position length - 1; split 0
    attends to them from registers and stores them into the aliased caches (and, with
    write_norms, the key's L2 norm into the aliased norms), so no program reads a position
    another one writes."""
    if write_kv:
        kn_ref, vn_ref = refs[:2]
        refs = refs[3:] if write_norms else refs[2:]  # skip the aliased norms input
        o_ref, m_ref, l_ref, k_out, v_out = refs[:5]
        n_out = refs[5] if write_norms else None
    else:
        o_ref, m_ref, l_ref = refs
    r, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    dmask = None if dp == d else jnp.arange(dp) < d
    q, gmask, omask = _load_q(q_ref, r, h, group, dp, dmask, k_ref.dtype)
    c_len = jnp.clip(clen_ref[layer, r, h] if clen_stacked else clen_ref[r, h], 0, c_size)
    length = jnp.clip(len_ref[r], 0, s_len)
    cached = jnp.maximum(length - 1, 0) if write_kv else length  # positions read in place
    rs = jnp.clip(rs_ref[r], 0, cached)
    # Virtual sequence: compact prefix padded to whole blocks, then the recent window.
    c_pad = pl.cdiv(c_len, bk) * bk
    total = c_pad + (cached - rs)
    chunk = pl.cdiv(pl.cdiv(total, n_splits), bk) * bk
    a = j * chunk
    b = jnp.minimum(a + chunk, total)
    kw = dict(bk=bk, dp=dp, dmask=dmask, scale=scale, precision=precision)
    carry = _attend(q, ck_ref, cv_ref, (layer, r, h), a,
                    jnp.minimum(b, c_len), _init(dp), **kw)
    carry = _attend(q, k_ref, v_ref, (layer, r, h),
                    rs + jnp.maximum(a - c_pad, 0), rs + b - c_pad, carry, **kw)
    if write_kv:
        first = (j == 0) & (length > 0)
        carry, kn, kc, vc = _new_token(q, kn_ref, vn_ref, r, h, carry, first, dp=dp,
                                       dmask=dmask, scale=scale, cache_dtype=k_out.dtype)
        at = (layer, r, h, pl.ds(length - 1, 1))
        row = jnp.full((1, dp), True) if dmask is None else dmask[None, :]
        plgpu_triton.store(k_out.at[(*at, pl.ds(0, dp))], kc[None, :], mask=row & first)
        plgpu_triton.store(v_out.at[(*at, pl.ds(0, dp))], vc[None, :], mask=row & first)
        if write_norms:
            kf = kn.astype(jnp.float32)
            norm = jnp.broadcast_to(jnp.sqrt(jnp.sum(kf * kf)), (1,))
            plgpu_triton.store(n_out.at[at], norm, mask=jnp.full((1,), True) & first)
    sig = dependents_mask(_ROWS, signal, carry[1])  # (as in the dense kernel)
    _store_partial(o_ref, m_ref, l_ref, r, h, j, group, dp, carry, gmask & sig, omask)


def _combine_kernel(*refs, n_splits, nsp, d, dp, n_out, into, all_valid, signal):
    """One query head of one row: merge its first valid_ref[r] per-split partials exactly (all
    n_splits with all_valid: no count array to build per call) and store the result in output
    row r, or with `into` row dst_ref[r] of the aliased buffer (none when it is >= n_out)."""
    r, h = pl.program_id(0), pl.program_id(1)
    if not all_valid:
        valid_ref, *refs = refs
    if into:
        dst_ref, o_ref, m_ref, l_ref, _, out_ref, lse_ref = refs
    else:
        o_ref, m_ref, l_ref, out_ref, lse_ref = refs
    n_valid = n_splits if all_valid else jnp.minimum(valid_ref[r], n_splits)
    jmask = jnp.arange(nsp) < n_valid
    dmask = jnp.arange(dp) < d
    m = plgpu_triton.load(m_ref.at[r, pl.ds(0, nsp), h], mask=jmask, other=-jnp.inf)
    l = plgpu_triton.load(l_ref.at[r, pl.ds(0, nsp), h], mask=jmask, other=0.0)
    o = plgpu_triton.load(o_ref.at[r, pl.ds(0, nsp), h, pl.ds(0, dp)],
                          mask=jmask[:, None] & dmask[None, :], other=0.0)
    out, mx, lsum, ok = merge_splits(m, l, o, jmask)
    dst = dst_ref[r] if into else r
    sig = dependents_mask(dp, signal, out)
    plgpu_triton.store(out_ref.at[jnp.minimum(dst, n_out - 1), h, pl.ds(0, dp)],
                       out.astype(out_ref.dtype), mask=dmask & sig & (dst < n_out))
    plgpu_triton.store(lse_ref.at[r, h], jnp.where(ok, mx + jnp.log(jnp.where(ok, lsum, 1.0)),
                                                   -jnp.inf))


def _combine_xla(o, m, l, valid, dtype):
    jmask = jnp.arange(m.shape[1])[None, :, None] < valid[:, None, None]
    m = jnp.where(jmask, m, -jnp.inf)
    mx = jnp.max(m, axis=1)
    w = jnp.where(jmask, jnp.exp(m - jnp.where(jnp.isfinite(mx), mx, 0.0)[:, None]), 0.0)
    lsum = jnp.sum(jnp.where(jmask, l, 0.0) * w, axis=1)
    acc = jnp.sum(jnp.where(jmask[..., None], o, 0.0) * w[..., None], axis=1)
    ok = lsum != 0  # no valid key: 0; NaN inputs stay NaN
    out = jnp.where(ok[..., None], acc / jnp.where(ok, lsum, 1.0)[..., None], 0.0)
    lse = jnp.where(ok, mx + jnp.log(jnp.where(ok, lsum, 1.0)), -jnp.inf)
    return out.astype(dtype), lse


def _combine(o, m, l, valid, dtype, interpret, out_into=None, out_rows=None, *, pallas=True,
             signal=False):
    """Exact merge of per-split partials o [R, n, Hq, D], m/l [R, n, Hq]; row r merges its
    first valid[r] splits (the others were not written; valid None: all). Returns
    (out [R, Hq, D], lse), or with out_into [N, Hq, D] and out_rows [R] that buffer with row
    r's result in row out_rows[r] (rows >= N dropped), updated in place.

    One small kernel: XLA splits the same jnp into several launches, and at short
    lengths each dependent launch costs about as much as the attention itself.
    pallas=False merges with jnp instead (several XLA launches); signal: the kernel signals
    its dependents (`triton_lowering.launch_dependents`).
    """
    n_rows, n_splits, hq, d = o.shape
    all_valid = valid is None
    if not all_valid:
        valid = valid.astype(jnp.int32)
    into = out_into is not None
    if not pallas:
        if all_valid:
            valid = jnp.full((n_rows,), n_splits, jnp.int32)
        out, lse = _combine_xla(o, m, l, valid, dtype)
        if into:
            out = out_into.at[out_rows].set(out.astype(out_into.dtype), mode="drop")
        return out, lse
    nsp, dp = max(2, pow2(n_splits)), pow2(d)
    n_out = out_into.shape[0] if into else n_rows
    kernel = functools.partial(_combine_kernel, n_splits=n_splits, nsp=nsp, d=d, dp=dp,
                               n_out=n_out, into=into, all_valid=all_valid, signal=signal)
    # one warp holds a few splits' partials in registers; many splits (a few long rows, e.g.
    # the refreshed rows of a slow step: 128 splits at 128K) need more warps
    warps = 1 if nsp * dp <= 4096 else 4
    args = [out_rows.astype(jnp.int32), o, m, l, out_into] if into else [o, m, l]
    if not all_valid:
        args.insert(0, valid)
    return pl.pallas_call(
        kernel, grid=(n_rows, hq),
        out_shape=[jax.ShapeDtypeStruct((n_out, hq, d), out_into.dtype if into else dtype),
                   jax.ShapeDtypeStruct((n_rows, hq), jnp.float32)],
        input_output_aliases={len(args) - 1: 0} if into else {},
        compiler_params=plgpu_triton.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret, name="sfi_decode_combine",
    )(*args)


def _params(cfg):
    return plgpu_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


_STATIC = ("interpret", "config", "pallas_combine", "launch_dependents")


@functools.partial(jax.jit, static_argnames=("return_logits", "gather_q") + _STATIC)
def dense_decode(q, k, v, lengths, layer=None, rows=None, *, return_logits=False,
                 logits_into=None, out_into=None, out_rows=None, gather_q=False, interpret=False,
                 config=None, pallas_combine=True, launch_dependents=None):
    """Dense decode attention (see kernels.attention.dense_decode); one pass over K and V.

    logits_into: a float32 [L, R, Hq, S] buffer (L as the stacked cache, or 1 without `layer`)
    whose layer `layer` receives the logits in place; returns (out, buffer, lse). Positions at
    or past a row's length keep their old values, and a row of length 0 costs next to nothing:
    the engine calls it every step for its refresh slots, empty ones included.
    out_into [N, Hq, D], out_rows [R]: row r's output goes to out_into[out_rows[r]] in place
    (rows >= N dropped), and that buffer is returned as `out`.
    gather_q: q has the cache's rows and row r uses q[rows[r]] (no gathered copy of q).
    config: a `Config` (None: REFRESH, DENSE_LOGITS or DENSE for the call's kind);
    pallas_combine=False: the splits merged with jnp; launch_dependents: see
    `triton_lowering.signals_dependents` (None: on Hopper or newer).
    """
    into = logits_into is not None
    signal = signals_dependents(launch_dependents, interpret)
    cfg = config or (REFRESH if into else DENSE_LOGITS if return_logits else DENSE)
    k, v, layer_arr = as_layer_stacks(layer, k, v)
    _, hq, d = q.shape
    if gather_q and rows is None:
        raise ValueError("gather_q=True needs `rows` (the cache rows whose q each program uses)")
    n_rows = rows.shape[0] if gather_q else q.shape[0]
    _, _, hkv, s_len, _ = k.shape
    group = hq // hkv
    if group > _ROWS:
        raise ValueError(f"GQA group {group} > {_ROWS} is not supported by the GPU kernel")
    if into and logits_into.shape != (k.shape[0], n_rows, hq, s_len):
        raise ValueError(f"logits_into has shape {logits_into.shape}; expected "
                         f"{(k.shape[0], n_rows, hq, s_len)}")
    lengths = lengths.astype(jnp.int32)
    dp = pow2(d)
    bk = min(cfg.block_k, max(16, pow2(s_len)))
    pairs = hkv if cfg.per_row else n_rows * hkv
    split, n_splits = decode_splits(s_len, pairs, bk, cfg.programs)
    # (return_logits fills each split's positions past the length with -inf: cache-sized)
    by_length = cfg.by_length and n_splits > 1 and (into or not return_logits)
    kernel = functools.partial(
        _dense_kernel, group=group, split=split, n_splits=n_splits, by_length=by_length,
        s_len=s_len, d=d, dp=dp, bk=bk,
        scale=1.0 / math.sqrt(d), precision=dot_precision(k.dtype),
        logits=return_logits or into, into=into, gather_q=gather_q, with_rows=rows is not None,
        signal=signal)
    out_shape = [jax.ShapeDtypeStruct((n_rows, n_splits, hq, d), jnp.float32),
                 jax.ShapeDtypeStruct((n_rows, n_splits, hq), jnp.float32),
                 jax.ShapeDtypeStruct((n_rows, n_splits, hq), jnp.float32)]
    args = [layer_arr, lengths, q, k, v]
    if into:
        out_shape.append(jax.ShapeDtypeStruct(logits_into.shape, jnp.float32))
        args.append(logits_into.astype(jnp.float32))
    elif return_logits:
        out_shape.append(jax.ShapeDtypeStruct((n_rows, hq, s_len), jnp.float32))
    if rows is not None:
        args.append(rows.astype(jnp.int32))
    res = pl.pallas_call(
        kernel, grid=(n_rows, hkv, n_splits), out_shape=out_shape,
        input_output_aliases={5: 3} if into else {},
        compiler_params=_params(cfg), interpret=interpret, name="sfi_dense_decode",
    )(*args)
    clipped = jnp.clip(lengths, 0, s_len)
    per = row_split(clipped, n_splits, bk) if by_length else split
    valid = -(-clipped // jnp.maximum(per, 1))
    out, lse = _combine(res[0], res[1], res[2], valid, q.dtype, interpret, out_into, out_rows,
                        pallas=pallas_combine, signal=signal)
    if return_logits or into:
        return out, res[3], lse
    return out


@functools.partial(jax.jit, static_argnames=("window",) + _STATIC)
def sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths, layer=None, *, window=None,
                  new_kv=None, key_norms=None, interpret=False, config=None, pallas_combine=True,
                  launch_dependents=None):
    """Compact + recent-window decode attention (see kernels.attention.sparse_decode).

    new_kv (kn, vn) [B, Hkv, D]: this step's key and value, stored at position lengths - 1 of
    k, v (and the key's norm in key_norms [L, B, Hkv, S], when given) by the same launch;
    returns (out, k, v, key_norms), updated in place inside a jitted caller that owns them.
    c_len may be stacked [L, B, Hkv] like the caches (layer `layer` is read).
    config: a `Config` (None: SPARSE_SMALL or SPARSE by the keys read); pallas_combine and
    launch_dependents as in `dense_decode`.
    """
    write_kv, write_norms = new_kv is not None, key_norms is not None
    if write_norms and not write_kv:
        raise ValueError("key_norms is written only together with new_kv")
    stacked = layer is not None
    ck, cv, k, v, layer_arr = as_layer_stacks(layer, ck, cv, k, v)
    n_rows, hq, d = q.shape
    _, _, hkv, s_len, _ = k.shape
    c_size = ck.shape[3]
    group = hq // hkv
    if group > _ROWS:
        raise ValueError(f"GQA group {group} > {_ROWS} is not supported by the GPU kernel")
    dp = pow2(d)
    est = c_size + (s_len if window is None else min(window, s_len))
    cfg = config or (SPARSE_SMALL if est <= SMALL_KEYS else SPARSE)
    bk = min(cfg.block_k, max(16, pow2(est)))
    _, n_splits = decode_splits(est, n_rows * hkv, bk, cfg.programs)
    kernel = functools.partial(
        _sparse_kernel, group=group, n_splits=n_splits, s_len=s_len, c_size=c_size, d=d, dp=dp,
        bk=bk, scale=1.0 / math.sqrt(d), precision=dot_precision(k.dtype), write_kv=write_kv,
        write_norms=write_norms, clen_stacked=c_len.ndim == 3,
        signal=signals_dependents(launch_dependents, interpret))
    out_shape = [jax.ShapeDtypeStruct((n_rows, n_splits, hq, d), jnp.float32),
                 jax.ShapeDtypeStruct((n_rows, n_splits, hq), jnp.float32),
                 jax.ShapeDtypeStruct((n_rows, n_splits, hq), jnp.float32)]
    args = [layer_arr, c_len.astype(jnp.int32), recent_start.astype(jnp.int32),
            lengths.astype(jnp.int32), q, ck, cv, k, v]
    aliases = {}
    if write_kv:
        out_shape += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k, v)]
        args += list(new_kv)
        aliases = {7: 3, 8: 4}
        if write_norms:
            norms = key_norms if stacked else key_norms[None]
            out_shape.append(jax.ShapeDtypeStruct(norms.shape, norms.dtype))
            args.append(norms)
            aliases[11] = 5
    res = pl.pallas_call(
        kernel, grid=(n_rows, hkv, n_splits), out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=_params(cfg), interpret=interpret, name="sfi_sparse_decode",
    )(*args)
    out = _combine(res[0], res[1], res[2], None, q.dtype, interpret, pallas=pallas_combine,
                   signal=signals_dependents(launch_dependents, interpret))[0]
    if not write_kv:
        return out
    unstack = (lambda x: x) if stacked else (lambda x: x[0])
    return (out, unstack(res[3]), unstack(res[4]),
            unstack(res[5]) if write_norms else None)


def _repack_kernel(slots_ref, pos_ref, k_ref, v_ref, _ck_in, _cv_in, ck_out, cv_out, *, n_rows,
                   block, c_size, d, dp):
    """Block c of one (slot, layer, KV head): gather the cache rows at the slot's positions into
    the compact buffers. Empty slots (>= n_rows) and padding positions (-1) move nothing."""
    s, layer, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    row = slots_ref[s]
    occupied = row < n_rows
    row = jnp.minimum(row, n_rows - 1)
    idx = c * block + jnp.arange(block)
    inside = (idx < c_size) & occupied
    pos = plgpu_triton.load(pos_ref.at[layer, s, h, pl.ds(c * block, block)], mask=inside,
                            other=-1)
    ok = inside & (pos >= 0)
    mask = ok[:, None] if dp == d else ok[:, None] & (jnp.arange(dp) < d)[None, :]
    # a gather: array indexers only (Triton takes mixed ones, interpret mode does not)
    src = (layer, row, h, jnp.maximum(pos, 0)[:, None], jnp.arange(dp)[None, :])
    dst = (layer, row, h, pl.ds(c * block, block), pl.ds(0, dp))
    plgpu_triton.store(ck_out.at[dst], plgpu_triton.load(k_ref.at[src], mask=mask, other=0.0),
                       mask=mask)
    plgpu_triton.store(cv_out.at[dst], plgpu_triton.load(v_ref.at[src], mask=mask, other=0.0),
                       mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret", "block"))
def repack(ck, cv, k, v, positions, slots, *, interpret=False, block=64):
    """Copy cache rows into the compact buffers of the refreshed rows (see
    kernels.attention.repack): one launch, in place, that does no work for empty slots."""
    n_layers, n_rows, hkv, c_size, d = ck.shape
    n_slots = slots.shape[0]
    dp = pow2(d)
    kernel = functools.partial(_repack_kernel, n_rows=n_rows, block=block, c_size=c_size, d=d,
                               dp=dp)
    return pl.pallas_call(
        kernel, grid=(n_slots, n_layers, hkv, pl.cdiv(c_size, block)),
        out_shape=[jax.ShapeDtypeStruct(ck.shape, ck.dtype),
                   jax.ShapeDtypeStruct(cv.shape, cv.dtype)],
        input_output_aliases={4: 0, 5: 1},
        compiler_params=plgpu_triton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="sfi_repack",
    )(slots.astype(jnp.int32), positions.astype(jnp.int32), k, v, ck, cv)
