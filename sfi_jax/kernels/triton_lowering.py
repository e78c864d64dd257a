"""The one module that imports Pallas' Triton lowering (it warns of its deprecation on jax 0.11;
the GPU kernels use it explicitly, see DESIGN.md), and the constants the GPU kernels share."""

from __future__ import annotations

import functools
import warnings

import jax

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as plgpu_triton

M_INIT = -1e30  # a finite running-max start: exp(m_old - m_new) is never NaN
NUM_SMS = 132  # streaming multiprocessors of the H100/H200 the grid sizes aim at

# Programmatic dependent launch (Hopper and newer; XLA's xla_gpu_enable_pdl, on there): XLA
# launches a Triton kernel so that it may be scheduled before the kernel ahead of it ends, with
# a `griddepcontrol.wait` at its entry. Each decode kernel here signals
# `griddepcontrol.launch_dependents` after its main loop, so the next kernel's programs take the
# SMs its last programs leave while those finish (the signal releases nothing: the next kernel
# still waits for this one to end). "auto": on a GPU of compute capability 9.0 or more (the
# instruction's minimum); True / False: always / never (tests, A/B runs). Set before tracing.
LAUNCH_DEPENDENTS = "auto"
# The same for `l2_prefetch` ("auto": Hopper or newer; True lets a CPU test lower it for CUDA)
L2_PREFETCH = "auto"


@functools.cache
def _hopper_or_newer() -> bool:
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend
        return False
    cc = getattr(gpus[0], "compute_capability", None)
    return cc is not None and float(cc) >= 9.0


def signals_dependents() -> bool:
    if LAUNCH_DEPENDENTS == "auto":
        return _hopper_or_newer()
    return bool(LAUNCH_DEPENDENTS)


def launch_dependents(idx, interpret: bool, after):
    """idx (an int32 vector) unchanged; on the GPU it passes through
    `griddepcontrol.launch_dependents`, placed after `after` (an int32 vector of idx's shape
    computed from the kernel's main loop: the signal's operand, so it cannot move above)."""
    if interpret or not signals_dependents():
        return idx
    out, = plgpu_triton.elementwise_inline_asm(
        "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;", args=[idx, after],
        constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(idx.shape, idx.dtype)])
    return out


# The decode matmuls' L2 prefetch of the weights the next kernel reads first
# (`skinny_matmul_gpu`): needs the Triton lowering's rule registry, which jax keeps private, so
# a jax without it runs with no prefetch rather than failing.
try:
    from jax._src import core as _jax_core
    from jax._src.lib.mlir import ir as _ir
    from jax._src.lib.triton import dialect as _tt
    from jax._src.pallas.triton import lowering as _lowering
except ImportError:  # pragma: no cover - a jax without the Triton lowering
    _lowering = None

if _lowering is not None:
    _l2_prefetch_p = _jax_core.Primitive("sfi_l2_prefetch")

    @_l2_prefetch_p.def_abstract_eval
    def _l2_prefetch_abstract_eval(ref, offsets, flags, after, *, nbytes):
        del ref, flags, after, nbytes
        return _jax_core.ShapedArray(offsets.shape, jax.numpy.int32)

    @_lowering.register_lowering(_l2_prefetch_p)
    def _l2_prefetch_lowering(ctx, ptr, offsets, flags, after, *, nbytes):
        shape = list(ctx.avals_in[1].shape)
        ptrs = _tt.addptr(_ir.RankedTensorType.get(shape, ptr.type),
                          _tt.splat(_ir.RankedTensorType.get(shape, ptr.type), ptr), offsets)
        asm = ("{\n\t.reg .pred %sfi_pf;\n\tsetp.ne.s32 %sfi_pf, $2, 0;\n\t"
               f"@%sfi_pf cp.async.bulk.prefetch.L2.global [$1], {nbytes};\n\t"
               "mov.b32 $0, $3;\n\t}")
        # not pure: nothing reads the prefetch, and it must stay where it is
        return _tt.elementwise_inline_asm(
            [_ir.RankedTensorType.get(shape, _ir.IntegerType.get_signless(32))], asm,
            constraints="=r,l,r,r", pure=False, packed_element=1, args=[ptrs, flags, after])


def l2_prefetch_supported(interpret: bool) -> bool:
    """Whether `l2_prefetch` issues anything: on a Hopper or newer GPU (`cp.async.bulk`) with
    the lowering hook available."""
    if interpret or _lowering is None:
        return False
    return _hopper_or_newer() if L2_PREFETCH == "auto" else bool(L2_PREFETCH)


def l2_prefetch(ref, offsets, flags, after, nbytes: int, interpret: bool):
    """Asks the GPU to load `nbytes` of `ref` (a whole kernel operand in global memory) at each
    element offset of `offsets` into L2 where `flags` is nonzero (`cp.async.bulk.prefetch`: the
    copy engine fetches while the program goes on; nothing waits for it). offsets, flags, after:
    int32 vectors of one shape, one element per thread (an element held by several threads is
    issued by each). Returns `after`, so the prefetch is ordered after what made it.
    offsets and nbytes must keep the addresses 16-byte aligned."""
    if not l2_prefetch_supported(interpret):
        return after
    return _l2_prefetch_p.bind(ref, offsets, flags, after, nbytes=int(nbytes))


def dependents_mask(n: int, interpret: bool, after):
    """An all-true bool [n] mask through `launch_dependents`, for a kernel's last stores:
    `after` is a float or int vector [n] from the main loop's results."""
    if jax.numpy.issubdtype(after.dtype, jax.numpy.floating):
        after = jax.lax.bitcast_convert_type(after.astype(jax.numpy.float32), jax.numpy.int32)
    return launch_dependents(jax.numpy.arange(n), interpret, after) < n


__all__ = ["M_INIT", "NUM_SMS", "dependents_mask", "l2_prefetch", "l2_prefetch_supported",
           "launch_dependents", "plgpu_triton", "signals_dependents"]
