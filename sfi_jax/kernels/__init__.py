"""Decode attention kernels (GPU and TPU Pallas) and their pure-jnp references."""

from sfi_jax.kernels.attention import dense_decode, sparse_decode

__all__ = ["dense_decode", "sparse_decode"]
from sfi_jax.kernels.prefill_attention import prefill_attention  # noqa: E402,F401
