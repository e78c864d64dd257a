"""The selector's compute, dispatched: its scores (steps 1-6 of SFI_METHOD.md §4) by jnp or the
Triton kernels, and the k-th largest key of the radix top-k by jnp or one kernel per row
(Triton or Mosaic GPU).
`selector.select` builds the selector on these."""

from __future__ import annotations

from jax import lax

from sfi_jax.kernels import selector_reference as reference
from sfi_jax.kernels.common import interpret_for, platform, sortable_keys, triton_available
from sfi_jax.kernels.selector_reference import ScoreParams

SCORES = ("auto", "xla", "pallas_gpu", "mosaic_gpu")
ADJUST = ("xla", "kernel")


def scores_at(logits, slot, key_norms, row, allowed_lo, allowed_hi, params: ScoreParams, *,
              cross_head_reduce=None, impl: str = "xla", adjust: str = "xla"):
    """z_adj [N, H, S] of logits[:, slot] [N, H, R, S] and key_norms[:, row] [N, H, S], from
    logits [N, M, H, R, S] and key_norms [N, B, H, S] (the kernels read them in place).
    impl: steps 1-4 by jnp ("xla"), the Triton kernels ("pallas_gpu"; "auto": on a GPU) or
    their Mosaic GPU twins ("mosaic_gpu": float32 logits, S a multiple of 128, else jnp);
    adjust: steps 5-6 by jnp ("xla") or, after the Triton kernels, one more ("kernel")."""
    size = logits.shape[-1]
    lo, hi = reference.clipped_range(size, allowed_lo, allowed_hi)
    if impl not in SCORES:
        raise ValueError(f"impl={impl!r}: expected one of {SCORES}")
    if adjust not in ADJUST:
        raise ValueError(f"adjust={adjust!r}: expected one of {ADJUST}")
    by_kernel = adjust == "kernel"
    if impl == "mosaic_gpu":
        from sfi_jax.kernels import selector_mgpu

        if selector_mgpu.scores_supported(logits):
            z = selector_mgpu.base_scores(logits, key_norms, lo, hi, slot, row, params=params,
                                          interpret=interpret_for("mosaic_gpu"))
            return reference.adjust_scores(z, lo, hi, params, cross_head_reduce)
        impl = "xla"
    if impl == "pallas_gpu" or (impl == "auto" and platform() == "gpu" and triton_available()):
        from sfi_jax.kernels import selector_gpu

        kw = dict(params=params, interpret=interpret_for("pallas_gpu"))
        fused = (by_kernel and cross_head_reduce is None
                 and selector_gpu.adjust_supported(params))
        z = selector_gpu.base_scores(logits, key_norms, lo, hi, slot, row,
                                     pad=selector_gpu.adjust_pad(params) if fused else 0, **kw)
        if fused:
            z = selector_gpu.adjust_scores(z, lo, hi, **kw)  # steps 5-6 in one pass
            if params.successor_radius > 0:
                z = reference.successor_spread(z, reference.allowed_mask(size, lo, hi),
                                               params.successor_radius)
            return z
    else:
        lg = lax.dynamic_index_in_dim(logits, slot, axis=1, keepdims=False)
        kn = lax.dynamic_index_in_dim(key_norms, row, axis=1, keepdims=False)
        z = reference.base_scores(lg, kn, lo, hi, params)
    return reference.adjust_scores(z, lo, hi, params, cross_head_reduce)


def kth_largest(scores, k: int, radix_bits: int, kernel: str | None):
    """The k-th largest sortable key of each row of scores [..., S]: by jnp (kernel None), or
    by one Pallas program per row (interpret mode off the GPU), which reads a row once per
    round instead of once per candidate digit: Triton's (kernel "pallas_gpu",
    kernels.selector_gpu) or Mosaic GPU's ("mosaic_gpu", kernels.selector_mgpu)."""
    if kernel is None:
        return reference.kth_largest_key(sortable_keys(scores), k, radix_bits)
    if kernel == "mosaic_gpu":
        from sfi_jax.kernels import selector_mgpu as mod
    elif kernel == "pallas_gpu":
        from sfi_jax.kernels import selector_gpu as mod  # Triton's Pallas lowering, when used
    else:
        raise ValueError(f"kernel={kernel!r}: expected None, 'pallas_gpu' or 'mosaic_gpu'")
    rows = scores.reshape(-1, scores.shape[-1])
    t = mod.kth_largest_key(rows, k, radix_bits=radix_bits, interpret=interpret_for(kernel))
    return t.reshape(scores.shape[:-1])
