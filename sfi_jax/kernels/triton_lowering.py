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
# that signals `griddepcontrol.launch_dependents` lets the next kernel's programs take the SMs
# its own last programs leave. A sweep point, set before anything is traced: None (no signal),
# "start" (as a program starts) or "late" (after its main loop).
LAUNCH_DEPENDENTS = None


def launch_dependents(idx, interpret: bool, after=None):
    """idx (an int32 vector) unchanged; on the GPU with LAUNCH_DEPENDENTS set it passes through
    `griddepcontrol.launch_dependents`, which ("late") waits for `after` (an int32 vector of
    idx's shape computed from the main loop's results)."""
    if interpret or LAUNCH_DEPENDENTS is None:
        return idx
    dep = after if LAUNCH_DEPENDENTS == "late" and after is not None else idx
    out, = plgpu_triton.elementwise_inline_asm(
        "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;", args=[idx, dep],
        constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(idx.shape, idx.dtype)])
    return out


def int_bits(x):
    """Float32 x's bits as int32 (a dependency for `launch_dependents(after=...)`)."""
    return jax.lax.bitcast_convert_type(x.astype(jax.numpy.float32), jax.numpy.int32)


__all__ = ["M_INIT", "NUM_SMS", "int_bits", "launch_dependents", "plgpu_triton"]
