"""Flash prefill attention for NVIDIA GPUs: Pallas with the Triton lowering.

One program per (query block, KV head, row). It loads block_q query positions times the
KV head's query group (padded to a power of two) as one [block_q * G, D] tile, so K and V
are read once per group (GQA without repeated heads), then walks the key blocks up to the
block's causal edge and the row's filled length: first the blocks every query sees whole
(no masks), then the few on the diagonal or at kv_len (masked). Programs of the last query
blocks, which have the most keys, are launched first.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sfi_jax.kernels.common import as_layer_stacks, cache_origin, dot_precision, pow2
from sfi_jax.kernels.triton_lowering import M_INIT as _M_INIT, plgpu_triton

_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # smallest M, N and K of tl.dot


@dataclasses.dataclass(frozen=True)
class Config:
    """rows: query rows per program (block_q positions x padded group); powers of two."""

    rows: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


# Starting points for Hopper (tune with scripts/bench/bench_prefill_kernel.py).
DEFAULT = {64: Config(rows=128, block_k=64, num_warps=4, num_stages=3),
           128: Config(rows=128, block_k=128, num_warps=8, num_stages=3)}


def default_config(d, dtype=jnp.bfloat16) -> Config:
    """The tuned half-precision blocks; float32 keeps 64-key blocks (twice the bytes per key
    block in shared memory)."""
    cfg = DEFAULT[64] if pow2(d) <= 64 else DEFAULT[128]
    if jnp.dtype(dtype).itemsize > 2:
        cfg = dataclasses.replace(cfg, block_k=min(cfg.block_k, 64))
    return cfg


def _kernel(at_ref, qs_ref, kv_ref, q_ref, k_ref, v_ref, o_ref, *, t_len, s_len, nq, group,
            gp, bq, bk, d, dp, scale, precision):
    i = nq - 1 - pl.program_id(0)  # the last query blocks (most keys) first
    h, b = pl.program_id(1), pl.program_id(2)
    layer, cache_row = at_ref[0], at_ref[1] + b
    kv = jnp.clip(kv_ref[b], 0, s_len)
    t0 = i * bq
    first = qs_ref[b] + t0  # position of the block's first query
    rows = bq * gp
    dmask = None if dp == d else jnp.arange(dp) < d
    qmask = ((t0 + jnp.arange(bq)) < t_len)[:, None, None] & (jnp.arange(gp) < group)[None, :, None]
    if dmask is not None:
        qmask = qmask & dmask[None, None, :]
    qblk = (b, pl.ds(t0, bq), pl.ds(h * group, gp), pl.ds(0, dp))
    q = plgpu_triton.load(q_ref.at[qblk], mask=qmask, other=0.0)
    q = q.astype(k_ref.dtype).reshape(rows, dp)
    pos = first + jnp.arange(rows) // gp  # each row's query position
    hi = jnp.maximum(jnp.minimum(first + jnp.minimum(bq, t_len - t0), kv), 0)
    n_full = jnp.maximum(jnp.minimum(first + 1, kv), 0) // bk  # blocks all rows see whole
    c = scale * _LOG2E
    idx = jnp.arange(bk)

    def step(j, carry, masked):
        acc, m, l = carry
        start = j * bk
        blk = (layer, cache_row, h, pl.ds(start, bk), pl.ds(0, dp))
        if masked:
            kmask = (start + idx) < kv
            lmask = kmask[:, None] if dmask is None else kmask[:, None] & dmask[None, :]
            kw = dict(mask=lmask, other=0.0)
        else:
            kw = {} if dmask is None else dict(mask=dmask[None, :], other=0.0)
        k = plgpu_triton.load(k_ref.at[blk], **kw)
        s = plgpu_triton.dot(q, k, trans_b=True, precision=precision) * c
        if masked:
            ok = ((start + idx)[None, :] <= pos[:, None]) & kmask[None, :]
            s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        v = plgpu_triton.load(v_ref.at[blk], **kw)
        acc = acc * alpha[:, None] + plgpu_triton.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_new, l

    carry = (jnp.zeros((rows, dp), jnp.float32), jnp.full((rows,), _M_INIT, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(n_full, pl.cdiv(hi, bk), functools.partial(step, masked=True), carry)
    acc, _, l = carry
    ok = l != 0  # no valid key: 0; NaN inputs stay NaN
    out = jnp.where(ok[:, None], acc / jnp.where(ok, l, 1.0)[:, None], 0.0)
    plgpu_triton.store(o_ref.at[qblk], out.reshape(bq, gp, dp).astype(o_ref.dtype), mask=qmask)


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "interpret", "config"))
def prefill_attention(q, k, v, q_start, kv_len, layer=None, row=None, *, block_q=None,
                      block_k=None, interpret=False, config=None):
    """Flash prefill attention (see kernels.prefill_attention.prefill_attention).

    config: a Config (block_q / block_k, when given, override its rows and block_k).
    """
    b, t, hq, d = q.shape
    k, v, layer = as_layer_stacks(layer, k, v)
    hkv, s_len = k.shape[2], k.shape[3]
    group = hq // hkv
    gp, dp = pow2(group), max(_MIN_DOT, pow2(d))
    cfg = config or default_config(d, q.dtype)
    bq = block_q or max(1, cfg.rows // gp)
    bq = max(min(bq, pow2(t)), -(-_MIN_DOT // gp))  # no bigger than the chunk; M >= 16
    bk = max(_MIN_DOT, min(block_k or cfg.block_k, pow2(s_len)))
    nq = -(-t // bq)
    kernel = functools.partial(
        _kernel, t_len=t, s_len=s_len, nq=nq, group=group, gp=gp, bq=bq, bk=bk, d=d, dp=dp,
        scale=1.0 / math.sqrt(d), precision=dot_precision(k.dtype))
    return pl.pallas_call(
        kernel, grid=(nq, hkv, b), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps,
                                                    num_stages=cfg.num_stages),
        interpret=interpret, name="sfi_prefill_attention",
    )(cache_origin(layer, row), q_start.astype(jnp.int32), kv_len.astype(jnp.int32), q, k, v)
