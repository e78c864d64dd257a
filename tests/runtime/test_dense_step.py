"""A dense decode step attends only its live rows: an ended row (an Engine slot parked at the
end of its cache while a prompt prefills into it) reads no key."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from conftest import rel_err
from sfi_jax.options import EngineOptions
from sfi_jax.runtime.decode import attend_dense


def _softmax_attention(q, k, v, n):
    """float64 attention of q [Hq, D] over the first n keys of k, v [Hkv, S, D] (GQA)."""
    G = q.shape[0] // k.shape[0]
    kk = np.repeat(k[:, :n], G, axis=0)
    vv = np.repeat(v[:, :n], G, axis=0)
    s = np.einsum("hd,hsd->hs", q, kk) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hs,hsd->hd", p / p.sum(-1, keepdims=True), vv)


def test_ended_rows_attend_to_nothing_and_live_rows_to_their_length():
    rng = np.random.default_rng(7)
    L, B, Hq, Hkv, S, D = 2, 3, 4, 2, 32, 16
    k = rng.standard_normal((L, B, Hkv, S, D)).astype(np.float32)
    v = rng.standard_normal((L, B, Hkv, S, D)).astype(np.float32)
    q = rng.standard_normal((B, Hq, D)).astype(np.float32)
    k_new = rng.standard_normal((B, Hkv, D)).astype(np.float32)
    v_new = rng.standard_normal((B, Hkv, D)).astype(np.float32)
    pos = np.array([9, S - 1, 20], np.int32)  # row 1 is parked at its cache's end
    live = np.array([True, False, True])
    options = EngineOptions(attention="xla").resolved()
    out = attend_dense(jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(k),
                       jnp.asarray(v), None, None, 1, jnp.asarray(pos), None, None, sfi=None,
                       options=options, live=jnp.asarray(live))
    k1, v1 = k[1].copy(), v[1].copy()
    for b in range(B):
        k1[b, :, pos[b]], v1[b, :, pos[b]] = k_new[b], v_new[b]
    np.testing.assert_array_equal(np.asarray(out.k[1]), k1)  # every row stores its key
    for b in np.flatnonzero(live):
        ref = _softmax_attention(q[b].astype(np.float64), k1[b], v1[b], pos[b] + 1)
        assert rel_err(out.attn[b], ref) < 1e-5
    np.testing.assert_array_equal(np.asarray(out.attn[1]), 0.0)
