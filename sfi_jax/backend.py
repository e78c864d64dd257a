"""Which platform JAX runs on, asked in one place (defaults differ on GPU: kernels, split
layer weights, layer unrolling, the selector's top-k)."""

from __future__ import annotations

import os

import jax


def platform() -> str:
    """"gpu" for any GPU backend (cuda, rocm), else JAX's backend name ("cpu", "tpu")."""
    p = jax.default_backend()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def on_gpu() -> bool:
    return platform() == "gpu"


# Engine switches (README: Engine switches): environment variables read when a decode program
# is traced, for A/B runs; the defaults are the measured-fastest.
SWITCHES = {"SFI_JAX_REFRESH_COND": ("0", "1"), "SFI_JAX_REPACK": ("kernel", "xla"),
            "SFI_JAX_HEADS": ("kernel", "xla"), "SFI_JAX_MOE": ("tokens", "kernel", "xla"),
            "SFI_JAX_SELECTOR_ADJUST": ("kernel", "xla")}


def switch(name: str) -> str:
    """An engine switch's value ("" when unset); an unknown value is an error, not a silent
    default."""
    value = os.environ.get(name, "")
    if value and value not in SWITCHES[name]:
        raise ValueError(f"{name}={value!r}: expected one of {SWITCHES[name]} (or unset)")
    return value
