"""Reuse one prefill across many `generate` calls on the same prompts.

An evaluation decodes the same prompts under a dozen policies and budgets; the dense prefill is
identical for all of them and dominates the cost on a CPU. Inside `shared_prefill()`, the chunk
calls `generate` makes to `engine.prefill_chunk` are recorded; at the last chunk the whole
prompt batch is looked up, and a cached result (copied, since decode donates the cache) is
returned; otherwise the recorded chunks are run for real. The decode path is untouched.
"""

from __future__ import annotations

import contextlib
import hashlib

import jax.numpy as jnp
import numpy as np

from sfi_jax.runtime import engine


@contextlib.contextmanager
def shared_prefill(max_entries: int = 2):
    """Context manager; yields a dict with hit/miss counters.

    Key norms are always computed (an SFI call needs them; a dense call just does not get them),
    so one prefill serves both modes.
    """
    real = engine.prefill_chunk
    store: dict = {}
    pending: list = []
    counts = {"hits": 0, "misses": 0}

    def cached(params, k, v, key_norms, tokens, start, lengths, last_hidden, *, cfg, with_norms,
               **kw):
        start = int(start)
        if start == 0:
            pending.clear()
            pending.append((k, v, key_norms, last_hidden))
        pending.append((np.asarray(tokens), start))
        if start + tokens.shape[1] < int(np.max(np.asarray(lengths))):
            return k, v, key_norms, last_hidden  # not the last chunk: defer
        h = hashlib.sha1(np.asarray(lengths).tobytes())
        for toks, s in pending[1:]:
            h.update(toks.tobytes() + str((toks.shape, s)).encode())
        key = (h.hexdigest(), k.shape, str(k.dtype), cfg)
        hit = store.get(key)
        if hit is not None:
            counts["hits"] += 1
            kk, vv, kn, lh = hit
            out_kn = jnp.copy(kn) if with_norms else pending[0][2]
            pending.clear()
            return jnp.copy(kk), jnp.copy(vv), out_kn, lh
        counts["misses"] += 1
        kk, vv, kn, lh = pending[0]
        if not with_norms:
            L, B, Hkv, S = kk.shape[:4]
            kn = jnp.zeros((L, B, Hkv, S), jnp.float32)
        for toks, s in pending[1:]:
            kk, vv, kn, lh = real(params, kk, vv, kn, jnp.asarray(toks), jnp.int32(s), lengths,
                                  lh, cfg=cfg, with_norms=True, **kw)
        if len(store) >= max_entries:
            store.pop(next(iter(store)))
        store[key] = (jnp.copy(kk), jnp.copy(vv), jnp.copy(kn), lh)
        out_kn = kn if with_norms else pending[0][2]
        pending.clear()
        return kk, vv, out_kn, lh

    engine.prefill_chunk = cached
    try:
        yield counts
    finally:
        engine.prefill_chunk = real
