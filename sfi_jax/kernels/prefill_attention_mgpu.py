"""Flash prefill attention for NVIDIA Hopper GPUs: Pallas with the Mosaic GPU lowering.

The Mosaic GPU twin of prefill_attention_gpu's Triton kernel: Mosaic GPU is JAX's supported
GPU backend for Pallas, and the Triton lowering is deprecated from jax 0.11.

One CTA (one warpgroup) per (batch row, KV head, query block). Its 64 wgmma rows are the KV
head's G query heads times the block's 64 // G consecutive chunk queries: row i is query
t0 + i // G of head h * G + i % G, so a block is 64 contiguous rows of q laid out
[B, Hkv, T * G, D] (a transpose outside the kernel; T padded to whole blocks there too). The
CTA streams the key blocks [0, min(kv_len, its last query's position + 1)) of its cache row
with TMA (attention_mgpu's `_flash`: `stages` blocks in flight, q·Kᵀ and P·V by wgmma, the
online softmax in registers), each row masked at its own causal edge, and writes its
normalised output block. Programs of the last query blocks (the most keys) come first.

Half-precision caches, head dim 64/128/256, S a multiple of 8, and G dividing 64 only
(`supported`). Off a GPU the kernel runs in Mosaic GPU's interpret mode, where TMA reads past
an array's end give zeros, as on the GPU.
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

from sfi_jax.kernels import attention_mgpu as base
from sfi_jax.kernels.common import as_layer_stacks, cache_origin

_M = base._M


@dataclasses.dataclass(frozen=True)
class Config:
    """block_k: keys per pipeline step (a multiple of 64); stages: key blocks in flight."""

    block_k: int = 128
    stages: int = 2


DEFAULT = Config(block_k=128, stages=2)


def supported(q, k) -> bool:
    """Whether the kernel takes q [B, T, Hq, D] over k [(L,) B, Hkv, S, D]: a half-precision
    cache, head dim 64/128/256, S a multiple of 8 (as attention_mgpu.supported) and a GQA
    group G = Hq / Hkv that divides wgmma's 64 rows (G <= 64 and 64 % G == 0)."""
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-3]
    g = hq // hkv
    return (jnp.dtype(k.dtype) in base.HALF and d in (64, 128, 256) and k.shape[-2] % 8 == 0
            and hq % hkv == 0 and 1 <= g <= _M and _M % g == 0)


def smem_bytes(cfg, d, itemsize=2):
    """Shared memory of one CTA: the K/V stages, q, p and the output block."""
    return (2 * cfg.stages * cfg.block_k * d * itemsize + 2 * _M * d * itemsize
            + _M * cfg.block_k * itemsize)


def fit(cfg, d):
    """cfg with fewer stages, then 64-key blocks, until one CTA's shared memory fits."""
    return base.shrink_to_fit(cfg, lambda c: smem_bytes(c, d))


def config_for(d, block_k=None) -> Config:
    """The config for head dim d: the default fitted to shared memory, or with `block_k` keys
    per step, the default's stages (one if they do not fit)."""
    if block_k is None:
        return fit(DEFAULT, d)
    cfg = dataclasses.replace(DEFAULT, block_k=block_k)
    if smem_bytes(cfg, d) > base.SMEM_BYTES:
        cfg = dataclasses.replace(cfg, stages=1)
    return cfg


def _kernel(at_ref, qs_ref, kv_ref, q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem,
            p_smem, o_smem, q_bar, k_bar, v_bar, *, t_len, s_len, nq, group, bq, bk, stages,
            scale, interpret):
    b, h = lax.axis_index("b"), lax.axis_index("h")
    i = nq - 1 - lax.axis_index("q")  # the last query blocks (most keys) first
    layer, cache_row = at_ref[0], at_ref[1] + b
    qs = qs_ref[b]
    kvl = jnp.clip(kv_ref[b], 0, s_len)
    t0 = i * bq
    # keys up to the block's last real query (not T's padding) and the row's filled length
    hi = jnp.maximum(jnp.minimum(kvl, qs + jnp.minimum(t0 + bq, t_len)), 0)
    n = lax.div(hi + (bk - 1), bk)
    rows = pl.ds(base.aligned(i * _M, _M), _M)

    plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_bar)

    def fetch(j, slot):
        blk = (layer, cache_row, h, pl.ds(base.aligned(j * bk, bk), bk))
        plgpu.copy_gmem_to_smem(k_ref.at[blk], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[blk], v_smem.at[slot], v_bar.at[slot])

    def valid(j):
        """Per row: keys [0, pos + 1) for a query before kv_len, none for a padding one."""
        row = base._iota((_M, bk), 0, interpret)
        pos = qs + t0 + lax.div(row, group)
        limit = jnp.where(pos < kvl, pos + 1, 0)
        return limit - j * bk

    plgpu.barrier_wait(q_bar)
    acc, _, l = base._flash(q_smem, k_smem, v_smem, p_smem, k_bar, v_bar, n=n, fetch=fetch,
                            valid=valid, stages=stages, scale=scale, interpret=interpret)
    # no valid key: acc is 0 and so is the output; NaN inputs stay NaN
    inv = 1.0 / jnp.where(l != 0, l, 1.0)
    o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)


def _check_config(cfg, d):
    if cfg.block_k % 64 or cfg.block_k < 64 or cfg.stages < 1 \
            or smem_bytes(cfg, d) > base.SMEM_BYTES:
        raise ValueError(f"mosaic_gpu prefill config {cfg}: block_k must be a multiple of 64 "
                         f"and the CTA's shared memory ({smem_bytes(cfg, d)} B at d={d}) at "
                         f"most {base.SMEM_BYTES} B")


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def prefill_attention(q, k, v, q_start, kv_len, layer=None, row=None, *, interpret=False,
                      config=None):
    """Flash prefill attention (see kernels.prefill_attention.prefill_attention) of q
    [B, T, Hq, D] over k, v [B', Hkv, S, D] (stacked [L, B', Hkv, S, D] read at `layer`),
    query row b reading cache row `row` + b (None: 0); half-precision caches."""
    b, t, hq, d = q.shape
    if not supported(q, k):
        hkv = k.shape[-3]
        raise ValueError(f"mosaic_gpu prefill_attention takes bf16/f16 caches, head dim "
                         f"64/128/256, S a multiple of 8 and a GQA group dividing {_M}; got "
                         f"{k.dtype}, d={d}, S={k.shape[-2]}, Hq={hq}, Hkv={hkv}")
    cfg = config or config_for(d)
    _check_config(cfg, d)
    k, v, layer_arr = as_layer_stacks(layer, k, v)
    hkv, s_len = k.shape[2], k.shape[3]
    group = hq // hkv
    bq = _M // group
    nq = -(-t // bq)
    tp = nq * bq
    # rows (t, g) of each KV head: [B, T, Hkv, G, D] -> [B, Hkv, Tp * G, D]
    qg = q.astype(k.dtype).reshape(b, t, hkv, group, d).transpose(0, 2, 1, 3, 4)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, tp - t), (0, 0), (0, 0))).reshape(b, hkv, tp * group, d)
    kernel = functools.partial(
        _kernel, t_len=t, s_len=s_len, nq=nq, group=group, bq=bq, bk=cfg.block_k,
        stages=cfg.stages, scale=1.0 / math.sqrt(d), interpret=interpret)
    smem = base._smem_kv
    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((b, hkv, tp * group, d), k.dtype),
        scratch_types=[
            smem((_M, d), k.dtype),
            smem((cfg.stages, cfg.block_k, d), k.dtype),
            smem((cfg.stages, cfg.block_k, d), k.dtype),
            smem((_M, cfg.block_k), k.dtype),
            smem((_M, d), k.dtype),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=cfg.stages),
            plgpu.Barrier(num_barriers=cfg.stages),
        ],
        grid=(b, hkv, nq), grid_names=("b", "h", "q"),
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=base.interpret_params() if interpret else False,
    )(cache_origin(layer_arr, row), q_start.astype(jnp.int32), kv_len.astype(jnp.int32), qg,
      k, v)
    out = out.reshape(b, hkv, tp, group, d)[:, :, :t].transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, hq, d).astype(q.dtype)
