"""Decode attention kernels (GPU and TPU Pallas) and their pure-jnp references."""

from sfi_jax.kernels.api import dense_decode, sparse_decode

__all__ = ["dense_decode", "sparse_decode"]
