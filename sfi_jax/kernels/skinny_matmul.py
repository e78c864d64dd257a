"""A decode step's weight matmuls, dispatched: the weight-streaming Triton kernel ("kernel",
`skinny_matmul_gpu`; interpret mode off the GPU) for up to MAX_ROWS rows, the kernel only where
it was measured faster ("by_shape"), its Mosaic GPU twin ("mosaic_gpu", `skinny_matmul_mgpu`,
Hopper: half-precision [K, N] weights, K and N multiples of 64, its epilogues fused on
request (`matmul_epilogue`, `matmul_heads`); other weights take XLA; "mosaic_by_shape": the
twin for as few rows as "by_shape", the choice without the Triton lowering) or XLA ("xla",
`skinny_matmul_reference`). The input rows may be
RMS-normed first: the Triton kernel folds the norm into the product, so it costs no launch;
before the Mosaic kernel XLA norms the rows."""

from __future__ import annotations

import math

import jax

from sfi_jax.kernels import skinny_matmul_reference as reference
from sfi_jax.kernels.common import interpret_for

IMPLS = ("by_shape", "kernel", "mosaic_gpu", "mosaic_by_shape", "xla")
MAX_ROWS = 64  # skinny_matmul_gpu.MAX_ROWS (not imported here: Triton loads only when used)
# by_shape: where the kernel beat XLA's gemm on the H200 in the decode loop
# (benchmarks/e2e_batch1.md): a few rows, every weight size; XLA's gemm won from 6 rows
# (benchmarks/skinny_matmul.md)
BY_SHAPE_ROWS = 4
MOSAIC_ROWS = {"mosaic_gpu": MAX_ROWS, "mosaic_by_shape": BY_SHAPE_ROWS}  # the twin's row limits


def uses_kernel(impl: str, rows: int) -> bool:
    """Whether `impl` runs the Triton kernel for `rows` rows: "kernel" up to MAX_ROWS rows,
    "by_shape" up to BY_SHAPE_ROWS, "xla" and the Mosaic twin's never."""
    if impl not in IMPLS:
        raise ValueError(f"matmul impl must be one of {IMPLS}, got {impl!r}")
    if impl == "by_shape":
        return rows <= BY_SHAPE_ROWS
    return impl == "kernel" and rows <= MAX_ROWS


def skinny_matmul(x, weights, norm=None, *, eps=1e-6, impl: str = "xla", config=None,
                  transposed: bool = False, kmajor_config=None, launch_dependents=None,
                  zero_fill: bool = False):
    """x [..., K] (RMS-normed by `norm` [K] first, when given) times each of `weights` (one or
    two [K, N] of one shape; [N, K] when `transposed`) -> a tuple of float32 [..., N].

    The kernel rounds the rows times the norm's weight to their dtype and scales the product
    by the row factor after it; the reference rounds the normed rows (float rounding apart,
    the same). config: the kernel's `skinny_matmul_gpu.Config` (None: its default).
    Transposed weights take the K-major kernel for up to FUSED_MAX_ROWS rows (its products
    rounded to x's dtype) and XLA for more: kmajor_config its `KMajorConfig` (None: the
    defaults), launch_dependents its signal (`common.signals_dependents`; the Mosaic twin's
    programmatic dependent launch too). zero_fill: the Mosaic twin reads the rows unpadded
    (`KernelTuning.zero_fill`)."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    if transposed:
        if not uses_fused(impl, rows):
            return reference.skinny_matmul(x, weights, norm, eps=eps, transposed=True)
        from sfi_jax.kernels import skinny_matmul_gpu

        return tuple(skinny_matmul_gpu.skinny_matmul_kmajor(
            x.reshape(rows, k), (w,), norm, eps=eps, interpret=interpret_for("pallas_gpu"),
            config=kmajor_config, launch_dependents=launch_dependents)
            .astype(jax.numpy.float32).reshape(*lead, w.shape[0]) for w in weights)
    if rows <= MOSAIC_ROWS.get(impl, 0):
        return _mosaic(x, weights, norm, eps, lead, rows, k, launch_dependents, zero_fill)
    if not uses_kernel(impl, rows):
        return reference.skinny_matmul(x, weights, norm, eps=eps)
    from sfi_jax.kernels import skinny_matmul_gpu  # Triton's Pallas lowering, only when used

    parts = skinny_matmul_gpu.skinny_matmul_partials(
        x.reshape(rows, k), tuple(weights), norm, interpret=interpret_for("pallas_gpu"), config=config)
    if norm is None:
        scale = 1.0
    else:
        parts, ss = parts[:-1], parts[-1]
        scale = jax.lax.rsqrt(ss.sum(axis=0) / k + eps)[:, None]
    return tuple((p.sum(axis=0) * scale).reshape(*lead, p.shape[-1]) for p in parts)


def _mosaic(x, weights, norm, eps, lead, rows, k, launch_dependents=None, zero_fill=False):
    """The Mosaic GPU kernel's partial sums, added up, for the weights it takes (else XLA);
    the rows RMS-normed (and rounded) first as in the reference. launch_dependents,
    zero_fill: the kernel's (`skinny_matmul_mgpu.skinny_matmul_partials`)."""
    from sfi_jax.kernels import skinny_matmul_mgpu  # Mosaic GPU's Pallas, only when used
    from sfi_jax.kernels.common import rms_norm

    h = (x if norm is None else rms_norm(x, norm, eps)).reshape(rows, k)
    if not skinny_matmul_mgpu.supported(h, weights[0]):
        return reference.skinny_matmul(x, weights, norm, eps=eps)
    parts = skinny_matmul_mgpu.skinny_matmul_partials(
        h, tuple(weights), interpret=interpret_for("mosaic_gpu"),
        launch_dependents=launch_dependents, zero_fill=zero_fill)
    return tuple(p.sum(axis=0).reshape(*lead, p.shape[-1]) for p in parts)


def matmul_epilogue(x, weights, norm=None, *, epilogue, residual=None, eps=1e-6,
                    impl: str = "xla", fuse: bool = False, transposed: bool = False,
                    launch_dependents=None, zero_fill: bool = False, **kwargs):
    """`skinny_matmul`'s products (each rounded to x's dtype) followed by the epilogue, in
    x's dtype: "residual": residual + x @ w; "silu": silu(x @ w_gate) * (x @ w_up).
    fuse: the Mosaic GPU twin applies it in the kernel (`skinny_matmul_mgpu.skinny_matmul_fused`)
    where it takes the call (a Mosaic impl for these rows, [K, N] weights it supports, a grid
    resident at once); everything else runs the products, then XLA's fusion. zero_fill: the
    Mosaic twin reads the rows unpadded; kwargs: the products' `skinny_matmul` options."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    if fuse and not transposed and rows <= MOSAIC_ROWS.get(impl, 0):
        from sfi_jax.kernels import skinny_matmul_mgpu
        from sfi_jax.kernels.common import rms_norm

        n = weights[0].shape[1]
        if (skinny_matmul_mgpu.supported(x.reshape(rows, k), weights[0])
                and skinny_matmul_mgpu.fused_plan(rows, k, n, len(weights)) is not None):
            h = x if norm is None else rms_norm(x, norm, eps)
            out = skinny_matmul_mgpu.skinny_matmul_fused(
                h.reshape(rows, k), tuple(weights), epilogue=epilogue,
                residual=None if residual is None else residual.reshape(rows, n),
                interpret=interpret_for("mosaic_gpu"), launch_dependents=launch_dependents,
                zero_fill=zero_fill)
            return out.reshape(*lead, n)
    ys = tuple(y.astype(x.dtype) for y in skinny_matmul(
        x, weights, norm, eps=eps, impl=impl, transposed=transposed,
        launch_dependents=launch_dependents, zero_fill=zero_fill, **kwargs))
    if epilogue == "residual":
        return residual + ys[0]
    if epilogue == "silu":
        return jax.nn.silu(ys[0]) * ys[1]
    raise ValueError(f"epilogue must be 'residual' or 'silu', got {epilogue!r}")


def matmul_heads(x, w_qkv, norm, cos, sin, q_norm, k_norm, *, eps, num_q_heads, num_kv_heads,
                 impl: str, launch_dependents=None, zero_fill: bool = False):
    """A decode step's q, k, v heads [R, H, D] from rows x [R, K] (RMS-normed by `norm` first)
    times the fused q/k/v weight, the heads' norms and rope in the Mosaic GPU twin's kernel
    (`skinny_matmul_mgpu.skinny_matmul_heads`; cos, sin [R, D / 2]); None where the twin does
    not take the call (impl, rows, shapes, a grid not resident at once): the caller's unfused
    path then. launch_dependents, zero_fill: the kernel's."""
    rows, k = x.shape
    if rows > MOSAIC_ROWS.get(impl, 0):
        return None
    from sfi_jax.kernels import skinny_matmul_mgpu
    from sfi_jax.kernels.common import rms_norm

    n = w_qkv.shape[1]
    d = n // (num_q_heads + 2 * num_kv_heads)
    if (not skinny_matmul_mgpu.supported(x, w_qkv) or d % 64
            or skinny_matmul_mgpu.fused_plan(rows, k, n, 1, skinny_matmul_mgpu.Config(block_n=d),
                                             epilogue="heads") is None):
        return None
    return skinny_matmul_mgpu.skinny_matmul_heads(
        rms_norm(x, norm, eps), w_qkv, cos, sin, q_norm, k_norm, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, eps=eps, interpret=interpret_for("mosaic_gpu"),
        launch_dependents=launch_dependents, zero_fill=zero_fill)


FUSED_MAX_ROWS = 4  # skinny_matmul_gpu.FUSED_MAX_ROWS


def uses_fused(impl: str, rows: int) -> bool:
    """Whether `impl` runs the kernel with its epilogues fused for `rows` rows (up to
    FUSED_MAX_ROWS: the epilogue walks the rows one by one)."""
    return uses_kernel(impl, rows) and rows <= FUSED_MAX_ROWS


def new_sync():
    """The fused kernels' counters (`skinny_matmul_gpu.new_sync`): made once, passed from call
    to call."""
    from sfi_jax.kernels import skinny_matmul_gpu

    return skinny_matmul_gpu.new_sync()


def skinny_matmul_fused(x, weights, norm, sync, *, epilogue, transposed=False, tuning=None,
                        **kwargs):
    """`skinny_matmul_gpu.skinny_matmul_fused` (interpret mode off the GPU): x [R, K] times the
    weights, the epilogue applied by the kernel; returns its outputs and the counters.
    transposed: [N, K] weights, for `skinny_matmul_gpu.skinny_matmul_kmajor` (its "residual"
    and "silu" epilogues; no counters: `sync` comes back as it went).
    tuning: an `options.KernelTuning` (None: the tuned kernels): its K-major config, the fused
    grids' programs per SM and the dependents' signal."""
    from sfi_jax.kernels import skinny_matmul_gpu

    interpret = interpret_for("pallas_gpu")
    if tuning is not None:
        kwargs["launch_dependents"] = tuning.launch_dependents
        if transposed:
            kwargs["config"] = tuning.kmajor
        else:
            kwargs["programs_per_sm"] = tuning.fused_programs_per_sm
    if transposed:
        if epilogue not in ("residual", "silu"):
            raise ValueError(f"transposed weights take the 'residual' and 'silu' epilogues, "
                             f"got {epilogue!r}")
        return skinny_matmul_gpu.skinny_matmul_kmajor(x, tuple(weights), norm,
                                                      epilogue=epilogue, interpret=interpret,
                                                      **kwargs), sync
    return skinny_matmul_gpu.skinny_matmul_fused(x, tuple(weights), norm, sync,
                                                 epilogue=epilogue, interpret=interpret,
                                                 **kwargs)
