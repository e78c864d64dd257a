"""Kept for old imports: `platform` and `on_gpu` live in `sfi_jax.options`."""

from sfi_jax.options import on_gpu, platform

__all__ = ["on_gpu", "platform"]
