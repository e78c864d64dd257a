"""Dense prefill, in chunks: each chunk of prompt positions runs through all layers and writes
the KV cache (and, for SFI, every key's L2 norm). The chunk size bounds the float32 attention
scores a chunk holds."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sfi_jax.models.config import ModelConfig
from sfi_jax.models.modeling import attention_inputs, attention_output_and_mlp, embed_tokens, run_layers
from sfi_jax.runtime import mesh


def prefill_chunk_size(cfg: ModelConfig, batch: int, max_len: int, longest_prompt: int,
                       budget_bytes: int = 1 << 30) -> int:
    """Largest power-of-2 chunk (16..1024) whose float32 attention scores fit `budget_bytes`."""
    chunk = 1024
    while chunk > 16 and batch * cfg.num_q_heads * chunk * max_len * 4 > budget_bytes:
        chunk //= 2
    while chunk > 16 and chunk // 2 >= longest_prompt:
        chunk //= 2
    return chunk


def cache_attention(q, k_cache, v_cache, q_pos, kv_len):
    """Attention of queries at positions q_pos [B, T] over cache [B, Hkv, S, D] positions
    <= q_pos and < kv_len[b]. Returns out [B, T, Hq, D] and f32 logits [B, Hkv, G, T, S]."""
    B, T, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    s = s / np.sqrt(D)
    pos = jnp.arange(S)
    mask = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] < kv_len[:, None, None])
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("bkgts,bksd->btkgd", p.astype(v_cache.dtype), v_cache,
                     preferred_element_type=jnp.float32)
    return out.reshape(B, T, Hq, D).astype(q.dtype), s


def _write_rows(cache, layer, new, start):
    """cache [L, B, Hkv, S, D] <- new [B, T, Hkv, D] at positions start[b] + t (in place)."""
    new = jnp.swapaxes(new, 1, 2).astype(cache.dtype)  # [B, Hkv, T, D]
    upd = jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=1))
    return cache.at[layer].set(upd(cache[layer], new, start))


@functools.partial(jax.jit, static_argnames=("cfg", "with_norms", "plan"),
                   donate_argnames=("k", "v", "key_norms"))
def prefill_chunk(params, k, v, key_norms, tokens, start, lengths, last_hidden, *,
                  cfg: ModelConfig, with_norms: bool, plan=None):
    """Run tokens [B, C] at positions start + [0, C) through all layers, writing the cache.

    Rows are right-padded: positions >= lengths[b] are written but never attended later
    (decode overwrites them). Returns the residual at each row's last prompt position.
    On a mesh (plan), the cache keeps its row/head split (GSPMD partitions the rest).
    """
    B, C = tokens.shape
    pos = start + jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
    starts = jnp.full((B,), start, jnp.int32)

    def layer(carry, xs):
        x, k, v, kn = carry
        w, l = xs
        q, kk, vv = attention_inputs(w, cfg, x, pos)
        k = _write_rows(k, l, kk, starts)
        v = _write_rows(v, l, vv, starts)
        if with_norms:
            norms = jnp.linalg.norm(kk.astype(jnp.float32), axis=-1)  # [B, C, Hkv]
            kn = kn.at[l].set(jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(
                c, n, s, axis=1))(kn[l], jnp.swapaxes(norms, 1, 2), starts))
        attn, _ = cache_attention(q, k[l], v[l], pos, pos[:, -1] + 1)
        return (attention_output_and_mlp(w, cfg, x, attn), k, v, kn), None

    x = embed_tokens(params, tokens)
    (x, k, v, key_norms), _ = run_layers(layer, (x, k, v, key_norms), params["layers"],
                                         cfg.num_layers)
    last = jnp.clip(lengths - 1 - start, 0, C - 1)
    here = (lengths - 1 >= start) & (lengths - 1 < start + C)
    picked = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    if plan is not None:
        k, v = mesh.constrain((k, v), (mesh.cache_sharding(plan),) * 2)
        if with_norms:
            key_norms = mesh.constrain(key_norms, mesh.sfi_state_shardings(plan).key_norms)
    return k, v, key_norms, jnp.where(here[:, None], picked, last_hidden)
