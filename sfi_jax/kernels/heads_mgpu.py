"""One decode step's attention heads from the fused q/k/v matmul output, in one launch, on
NVIDIA Hopper GPUs: Pallas with the Mosaic GPU lowering (the twin of heads_gpu, Triton).

Program j owns head j (q heads, then k, then v, the fused weight's column order) for all of
the step's rows (at most 64: wgmma's register layout's rows): it copies the head's columns
[rows, D] and, for a q or k head, cos, sin and its norm's weight into shared memory with TMA,
then RMS-norms the head's rows over D (a row reduction in wgmma's register layout, on the
[64, D / 2] halves) and rotates them (rotate-half), rounding each step as
`models.modeling.attention_inputs` does; v heads are copied as they are. The arithmetic is
`skinny_matmul_mgpu`'s fused heads epilogue without the matmul. Lowered with Lane semantics,
as that epilogue (`attention_mgpu.compiler_params`). Off a GPU the kernel runs in Mosaic
GPU's interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sfi_jax.kernels.attention_mgpu import (HALF, compiler_params, interpret_params, load,
                                            pad_rows8, rows8_of)

MAX_ROWS = 64  # wgmma's register layout's rows
_M = 64


def supported(qkv, head_dim: int) -> bool:
    """Half-precision rows (at most 64) and a head dim a multiple of 64 (halves of whole
    64-element tiles)."""
    return (qkv.ndim == 2 and 1 <= qkv.shape[0] <= MAX_ROWS and head_dim % 64 == 0
            and jnp.dtype(qkv.dtype) in HALF)


def norm_rope_into(out_smem, x1, x2, nw_smem, cs_smem, read, *, d, eps, qk_norm, dt):
    """A q or k head's rows from its float32 halves x1, x2 [64, D / 2] (wgmma's register
    layout): RMS-normed over D by the norm's weight (nw_smem [64, D], one copy a row; rounded
    to dt) when qk_norm, rotated by cos, sin (cs_smem [2, 64, D / 2]) and written to out_smem
    [64, D] in dt. read(ref): a shared-memory ref into registers. Shared by this kernel and
    `skinny_matmul_mgpu`'s fused heads epilogue."""
    f32, half = jnp.float32, d // 2
    y1, y2 = x1, x2
    if qk_norm:
        ss = jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)
        inv = lax.broadcast_in_dim(lax.rsqrt(ss / d + eps), x1.shape, [0])
        y1, y2 = ((y * inv * read(nw_smem.at[:, pl.ds(h * half, half)]).astype(f32))
                  .astype(dt).astype(f32) for h, y in ((0, x1), (1, x2)))
    cos, sin = (read(cs_smem.at[i]) for i in (0, 1))
    out_smem.at[:, pl.ds(0, half)][...] = (y1 * cos - y2 * sin).astype(dt)
    out_smem.at[:, pl.ds(half, half)][...] = (y2 * cos + y1 * sin).astype(dt)


def _kernel(qkv_ref, cos_ref, sin_ref, *refs, hq, hkv, d, m, qk_norm, eps, interpret):
    """Program j: head j of every row (see the module's docstring)."""
    norm_refs, (q_out, k_out, v_out) = (refs[:2], refs[2:]) if qk_norm else ((), refs)
    j = lax.axis_index("j")
    rows8, half = rows8_of(m), d // 2
    row0 = pl.multiple_of(j * 0, 8)  # (a traced 0: the copies may read past m, see `zero_fill`)
    is_qk = j < hq + hkv
    f32, dt = jnp.float32, q_out.dtype
    wl = plgpu.Layout.WGMMA

    def read(ref):  # [64, half] in wgmma's row layout (interpret mode: no layouts)
        return ref[...] if interpret else load(ref, wl, optimized=False)

    def body(x_smem, cs_smem, nw_smem, out_smem, x_bar, in_bar):
        plgpu.copy_gmem_to_smem(qkv_ref.at[pl.ds(row0, rows8), pl.ds(pl.multiple_of(j * d, d), d)],
                                x_smem.at[pl.ds(0, rows8)], x_bar.at[0])

        @pl.when(is_qk)
        def _inputs():  # cos, sin and (each of rows8 rows) the head's norm weight
            for i, ref in enumerate((cos_ref, sin_ref)):
                plgpu.copy_gmem_to_smem(ref.at[pl.ds(row0, rows8)],
                                        cs_smem.at[i, pl.ds(0, rows8)], in_bar.at[0])
            for norm_ref, this in zip(norm_refs, (j < hq, j >= hq)):
                @pl.when(this)
                def _norm_rows():
                    for r in range(rows8):
                        plgpu.copy_gmem_to_smem(norm_ref, nw_smem.at[r], in_bar.at[0])

        plgpu.barrier_wait(x_bar.at[0])
        x1, x2 = (read(x_smem.at[:, pl.ds(h * half, half)]).astype(f32) for h in (0, 1))

        @pl.when(is_qk)
        def _norm_rope():
            plgpu.barrier_wait(in_bar.at[0])
            norm_rope_into(out_smem, x1, x2, nw_smem, cs_smem, read, d=d, eps=eps,
                           qk_norm=qk_norm, dt=dt)

        @pl.when(~is_qk)
        def _v():
            out_smem[...] = x_smem[...]

        plgpu.commit_smem()
        for out_ref, lo, hi in ((q_out, 0, hq), (k_out, hq, hq + hkv),
                                (v_out, hq + hkv, hq + 2 * hkv)):
            @pl.when((j >= lo) & (j < hi))
            def _store():
                col = pl.multiple_of((j - lo) * d, d)
                plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, m)], out_ref.at[:, pl.ds(col, d)])
        plgpu.wait_smem_to_gmem(0)

    n_in = 2 + (rows8 if qk_norm else 0)  # the copies the q/k heads' barrier counts
    pl.run_scoped(body, plgpu.SMEM((_M, d), dt), plgpu.SMEM((2, _M, half), f32),
                  plgpu.SMEM((_M, d), dt), plgpu.SMEM((_M, d), dt),
                  plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_arrivals=n_in, num_barriers=1))


@functools.partial(jax.jit, static_argnames=("num_q_heads", "num_kv_heads", "eps", "interpret",
                                             "zero_fill"))
def norm_rope_heads(qkv, cos, sin, q_norm, k_norm, *, num_q_heads, num_kv_heads, eps,
                    interpret=False, zero_fill=False):
    """qkv [B, (Hq + 2 Hkv) * D] -> q [B, Hq, D], k, v [B, Hkv, D] (B <= 64, half precision,
    D a multiple of 64): heads_gpu.norm_rope_heads's contract. cos, sin: float32 [B, D / 2];
    q_norm, k_norm: [D] weights, or None. zero_fill: the rows read unpadded (TMA's zeros past
    B; `KernelTuning.zero_fill`), else padded to a multiple of 8 by XLA."""
    b, width = qkv.shape
    hq, hkv = num_q_heads, num_kv_heads
    d = width // (hq + 2 * hkv)
    if d * (hq + 2 * hkv) != width or not supported(qkv, d):
        raise ValueError(f"mosaic_gpu norm_rope_heads takes bf16/f16 qkv [B <= {MAX_ROWS}, "
                         f"(Hq + 2 Hkv) * D] with D a multiple of 64; got {qkv.dtype} "
                         f"{qkv.shape} for {hq} + 2 x {hkv} heads")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together (or neither)")
    qk_norm = q_norm is not None
    rows = [pad_rows8(a, zero_fill) for a in (qkv, cos.astype(jnp.float32),
                                              sin.astype(jnp.float32))]
    norms = (q_norm.astype(qkv.dtype), k_norm.astype(qkv.dtype)) if qk_norm else ()
    kernel = functools.partial(_kernel, hq=hq, hkv=hkv, d=d, m=b, qk_norm=qk_norm, eps=eps,
                               interpret=interpret)
    q, k, v = plgpu.kernel(
        kernel, out_type=[jax.ShapeDtypeStruct((b, h * d), qkv.dtype) for h in (hq, hkv, hkv)],
        grid=(hq + 2 * hkv,), grid_names=("j",),
        compiler_params=compiler_params(lane=True),
        interpret=interpret_params() if interpret else False,
    )(*rows, *norms)
    return q.reshape(b, hq, d), k.reshape(b, hkv, d), v.reshape(b, hkv, d)
