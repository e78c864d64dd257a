"""On-disk caches: JAX's compiled programs and dequantised GGUF checkpoints.

A second run of the same command then skips most of the first one's start-up: compiling the
prefill and decode programs, and parsing and dequantising the GGUF file. Everything lives under
one root: `$SFI_JAX_CACHE_DIR`, else `$XDG_CACHE_HOME/sfi_jax`, else `~/.cache/sfi_jax`;
`SFI_JAX_CACHE_DIR=off` (or empty) turns both off.
"""

from __future__ import annotations

import os

_OFF = ("", "off", "none", "0", "false")


def cache_root() -> str | None:
    """The cache root directory, or None when `SFI_JAX_CACHE_DIR` turns caching off."""
    root = os.environ.get("SFI_JAX_CACHE_DIR")
    if root is not None:
        return None if root.strip().lower() in _OFF else os.path.expanduser(root.strip())
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sfi_jax")


def default_compilation_cache_dir() -> str | None:
    """Where the CLI keeps JAX's persistent compilation cache unless told otherwise."""
    root = cache_root()
    return None if root is None else os.path.join(root, "jax")


def enable_compilation_cache(directory: str) -> None:
    """Turn on JAX's persistent compilation cache in `directory`, for every program.

    JAX by default caches only programs that took over a second to compile; the CPU's many
    small programs add up too, so every size and compile time is kept. Call it before the
    first jitted call (what the CLI does); the API user writes the same three updates.
    """
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
