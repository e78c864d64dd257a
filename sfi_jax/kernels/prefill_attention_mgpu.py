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

`Config(warpgroups=2)` (`_kernel_ws`) is the layout of Hopper's fast flash kernels: a CTA of
128 rows in two compute warpgroups that share one key stream, a third warpgroup that only
issues the TMA copies, the compute warpgroups alternating on the tensor cores so one's softmax
hides under the other's matmuls, and p fed to the second wgmma from registers. It is the
default (`DEFAULT`) and a Hopper GPU's default prefill: faster than the cuDNN path there, where
the one-warpgroup layout runs at half cuDNN's rate (benchmarks/prefill_kernel.md).

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
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Config:
    """block_k: keys per pipeline step (a multiple of 64); stages: key blocks in flight;
    warpgroups: 1, one warpgroup that fetches and computes (`_kernel`), or 2, two compute
    warpgroups of 64 rows each on one key stream and a third that only issues the TMA copies
    (`_kernel_ws`)."""

    block_k: int = 128
    stages: int = 2
    warpgroups: int = 1


DEFAULT = Config(block_k=128, stages=2, warpgroups=2)


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
    """Shared memory of one CTA: the K/V stages and, per compute warpgroup, q (reused for
    the output) and p (one warpgroup) or q alone (two: p stays in registers)."""
    p = _M * cfg.block_k * itemsize if cfg.warpgroups == 1 else 0
    return 2 * cfg.stages * cfg.block_k * d * itemsize + 2 * _M * d * itemsize + p


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


def _block(at_ref, qs_ref, kv_ref, *, t_len, s_len, nq, bq, bk):
    """This CTA's batch row b, KV head h, query block i (the last blocks, with the most keys,
    first), cache layer and row, q_start, filled length, first query t0, and n: the key
    blocks up to its last real query (not T's padding) and the row's filled length."""
    b, h = lax.axis_index("b"), lax.axis_index("h")
    i = nq - 1 - lax.axis_index("q")
    layer, cache_row = at_ref[0], at_ref[1] + b
    qs = qs_ref[b]
    kvl = jnp.clip(kv_ref[b], 0, s_len)
    t0 = i * bq
    hi = jnp.maximum(jnp.minimum(kvl, qs + jnp.minimum(t0 + bq, t_len)), 0)
    return b, h, i, layer, cache_row, qs, kvl, t0, lax.div(hi + (bk - 1), bk)


def _copy_block(src, dst, bar, at, j, slot, bk):
    """TMA: key or value block j of cache row `at` (layer, row, head) into shared slot `slot`."""
    blk = (*at, pl.ds(base.aligned(j * bk, bk), bk))
    plgpu.copy_gmem_to_smem(src.at[blk], dst.at[slot], bar.at[slot])


def _causal_limit(qs, t0, kvl, group, j, bk, interpret):
    """[64, bk]: how many leading keys of block j each row counts. Row r is query
    qs + t0 + r // group: keys [0, pos + 1) for a query before kv_len, none for a padding
    one."""
    row = base._iota((_M, bk), 0, interpret)
    pos = qs + t0 + lax.div(row, group)
    return jnp.where(pos < kvl, pos + 1, 0) - j * bk


def _kernel(at_ref, qs_ref, kv_ref, q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem,
            p_smem, o_smem, q_bar, k_bar, v_bar, *, t_len, s_len, nq, group, bq, bk, stages,
            scale, interpret):
    b, h, i, layer, cache_row, qs, kvl, t0, n = _block(at_ref, qs_ref, kv_ref, t_len=t_len,
                                                       s_len=s_len, nq=nq, bq=bq, bk=bk)
    rows = pl.ds(base.aligned(i * _M, _M), _M)

    plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_bar)

    at = (layer, cache_row, h)

    def fetch(j, slot):
        _copy_block(k_ref, k_smem, k_bar, at, j, slot, bk)
        _copy_block(v_ref, v_smem, v_bar, at, j, slot, bk)

    acc, _, l = base._flash(
        q_smem, k_smem, v_smem, p_smem, k_bar, v_bar, n=n, fetch=fetch,
        valid=lambda j: _causal_limit(qs, t0, kvl, group, j, bk, interpret), stages=stages,
        scale=scale, interpret=interpret, q_bar=q_bar)
    # no valid key: acc is 0 and so is the output; NaN inputs stay NaN
    inv = 1.0 / jnp.where(l != 0, l, 1.0)
    o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)


def _kernel_ws(at_ref, qs_ref, kv_ref, q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem,
               q_bar, k_bar, v_bar, k_free, v_free, turn, *, t_len, s_len, nq, group, bq, bk,
               stages, scale, interpret):
    """Warpgroups 0 and 1 each own 64 of the CTA's 128 rows (2 * 64 // G queries); warpgroup
    2 streams the key blocks both read, refilling a slot once both have consumed it
    (`k_free`/`v_free`, two arrivals each). The compute warpgroups take turns on the tensor
    cores (`turn`, FlashAttention-3's ping-pong): one's softmax runs while the other's wgmma
    does; each waits for its next key block while its P·V wgmma runs. Scores are kept in base
    2 (scale * log2 e folded into one FMA with the max, exp2). Only the key blocks
    that reach past a warpgroup's first query (its causal edge) or its kv_len are masked: in
    a chunk after a long prefix, most blocks are whole."""
    # both compute warpgroups run all n blocks (the CTA's): their barrier counts stay equal
    b, h, i, layer, cache_row, qs, kvl, t0, n = _block(at_ref, qs_ref, kv_ref, t_len=t_len,
                                                       s_len=s_len, nq=nq, bq=bq, bk=bk)
    wg = lax.axis_index("wg")
    dtype = k_smem.dtype
    d = k_smem.shape[-1]

    @pl.when(wg == 2)
    def _producer():
        if not interpret:
            plgpu.set_max_registers(40, action="decrease")

        at = (layer, cache_row, h)
        for j in range(stages):  # traced indices: see base._flash
            @pl.when(j < n)
            def _first(j=jnp.int32(j), slot=j):
                _copy_block(k_ref, k_smem, k_bar, at, j, slot, bk)
                _copy_block(v_ref, v_smem, v_bar, at, j, slot, bk)

        def refill(j, _):
            """Block j's slot is free once both warpgroups consumed it: fetch block j +
            stages into it. Every free phase is waited for, the last `stages` too."""
            slot = lax.rem(j, stages)
            more = j + stages < n
            plgpu.barrier_wait(k_free.at[slot])
            pl.when(more)(lambda: _copy_block(k_ref, k_smem, k_bar, at, j + stages, slot, bk))
            plgpu.barrier_wait(v_free.at[slot])
            pl.when(more)(lambda: _copy_block(v_ref, v_smem, v_bar, at, j + stages, slot, bk))

        lax.fori_loop(0, n, refill, None)

    @pl.when(wg < 2)
    def _compute():
        if not interpret:
            plgpu.set_max_registers(232, action="increase")
        q_w = q_smem.at[wg]
        rows = pl.ds(base.aligned((i * 2 + wg) * _M, _M), _M)
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_w, q_bar.at[wg])
        tw = t0 + wg * (_M // group)

        def take_turn():
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        def pv(acc, p, slot, while_running):
            """acc + p·V; while_running() runs while the wgmma does."""
            if interpret:
                acc = acc + jnp.dot(p, v_smem.at[slot][...], preferred_element_type=jnp.float32)
                while_running()
                return acc

            def issue(acc_ref):
                plgpu.wgmma(acc_ref, p, v_smem.at[slot])
                while_running()

            return pl.run_state(issue)(plgpu.ACC.init(acc))

        def wait_keys(j):
            """Block j's keys have landed (if there is a block j)."""
            pl.when(j < n)(lambda: plgpu.barrier_wait(k_bar.at[lax.rem(j, stages)]))

        c = scale * _LOG2E  # scores in base 2: p = exp2(s * c - m), one FMA an element

        def step(j, carry, masked):
            acc, m, l = carry
            slot = lax.rem(j, stages)
            # (block j's keys were waited for under the last step's P·V)
            # hand the tensor cores over while this wgmma runs
            s = base._qk(q_w, k_smem.at[slot], interpret, while_running=take_turn)
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                limit = _causal_limit(qs, tw, kvl, group, j, bk, interpret)
                s = jnp.where(base._iota((_M, bk), 1, interpret) < limit, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1) * c)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p = p.astype(dtype)
            # the softmax ends here, before the hand-over (the order the compiler keeps)
            acc, l, m_new, p = lax.optimization_barrier((acc, l, m_new, p))
            plgpu.barrier_arrive(turn)  # softmax done
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(turn)  # the tensor cores are free
            acc = pv(acc, p, slot, while_running=lambda: wait_keys(j + 1))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        acc = base._layout(jnp.zeros((_M, d), jnp.float32), plgpu.Layout.WGMMA, interpret)
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        m = base._layout(jnp.full((_M,), base.M_INIT, jnp.float32), row_layout, interpret)
        l = base._layout(jnp.zeros((_M,), jnp.float32), row_layout, interpret)
        plgpu.barrier_wait(q_bar.at[wg])
        wait_keys(0)
        pl.when(wg == 1)(take_turn)  # offset the two by one turn
        # blocks every row of this warpgroup sees whole (below its first query, which is
        # before kv_len, as its last one is) skip the causal mask; the rest are masked
        first_pos, last_pos = qs + tw, qs + tw + _M // group - 1
        n_whole = jnp.where(last_pos < kvl, jnp.clip(lax.div(first_pos + 1, bk), 0, n), 0)
        carry = lax.fori_loop(0, n_whole, functools.partial(step, masked=False), (acc, m, l))
        acc, _, l = lax.fori_loop(n_whole, n, functools.partial(step, masked=True), carry)
        pl.when(wg == 0)(take_turn)  # and even the count
        # no valid key: acc is 0 and so is the output; NaN inputs stay NaN
        inv = 1.0 / jnp.where(l != 0, l, 1.0)
        q_w[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_w, o_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)


def _check_config(cfg, d):
    if cfg.block_k % 64 or cfg.block_k < 64 or cfg.stages < 1 or cfg.warpgroups not in (1, 2) \
            or smem_bytes(cfg, d) > base.SMEM_BYTES:
        raise ValueError(f"mosaic_gpu prefill config {cfg}: block_k must be a multiple of 64, "
                         f"warpgroups 1 or 2 and the CTA's shared memory ({smem_bytes(cfg, d)} "
                         f"B at d={d}) at most {base.SMEM_BYTES} B")


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
    bq = cfg.warpgroups * _M // group  # queries per CTA
    nq = -(-t // bq)
    tp = nq * bq
    # rows (t, g) of each KV head: [B, T, Hkv, G, D] -> [B, Hkv, Tp * G, D]
    qg = q.astype(k.dtype).reshape(b, t, hkv, group, d).transpose(0, 2, 1, 3, 4)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, tp - t), (0, 0), (0, 0))).reshape(b, hkv, tp * group, d)
    smem = base._smem_kv
    kv_stages = [smem((cfg.stages, cfg.block_k, d), k.dtype)] * 2
    if cfg.warpgroups == 2:
        body, threads = _kernel_ws, dict(num_threads=3, thread_name="wg")
        scratch = [smem((2, _M, d), k.dtype), *kv_stages,
                   plgpu.Barrier(num_barriers=2),
                   plgpu.Barrier(num_barriers=cfg.stages),
                   plgpu.Barrier(num_barriers=cfg.stages),
                   plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),
                   plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),
                   plgpu.Barrier(num_arrivals=2)]
    else:
        body, threads = _kernel, {}
        scratch = [smem((_M, d), k.dtype), *kv_stages,
                   smem((_M, cfg.block_k), k.dtype),
                   smem((_M, d), k.dtype),
                   plgpu.Barrier(num_barriers=1),
                   plgpu.Barrier(num_barriers=cfg.stages),
                   plgpu.Barrier(num_barriers=cfg.stages)]
    kernel = functools.partial(
        body, t_len=t, s_len=s_len, nq=nq, group=group, bq=bq, bk=cfg.block_k,
        stages=cfg.stages, scale=1.0 / math.sqrt(d), interpret=interpret)
    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((b, hkv, tp * group, d), k.dtype),
        scratch_types=scratch,
        grid=(b, hkv, nq), grid_names=("b", "h", "q"), **threads,
        compiler_params=base.compiler_params(approx_math=cfg.warpgroups == 2),
        interpret=base.interpret_params() if interpret else False,
    )(cache_origin(layer_arr, row), q_start.astype(jnp.int32), kv_len.astype(jnp.int32), qg,
      k, v)
    out = out.reshape(b, hkv, tp, group, d)[:, :, :t].transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, hq, d).astype(q.dtype)
