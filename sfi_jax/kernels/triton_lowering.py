"""The one module that imports Pallas' Triton lowering (it warns of its deprecation on jax 0.11;
the GPU kernels use it explicitly, see DESIGN.md), and the constants the GPU kernels share."""

from __future__ import annotations

import warnings

import jax

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as plgpu_triton

M_INIT = -1e30  # a finite running-max start: exp(m_old - m_new) is never NaN
NUM_SMS = 132  # streaming multiprocessors of the H100/H200 the grid sizes aim at

# Programmatic dependent launch (Hopper): XLA launches a Triton kernel so that it may start
# before the kernel ahead of it ends, and puts a `griddepcontrol.wait` at its entry. A kernel
# that signals `griddepcontrol.launch_dependents` early lets the next kernel's programs take
# the SMs its own last programs leave. A sweep point, set before anything is traced.
EARLY_LAUNCH = False


def launch_dependents(idx, interpret: bool):
    """idx (an int32 vector the kernel uses early) unchanged; on the GPU with EARLY_LAUNCH it
    passes through `griddepcontrol.launch_dependents`, so the signal comes before what uses it."""
    if interpret or not EARLY_LAUNCH:
        return idx
    out, = plgpu_triton.elementwise_inline_asm(
        "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;", args=[idx], constraints="=r,r",
        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(idx.shape, idx.dtype)])
    return out


__all__ = ["M_INIT", "NUM_SMS", "launch_dependents", "plgpu_triton"]
