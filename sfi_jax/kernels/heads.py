"""A decode step's q/k norm + rope on the fused q/k/v output, dispatched: one Triton launch
("kernel", `heads_gpu`), one Mosaic GPU launch ("mosaic_gpu", `heads_mgpu`; Hopper) or jnp
("xla", `heads_reference`). A kernel off the GPU runs in interpret mode."""

from __future__ import annotations

from sfi_jax.kernels import heads_reference as reference
from sfi_jax.kernels.common import interpret_for

IMPLS = ("kernel", "mosaic_gpu", "xla")


def supported(head_dim: int) -> bool:
    """Whether the kernel takes this head dim (a power of two >= 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def norm_rope_heads(qkv, cos, sin, q_norm, k_norm, *, num_q_heads, num_kv_heads, eps,
                    impl: str = "kernel", zero_fill: bool = False):
    """qkv [B, (Hq + 2 Hkv) * D] -> q [B, Hq, D], k, v [B, Hkv, D] (see
    `heads_reference.norm_rope_heads`). "mosaic_gpu" takes up to 64 half-precision rows with
    D a multiple of 64 (other inputs: jnp); zero_fill: its rows read unpadded."""
    if impl not in IMPLS:
        raise ValueError(f"heads impl must be one of {IMPLS}, got {impl!r}")
    kw = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, eps=eps)
    if impl == "mosaic_gpu":
        from sfi_jax.kernels import heads_mgpu

        d = qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
        if heads_mgpu.supported(qkv, d):
            return heads_mgpu.norm_rope_heads(qkv, cos, sin, q_norm, k_norm, **kw,
                                              interpret=interpret_for("mosaic_gpu"),
                                              zero_fill=zero_fill)
        impl = "xla"
    if impl == "xla":
        return reference.norm_rope_heads(qkv, cos, sin, q_norm, k_norm, **kw)
    from sfi_jax.kernels import heads_gpu  # Triton's Pallas lowering, imported only when used

    return heads_gpu.norm_rope_heads(qkv, cos, sin, q_norm, k_norm, **kw,
                                     interpret=interpret_for("pallas_gpu"))
