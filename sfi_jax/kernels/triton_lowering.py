"""The one module that imports Pallas' Triton lowering (it warns of its deprecation on jax 0.11;
the GPU kernels use it explicitly, see DESIGN.md), and the constants the GPU kernels share."""

from __future__ import annotations

import warnings

import jax

from sfi_jax.kernels.common import signals_dependents

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas import triton as plgpu_triton
except ImportError as e:  # a jax after the Triton lowering's removal
    raise ImportError(
        f"jax {jax.__version__} has no Pallas Triton lowering, which this choice of kernel needs: "
        "leave the EngineOptions at 'auto' (the Mosaic GPU and XLA forms) or pick 'mosaic_gpu' "
        "or 'xla' for it") from e

M_INIT = -1e30  # a finite running-max start: exp(m_old - m_new) is never NaN
NUM_SMS = 132  # streaming multiprocessors of the H100/H200 the grid sizes aim at

# Programmatic dependent launch (Hopper and newer; XLA's xla_gpu_enable_pdl, on there): XLA
# launches a Triton kernel so that it may be scheduled before the kernel ahead of it ends, with
# a `griddepcontrol.wait` at its entry. Each decode kernel here signals
# `griddepcontrol.launch_dependents` after its main loop, so the next kernel's programs take the
# SMs its last programs leave while those finish (the signal releases nothing: the next kernel
# still waits for this one to end). The kernels take it as a static `launch_dependents`
# argument: None (the default) on a GPU of compute capability 9.0 or more (the instruction's
# minimum); True / False: always / never (tests, A/B runs).


def launch_dependents(idx, signal: bool, after):
    """idx (an int32 vector) unchanged; with `signal` (`signals_dependents`) it passes through
    `griddepcontrol.launch_dependents`, placed after `after` (an int32 vector of idx's shape
    computed from the kernel's main loop: the signal's operand, so it cannot move above)."""
    if not signal:
        return idx
    out, = plgpu_triton.elementwise_inline_asm(
        "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;", args=[idx, after],
        constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(idx.shape, idx.dtype)])
    return out


def dependents_mask(n: int, signal: bool, after):
    """An all-true bool [n] mask through `launch_dependents`, for a kernel's last stores:
    `after` is a float or int vector [n] from the main loop's results."""
    if jax.numpy.issubdtype(after.dtype, jax.numpy.floating):
        after = jax.lax.bitcast_convert_type(after.astype(jax.numpy.float32), jax.numpy.int32)
    return launch_dependents(jax.numpy.arange(n), signal, after) < n


__all__ = ["M_INIT", "NUM_SMS", "dependents_mask", "launch_dependents", "plgpu_triton",
           "signals_dependents"]
