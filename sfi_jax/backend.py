"""Which platform JAX runs on, asked in one place (defaults differ on GPU: kernels, split
layer weights, layer unrolling, the selector's top-k)."""

from __future__ import annotations

import jax


def platform() -> str:
    """"gpu" for any GPU backend (cuda, rocm), else JAX's backend name ("cpu", "tpu")."""
    p = jax.default_backend()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def on_gpu() -> bool:
    return platform() == "gpu"
