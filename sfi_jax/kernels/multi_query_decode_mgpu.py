"""Split-K multi-query decode attention for NVIDIA Hopper GPUs: Pallas with the Mosaic GPU
lowering (the twin of multi_query_decode_gpu's Triton kernel).

One CTA per (row, KV head, split) holds that KV head's G*T query rows (the group's heads times
the T queries, padded to wgmma's 64 rows) and streams each K/V block of its split once for all
of them (the TMA/wgmma loop of attention_mgpu). Each query row masks its own causal edge; a
row's CTAs stop at the end of its last valid query. Row i of a CTA is query t = i % T of head
h * G + i // T, so the logits come out as [B, Hq, T, S] (T inner) without a transpose.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sfi_jax.kernels import attention_mgpu as base
from sfi_jax.kernels.common import as_layer_stacks, decode_splits, row_end

# One wave of 132 programs with 128-key blocks (P·V through shared memory): the verify
# kernel's best at batch 1 over 1-8 queries, 32K and 128K (benchmarks/multi_query_kernel.md)
DEFAULT = base.Config(block_k=128, stages=2, programs=base._NUM_SMS, whole_wave=True)
DEFAULT_LOGITS = DEFAULT


def supported(q, k) -> bool:
    """As attention_mgpu.supported, and G * T <= 64 query rows per KV head."""
    _, n_q, hq, d = q.shape
    return (base.supported(q[:, 0], k) and (hq // k.shape[-3]) * n_q <= base._M)


def _kernel(layer_ref, qs_ref, len_ref, q_ref, k_ref, v_ref, *rest, n_q, gt, split, s_len, bk,
            stages, scale, logits, interpret, ids):
    if logits:
        lg_ref, s_smem, *scratch = rest
    else:
        lg_ref, s_smem, scratch = None, None, rest
    (q_smem, k_smem, v_smem, p_smem, q_bar, k_bar, v_bar) = scratch
    b, h, j = ids()
    layer = layer_ref[0]
    qs = qs_ref[b]
    kvl = jnp.clip(len_ref[b], 0, s_len)
    start = j * split
    end = jnp.minimum(start + split, s_len)
    hi = jnp.minimum(end, row_end(qs, kvl, n_q))
    n = lax.div(jnp.maximum(hi - start, 0) + (bk - 1), bk)
    kv = (layer, b, h)

    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)

    def fetch(i, slot):
        blk = (*kv, pl.ds(base.aligned(start + i * bk, bk), bk))
        plgpu.copy_gmem_to_smem(k_ref.at[blk], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[blk], v_smem.at[slot], v_bar.at[slot])

    def valid(i):
        """Per query row: keys [0, pos + 1) for a live query before kv_len, none otherwise."""
        row = base._iota((base._M, bk), 0, interpret)
        pos = qs + lax.rem(row, n_q)
        limit = jnp.where((row < gt) & (pos < kvl), pos + 1, 0)
        return limit - (start + i * bk)

    def store_logits(i, at):  # whole blocks: the logits are padded (base.logits_length)
        col = pl.ds(base.aligned(start + i * bk, bk), bk)
        plgpu.copy_smem_to_gmem(s_smem.at[at, pl.ds(0, gt)], lg_ref.at[b, pl.ds(h * gt, gt), col])

    carry = base._flash(q_smem, k_smem, v_smem, p_smem, k_bar, v_bar, n=n, fetch=fetch,
                        valid=valid, stages=stages, scale=scale, interpret=interpret, q_bar=q_bar,
                        on_scores=base.score_writer(s_smem, store_logits) if logits else None)
    if logits:  # the split's blocks past the row's end: -inf, without reading K
        base.store_neg_inf(s_smem, store_logits, n, lax.div(end - start + (bk - 1), bk),
                           interpret)
    return carry


@functools.partial(jax.jit, static_argnames=("return_logits", "interpret", "config"))
def multi_query_decode(q, k, v, q_start, kv_len, layer=None, *, return_logits=False,
                       interpret=False, config=None):
    """Multi-query decode attention (see kernels.multi_query_decode): q [B, T, Hq, D] over
    k, v [B, Hkv, S, D] or stacked [L, B, Hkv, S, D] read at `layer`; half precision."""
    cfg = config or base.fit(DEFAULT_LOGITS if return_logits else DEFAULT, q.shape[-1],
                             return_logits)
    k, v, layer_arr = as_layer_stacks(layer, k, v)
    n_rows, n_q, hq, d = q.shape
    _, _, hkv, s_len, _ = k.shape
    group = hq // hkv
    gt = group * n_q
    if not supported(q, k):
        raise ValueError(f"mosaic_gpu multi_query_decode takes bf16/f16 caches, head dim "
                         f"64/128/256, S a multiple of 8 and G*T <= {base._M}; got {k.dtype}, "
                         f"d={d}, S={s_len}, G*T={gt}")
    base._check_config(cfg, d, return_logits)
    bk = cfg.block_k
    split, n_splits = decode_splits(s_len, n_rows * hkv, cfg.block_k, cfg.programs,
                                    base.plan_keys(cfg, d, k.dtype))
    # rows (h, g, t): [B, T, Hkv, G, D] -> [B, Hkv, G * T, D], padded to 64 rows
    qg = q.astype(k.dtype).reshape(n_rows, n_q, hkv, group, d).transpose(0, 2, 3, 1, 4)
    qg = jnp.pad(qg.reshape(n_rows, hkv, gt, d), ((0, 0), (0, 0), (0, base._M - gt), (0, 0)))
    kernel = functools.partial(
        _kernel, n_q=n_q, gt=gt, split=split, s_len=s_len, bk=bk, stages=cfg.stages,
        scale=1.0 / math.sqrt(d), logits=return_logits, interpret=interpret)
    s_lg = base.logits_length(s_len, bk)
    extra_out, extra_scratch = (), ()
    if return_logits:
        extra_out = (jax.ShapeDtypeStruct((n_rows, hq * n_q, s_lg), jnp.float32),)
        extra_scratch = (base.score_scratch(cfg),)
    res = base._launch(kernel, (layer_arr, q_start.astype(jnp.int32), kv_len.astype(jnp.int32),
                                qg, k, v),
                       n_rows=n_rows, hq=hq * n_q, hkv=hkv, d=d, n_splits=n_splits, bk=bk,
                       stages=cfg.stages, dtype=k.dtype, interpret=interpret, group=gt,
                       extra_out=extra_out, extra_scratch=extra_scratch, p_regs=cfg.p_regs)
    out, lse = base._combine(res[0], res[1], res[2], gt, q.dtype)  # rows (h, g, t)
    out = out.reshape(n_rows, hkv, group, n_q, d).transpose(0, 3, 1, 2, 4)
    out = out.reshape(n_rows, n_q, hq, d)
    if not return_logits:
        return out
    lg = res[3] if s_lg == s_len else res[3][..., :s_len]
    return out, lg.reshape(n_rows, hq, n_q, s_len), lse.reshape(n_rows, hq, n_q)
