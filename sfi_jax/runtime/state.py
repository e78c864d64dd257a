"""Decode state: the head-major KV cache with per-row lengths, plus the static-shape SFI state."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sfi_jax.config import SFIConfig
from sfi_jax.models.config import ModelConfig


class SFIState(NamedTuple):
    """Per layer and KV head: compact sink+selected K/V, its valid count, the positions it holds,
    every cached key's L2 norm (kept incrementally), and per-row refresh bookkeeping."""

    ck: jax.Array  # [L, B, Hkv, C, D]
    cv: jax.Array  # [L, B, Hkv, C, D]
    c_len: jax.Array  # [L, B, Hkv] int32
    positions: jax.Array  # [L, B, Hkv, C] int32, -1 = empty slot
    key_norms: jax.Array  # [L, B, Hkv, S] float32
    since_slow: jax.Array  # [B] int32: steps since the row's last slow step
    pending: jax.Array  # [B] bool: the row wants a slow step
    slow_steps: jax.Array  # [B] int32
    fast_steps: jax.Array  # [B] int32
    # [L, B, Hkv, C] float32: the score each held position was selected with, less the
    # selection memory's decay since (-inf: a sink or an empty slot); None unless
    # SFIConfig.remembers
    scores: jax.Array | None = None


def refresh_interval(st: SFIState, sfi):
    """Each row's t_max now: SFIConfig.warmup_t_max during its first warmup_steps decode steps,
    t_max after (int32 [B], or the int t_max when there is no warm-up)."""
    if not sfi.warmup_steps or sfi.warmup_t_max >= sfi.t_max:
        return sfi.t_max
    return jnp.where(st.slow_steps + st.fast_steps < sfi.warmup_steps, sfi.warmup_t_max,
                     sfi.t_max).astype(jnp.int32)


def count_step(st: SFIState, *, refreshed, live, advanced, wants, fast, restart=0,
               t_max=None) -> SFIState:
    """The refresh bookkeeping after a decode step (or an exact-mode round) in which each row
    moved `advanced` positions on: a row in `refreshed` took its slow step (its count restarts
    at `restart`, its pending refresh is done), `wants` [B] joins the pending refreshes, and
    with `t_max` (an int or per row, `refresh_interval`) so does every row t_max steps past
    its slow step; live rows count their slow step and `fast` [B] fast steps."""
    since = jnp.where(refreshed, restart, st.since_slow + advanced)
    pending = (st.pending & ~refreshed) | wants
    if t_max is not None:
        pending = pending | (since >= t_max)
    return st._replace(since_slow=since, pending=pending,
                       slow_steps=st.slow_steps + (refreshed & live),
                       fast_steps=st.fast_steps + fast)


class RowControls(NamedTuple):
    """Per-row request parameters as data, so that a request's sampling and budget never
    compile a new program (the Engine's slots): each row samples with its own temperature,
    top-p, top-k and PRNG key and stops after `remaining` more tokens."""

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_p: jax.Array  # [B] float32 in (0, 1]
    top_k: jax.Array  # [B] int32, 0 = off
    keys: jax.Array  # [B] PRNG keys
    remaining: jax.Array  # [B] int32: tokens the row may still emit


def row_controls(batch: int) -> RowControls:
    """Controls for `batch` idle rows (greedy, no budget left)."""
    return RowControls(temperature=jnp.zeros((batch,), jnp.float32),
                       top_p=jnp.ones((batch,), jnp.float32),
                       top_k=jnp.zeros((batch,), jnp.int32),
                       keys=jax.random.split(jax.random.key(0), batch),
                       remaining=jnp.zeros((batch,), jnp.int32))


class DecodeState(NamedTuple):
    k: jax.Array  # [L, B, Hkv, S, D]
    v: jax.Array  # [L, B, Hkv, S, D]
    lengths: jax.Array  # [B] int32: tokens in the cache = position of the next token
    token: jax.Array  # [B] int32: the token the next step feeds
    done: jax.Array  # [B] bool
    step: jax.Array  # [] int32: decode steps taken
    key: jax.Array  # PRNG key
    sfi: SFIState | None
    diag: jax.Array | None = None  # [L, B, Hkv, S] bool: previous dense top-k support
    q_hist: jax.Array | None = None  # [L, B, Hq, W, D]: last W queries (evidence_window > 1)
    rows: RowControls | None = None  # per-row sampling and budgets (None: `sampling` for all)
    # [B] bool: the row's logits were NaN/inf at some step (the row then stops); None: unchecked
    nonfinite: jax.Array | None = None


def cache_dtype(dtype) -> jnp.dtype:
    """The KV cache's dtype for a model that computes in `dtype`: float32 for bfloat16 on a
    CPU, where XLA turns each bfloat16 scatter (the new token's write) into a float32 round
    trip of the whole cache (SmolLM2, 2 x 2048 positions: decode 5.7x slower). The values
    stored are the same (bfloat16 -> float32 is exact)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    return dtype


def empty_cache(cfg: ModelConfig, batch: int, max_len: int, dtype):
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def empty_sfi_state(cfg: ModelConfig, sfi: SFIConfig, batch: int, max_len: int, dtype) -> SFIState:
    L, Hkv, D, C = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, sfi.compact_size
    return SFIState(
        ck=jnp.zeros((L, batch, Hkv, C, D), dtype), cv=jnp.zeros((L, batch, Hkv, C, D), dtype),
        c_len=jnp.zeros((L, batch, Hkv), jnp.int32),
        positions=jnp.full((L, batch, Hkv, C), -1, jnp.int32),
        key_norms=jnp.zeros((L, batch, Hkv, max_len), jnp.float32),
        since_slow=jnp.zeros((batch,), jnp.int32), pending=jnp.ones((batch,), bool),
        slow_steps=jnp.zeros((batch,), jnp.int32), fast_steps=jnp.zeros((batch,), jnp.int32),
        scores=jnp.full((L, batch, Hkv, C), -jnp.inf, jnp.float32) if sfi.remembers else None)


def state_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype_bytes: int,
                sfi: SFIConfig | None) -> dict[str, int]:
    """Bytes of the KV cache and of the SFI state (for the memory check and the reports)."""
    kv = cfg.kv_cache_bytes(batch, max_len, dtype_bytes)
    out = {"kv_cache": kv}
    if sfi is not None:
        L, Hkv, D, C = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, sfi.compact_size
        out["sfi_compact"] = 2 * L * batch * Hkv * C * D * dtype_bytes
        out["sfi_positions"] = L * batch * Hkv * C * 4
        if sfi.remembers:
            out["sfi_held_scores"] = L * batch * Hkv * C * 4
        out["sfi_key_norms"] = L * batch * Hkv * max_len * 4
        if sfi.policy in ("sfi", "tmax"):  # the refreshed rows' logits, one step's worth
            slots = batch if sfi.refresh_rows is None else min(sfi.refresh_rows, batch)
            W = sfi.evidence_window
            out["sfi_slow_logits"] = L * slots * cfg.num_q_heads * W * max_len * 4
            if W > 1:
                out["sfi_query_history"] = L * batch * cfg.num_q_heads * W * D * dtype_bytes
    return out
