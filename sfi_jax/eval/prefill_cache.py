"""Reuse one prefill across many `generate` calls on the same prompts.

An evaluation decodes the same prompts under a dozen policies and budgets; the dense prefill is
identical for all of them and dominates the cost on a CPU. `shared_prefill()` hands out a chunk
function for `generate(..., prefill_fn=...)` with `runtime.prefill.prefill_chunk`'s signature:
it records the chunk calls; at the last chunk the whole prompt batch is looked up, and a cached
result (copied, since decode donates the cache) is returned; otherwise the recorded chunks are
run for real, each on the causal prefix of the cache it can see. The decode path is untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sfi_jax.runtime import prefill


def _replay(real, params, pending, lengths, cfg, kw):
    """Run the recorded chunks. A chunk at [s, s + C) only needs cache positions < s + C, so it
    runs on the cache's prefix of that length (causal: the rest is masked anyway), which halves
    the attention work of a long prompt; the prefix is then written into the full cache."""
    k, v, _, carry = pending[0]
    L, B, Hkv, S, D = k.shape
    kk = vv = jnp.zeros((L, B, Hkv, 0, D), k.dtype)
    kn = jnp.zeros((L, B, Hkv, 0), jnp.float32)
    for toks, s in pending[1:]:
        n = min(s + toks.shape[1], S)
        grow = n - kk.shape[3]
        kk = jnp.pad(kk, ((0, 0),) * 3 + ((0, grow), (0, 0)))
        vv = jnp.pad(vv, ((0, 0),) * 3 + ((0, grow), (0, 0)))
        kn = jnp.pad(kn, ((0, 0),) * 3 + ((0, grow),))
        kk, vv, kn, carry = real(params, kk, vv, kn, jnp.asarray(toks), jnp.int32(s), lengths,
                                 carry, cfg=cfg, with_norms=True, **kw)
    rest = S - kk.shape[3]
    return (jnp.pad(kk, ((0, 0),) * 3 + ((0, rest), (0, 0))),
            jnp.pad(vv, ((0, 0),) * 3 + ((0, rest), (0, 0))),
            jnp.pad(kn, ((0, 0),) * 3 + ((0, rest),)), carry)


@dataclasses.dataclass
class SharedPrefill:
    """What `shared_prefill` yields: `prefill_fn` for `generate(..., prefill_fn=...)`, and
    the hit / miss counters of its lookups."""

    prefill_fn: Callable
    counts: dict


@contextlib.contextmanager
def shared_prefill(max_entries: int = 2, real: Callable = prefill.prefill_chunk):
    """Context manager; yields a `SharedPrefill`. Pass its prefill_fn to the `generate` calls
    that should share prefills; real: the chunk function it runs on a miss.

    Key norms are always computed (an SFI call needs them; a dense call just does not get them).
    An SFI prefill also keeps the window queries of the initial selection, so it serves later
    dense calls too; a dense prefill cannot serve an SFI call (it is replayed and replaced).
    """
    store: dict = {}
    pending: list = []
    counts = {"hits": 0, "misses": 0}

    def cached(params, k, v, key_norms, tokens, start, lengths, carry, *, cfg, with_norms,
               **kw):
        start = int(start)
        if start == 0:
            pending.clear()
            pending.append((k, v, key_norms, carry))
        pending.append((np.asarray(tokens), start))
        if start + tokens.shape[1] < int(np.max(np.asarray(lengths))):
            return k, v, key_norms, carry  # not the last chunk: defer
        h = hashlib.sha1(np.asarray(lengths).tobytes())
        for toks, s in pending[1:]:
            h.update(toks.tobytes() + str((toks.shape, s)).encode())
        key = (h.hexdigest(), k.shape, str(k.dtype), cfg)
        hit = store.get(key)
        wants_window = carry.window_q is not None
        if hit is not None and wants_window and (hit[3].window_q is None or
                                                 hit[3].window_q.shape != carry.window_q.shape):
            hit = None  # an SFI call needs the window queries a dense prefill did not keep
        if hit is not None:
            counts["hits"] += 1
            kk, vv, kn, out_carry = hit
            out_kn = jnp.copy(kn) if with_norms else pending[0][2]
            pending.clear()
            if not wants_window:
                out_carry = out_carry._replace(window_q=None)
            return jnp.copy(kk), jnp.copy(vv), out_kn, jax.tree.map(jnp.copy, out_carry)
        counts["misses"] += 1
        kk, vv, kn, out_carry = _replay(real, params, pending, lengths, cfg, kw)
        if len(store) >= max_entries:
            store.pop(next(iter(store)))
        store[key] = (jnp.copy(kk), jnp.copy(vv), jnp.copy(kn), jax.tree.map(jnp.copy, out_carry))
        out_kn = kn if with_norms else pending[0][2]
        pending.clear()
        return kk, vv, out_kn, out_carry

    try:
        yield SharedPrefill(cached, counts)
    finally:
        store.clear()
        pending.clear()
