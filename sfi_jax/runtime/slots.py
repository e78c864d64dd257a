"""Refresh slots: a static number of row indices per step, empty ones out of range."""

from __future__ import annotations

import jax.numpy as jnp


def unique_slots(idx, size):
    """Replace the fill value `size` of a nonzero(...) result by size, size+1, ..."""
    idx = idx.astype(jnp.int32)
    return jnp.where(idx >= size, size + jnp.arange(idx.shape[0], dtype=jnp.int32), idx)


def refresh_slots(slow, done, n_slots):
    """Up to n_slots rows that take a slow step now (others wait), ascending; empty slots hold
    B, B+1, ... (out of range, dropped by scatters; unique, so scatters need no atomics)."""
    return unique_slots(jnp.nonzero(slow & ~done, size=n_slots, fill_value=slow.shape[0])[0],
                        slow.shape[0])


def local_slots(mask, n_slots):
    """The refresh rows among a row mask (under shard_map: one device's rows), at most
    min(n_slots, rows) of them, empty slots out of range as in `refresh_slots`."""
    n = min(n_slots, mask.shape[0])
    return unique_slots(jnp.nonzero(mask, size=n, fill_value=mask.shape[0])[0], mask.shape[0])
