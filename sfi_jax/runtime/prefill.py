"""Dense prefill in chunks of tokens: each chunk of prompt positions runs through all layers,
writes the KV cache (and, for SFI, every key's L2 norm) and attends by the prefill attention
kernels (`kernels.prefill_attention`: the chunk over the filled prefix and causally over
itself, no materialised scores). For SFI it also keeps each layer's queries of each row's last
W prompt positions, from which `selection.prefill_selection` makes the initial selection.

Lengths are bucketed so that a new prompt length reuses compiled programs: a padded prompt of
n tokens takes `bucket(n)` positions (powers of two from 256 up to the chunk size, then
multiples of the chunk size); the chunk program takes its start position as a traced scalar,
so every chunk of every prompt runs one program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sfi_jax.kernels.prefill_attention import XLA_BLOCK_K, XLA_BLOCK_Q, prefill_attention
from sfi_jax.kernels.common import gpu_fallback
from sfi_jax.kernels.prefill_attention_cudnn import supported as cudnn_supported
from sfi_jax.models.config import ModelConfig
from sfi_jax.models.modeling import (WeightLayout, attention_inputs, attention_output_and_mlp,
                                     embed_tokens, output_logits, run_layers)
from sfi_jax.options import EngineOptions, platform
from sfi_jax.runtime import mesh, programs

MAX_CHUNK = 8192  # tokens per prefill chunk (default)
MIN_BUCKET = 256


def check_max_chunk(max_chunk) -> int:
    if isinstance(max_chunk, bool) or not isinstance(max_chunk, int) or max_chunk < 16 \
            or max_chunk & (max_chunk - 1):
        raise ValueError(f"prefill_chunk={max_chunk!r}: expected a power of two >= 16")
    return max_chunk


def bucket(n: int, max_chunk: int = MAX_CHUNK) -> int:
    """The padded length for n positions: the smallest power of two >= n from
    min(256, max_chunk) up to max_chunk, above that the smallest multiple of max_chunk."""
    if n > max_chunk:
        return -(-n // max_chunk) * max_chunk
    b = min(MIN_BUCKET, max_chunk)
    while b < n:
        b *= 2
    return b


def prefill_chunk_size(padded_prompt: int, max_chunk: int = MAX_CHUNK) -> int:
    """Tokens per chunk: the whole (bucketed) prompt when it fits in max_chunk."""
    return min(padded_prompt, max_chunk)


def activation_bytes(cfg: ModelConfig, batch: int, chunk: int, max_len: int, dtype_bytes: int,
                     window: int = 0) -> dict[str, int]:
    """An estimate of the prefill's working memory beside the cache (the largest live values
    of one layer of one chunk, the last position's logits, and for SFI the window queries and
    one layer's window logits for the initial selection)."""
    n, db = batch * chunk, dtype_bytes
    hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    out = {
        "prefill_hidden": n * cfg.hidden_size * (3 * db + 4),
        "prefill_qkv": n * (hq + 2 * hkv) * d * (db + 4) + n * hkv * 4,
        "prefill_attention": n * hq * d * (db + 4) + batch * hq * min(chunk, XLA_BLOCK_Q)
        * min(max_len, XLA_BLOCK_K) * 12,  # the blockwise path's f32 scores of a block
        "prefill_logits": batch * cfg.vocab_size * 4,
    }
    if cfg.is_moe:
        k = cfg.num_experts_per_tok
        out["prefill_mlp"] = n * k * (cfg.hidden_size * db + cfg.moe_intermediate_size
                                      * (3 * db + 4)) + n * cfg.num_experts * 8
    else:
        out["prefill_mlp"] = n * cfg.intermediate_size * (3 * db + 4)
    if window:
        out["prefill_window_queries"] = cfg.num_layers * batch * window * hq * d * db
        out["prefill_selection_logits"] = 3 * batch * hq * window * max_len * 4
    return out


class PrefillCarry(NamedTuple):
    """What a chunk hands the next: each row's residual at its last prompt position, and (SFI)
    each layer's post-RoPE queries of the row's last W prompt positions (zeros where the
    prompt is shorter than W)."""

    last_hidden: jax.Array  # [B, H]
    window_q: jax.Array | None  # [L, B, W, Hq, D]


def empty_carry(cfg: ModelConfig, batch: int, window: int, dtype) -> PrefillCarry:
    wq = jnp.zeros((cfg.num_layers, batch, window, cfg.num_q_heads, cfg.head_dim), dtype) \
        if window else None
    return PrefillCarry(jnp.zeros((batch, cfg.hidden_size), dtype), wq)


def attention_impl(options: EngineOptions, dtype, head_dim: int, group: int = 1,
                   cache_len: int = MIN_BUCKET) -> str:
    """The prefill attention implementation a chunk uses: the resolved option (on a mesh
    "xla": `EngineOptions.resolved(mesh=...)`), except "cudnn" for inputs cuDNN does not take
    or off a GPU (then the Triton kernel, in interpret mode off a GPU, as the GPU defaults are
    tested on a CPU), and "mosaic_gpu" for inputs its kernel does not take (then the "cudnn"
    choice; off a GPU the Mosaic kernel runs in interpret mode)."""
    impl = options.prefill_attention
    if impl == "cudnn":
        probe = jax.ShapeDtypeStruct((1, 1, 1, head_dim), dtype)
        if platform() != "gpu" or not cudnn_supported(probe, probe):
            return gpu_fallback()
    if impl == "mosaic_gpu":
        from sfi_jax.kernels import prefill_attention_mgpu

        q = jax.ShapeDtypeStruct((1, 1, group, head_dim), dtype)
        k = jax.ShapeDtypeStruct((1, 1, cache_len, head_dim), dtype)
        if not prefill_attention_mgpu.supported(q, k):
            return attention_impl(dataclasses.replace(options, prefill_attention="cudnn"),
                                  dtype, head_dim, group, cache_len)
    return impl


def _write_rows(cache, layer, new, start, row):
    """cache [L, R, Hkv, S, ...] <- new [B, T, Hkv, ...] at positions start + t of rows
    row .. row + B - 1: one in-place update of the chunk's slab (no copy of the layer)."""
    new = jnp.swapaxes(new, 1, 2).astype(cache.dtype)[None]  # [1, B, Hkv, T, ...]
    at = (layer, row, 0, start) + (0,) * (cache.ndim - 4)
    return jax.lax.dynamic_update_slice(cache, new, at)


@functools.partial(jax.jit, static_argnames=("cfg", "with_norms", "impl", "plan"),
                   donate_argnames=("k", "v", "key_norms"))
def _chunk(params, k, v, key_norms, tokens, start, lengths, carry: PrefillCarry, row=None, *,
           cfg: ModelConfig, with_norms: bool, impl: str, plan=None):
    B, C = tokens.shape
    at_row = jnp.int32(0) if row is None else row
    layout = WeightLayout.of(params["layers"])  # (the structure of a static argument)
    start = start.astype(jnp.int32)
    pos = start + jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
    starts = jnp.full((B,), start, jnp.int32)
    # padding queries (positions >= lengths[b]) see the row's prompt: finite, never used
    kv_len = jnp.minimum(lengths, start + C)
    W = 0 if carry.window_q is None else carry.window_q.shape[2]
    rel = lengths[:, None] - W + jnp.arange(W, dtype=jnp.int32)[None, :] - start  # [B, W]
    in_chunk = (rel >= 0) & (rel < C) & (rel + start >= 0)

    def layer(c, xs):
        x, k, v, kn, wq = c
        w, l = xs
        q, k_new, v_new = attention_inputs(w, cfg, x, pos, layout=layout)
        k = _write_rows(k, l, k_new, start, at_row)
        v = _write_rows(v, l, v_new, start, at_row)
        if with_norms:
            kn = _write_rows(kn, l, jnp.linalg.norm(k_new.astype(jnp.float32), axis=-1), start,
                             at_row)
        attn = prefill_attention(q, k, v, starts, kv_len, layer=l, row=row, impl=impl)
        if W:
            picked = jnp.take_along_axis(q, jnp.clip(rel, 0, C - 1)[:, :, None, None], axis=1)
            wq = wq.at[l].set(jnp.where(in_chunk[:, :, None, None], picked.astype(wq.dtype),
                                        wq[l]))
        return (attention_output_and_mlp(w, cfg, x, attn, layout=layout), k, v, kn, wq), None

    x = embed_tokens(params, tokens)
    (x, k, v, key_norms, wq), _ = run_layers(layer, (x, k, v, key_norms, carry.window_q),
                                             params["layers"], layout, cfg.num_layers)
    last = jnp.clip(lengths - 1 - start, 0, C - 1)
    here = (lengths - 1 >= start) & (lengths - 1 < start + C)
    picked = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    if plan is not None:
        k, v = mesh.constrain((k, v), (mesh.cache_sharding(plan),) * 2)
        if with_norms:
            key_norms = mesh.constrain(key_norms, mesh.sfi_state_shardings(plan).key_norms)
    return k, v, key_norms, PrefillCarry(jnp.where(here[:, None], picked, carry.last_hidden), wq)


def _chunk_call(params, k, v, key_norms, tokens, start, lengths, carry, row, cfg, with_norms,
                options, plan):
    options = options or EngineOptions()
    if not options.is_resolved:  # (a request path passes them resolved)
        options = options.resolved(mesh=None if plan is None else plan.mesh)
    impl = attention_impl(options, k.dtype, cfg.head_dim,
                          cfg.num_q_heads // cfg.num_kv_heads, k.shape[-2])
    if row is not None and plan is not None:
        raise ValueError("row= (a slot's row of a larger cache) runs on one device, not a mesh")
    args = (params, k, v, key_norms, tokens, start, lengths, carry, row)
    return args, dict(cfg=cfg, with_norms=with_norms, impl=impl, plan=plan)


def compile_chunk(params, k, v, key_norms, tokens, start, lengths, carry, *, cfg: ModelConfig,
                  with_norms: bool, options: EngineOptions | None = None, plan=None,
                  row=None) -> float:
    """Compile the chunk program for these arguments ahead of time (nothing runs); returns
    the seconds spent compiling (0.0 when it was compiled before)."""
    args, statics = _chunk_call(params, k, v, key_norms, tokens, start, lengths, carry, row, cfg,
                                with_norms, options, plan)
    return programs.compiled(_chunk, args, statics)[1]


def prefill_chunk(params, k, v, key_norms, tokens, start, lengths, carry: PrefillCarry, *,
                  cfg: ModelConfig, with_norms: bool, options: EngineOptions | None = None,
                  plan=None, row=None):
    """Run tokens [B, C] at positions start + [0, C) through all layers, writing the cache
    (k, v, key_norms are donated). start: an int32 device scalar (one program for every
    chunk). Needs start + C <= the cache length. row (an int32 device scalar, one device):
    the tokens' rows are rows row .. row + B - 1 of a cache with more rows (the Engine
    prefills a request into its slot's row of the slots' cache, not into a cache of its own);
    None: the cache has the tokens' B rows.

    Rows are right-padded: positions >= lengths[b] are written but never attended later
    (decode overwrites them). Returns k, v, key_norms and the next `PrefillCarry`.
    On a mesh (plan), the cache keeps its row/head split (GSPMD partitions the rest).
    """
    args, statics = _chunk_call(params, k, v, key_norms, tokens, start, lengths, carry, row, cfg,
                                with_norms, options, plan)
    return programs.compiled(_chunk, args, statics)[0](*args)


@functools.partial(jax.jit, static_argnames=("cfg",))
def first_logits(params, last_hidden, *, cfg: ModelConfig):
    """float32 logits [B, vocab] of each row's last prompt position."""
    return output_logits(params, cfg, last_hidden[:, None])[:, 0]
