"""Quality diagnostics of a decode step (generate(..., diagnostics=True)): how much of the dense
attention mass the attended set covers, and how stable the dense top-k support is."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sfi_jax.kernels import attention_reference as reference


def attention_diagnostics(q, k_layer, lengths, st_layer_pos, fast_rows, recent_start, prev, k_support):
    """Per KV head: the dense attention mass the step's attended set covers, and the Jaccard
    overlap of the dense top-k support with the previous step's (for quality evaluation)."""
    B, Hq, _ = q.shape
    Hkv, S = k_layer.shape[1], k_layer.shape[2]
    _, logits, lse = reference.dense_decode(q, k_layer, k_layer, lengths, return_logits=True)
    p = jnp.exp(logits - lse[..., None]).reshape(B, Hkv, Hq // Hkv, S)
    pos = jnp.arange(S)
    in_set = jnp.zeros((B, Hkv, S + 1), bool)
    in_set = in_set.at[jnp.arange(B)[:, None, None], jnp.arange(Hkv)[None, :, None],
                       jnp.where(st_layer_pos >= 0, st_layer_pos, S)].set(True)[..., :S]
    in_set = in_set | ((pos >= recent_start[:, None]) & (pos < lengths[:, None]))[:, None]
    covered = jnp.sum(jnp.where(in_set[:, :, None], p, 0.0), axis=-1).mean(axis=-1)
    coverage = jnp.where(fast_rows[:, None], covered, 1.0)
    mass = p.mean(axis=2)  # [B, Hkv, S]
    kk = min(k_support, S)
    top = jax.lax.top_k(mass, kk)[1]
    support = jnp.zeros((B, Hkv, S), bool).at[jnp.arange(B)[:, None, None],
                                              jnp.arange(Hkv)[None, :, None], top].set(True)
    support = support & (pos < lengths[:, None])[:, None]
    inter = jnp.sum(support & prev, axis=-1)
    union = jnp.sum(support | prev, axis=-1)
    has_prev = jnp.any(prev, axis=-1)
    jaccard = jnp.where(has_prev & (union > 0), inter / jnp.maximum(union, 1), jnp.nan)
    return coverage, jaccard.astype(jnp.float32), support
