"""Decode attention kernels (GPU and TPU Pallas) and their pure-jnp references."""

from sfi_jax.kernels.attention import dense_decode, sparse_decode
from sfi_jax.kernels.prefill_attention import prefill_attention

__all__ = ["dense_decode", "prefill_attention", "sparse_decode"]
