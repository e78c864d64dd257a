"""Token sampling: greedy, temperature, top-k and top-p (nucleus), reproducible from a seed."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits, key, cfg: SamplingConfig):
    """logits float32 [B, V] -> int32 [B]."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / cfg.temperature
    if cfg.top_k:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = jnp.cumsum(probs, axis=-1) - probs < cfg.top_p
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _filter_rows(logits, top_k, top_p):
    """Per-row top-k then top-p (nucleus) masks, as `sample` applies them, with k and p as data:
    one descending sort of each row gives both thresholds."""
    V = logits.shape[-1]
    sorted_logits = -jnp.sort(-logits, axis=-1)
    rank = jnp.arange(V)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)[:, None]
    kth = jnp.take_along_axis(sorted_logits, k - 1, axis=-1)
    sorted_logits = jnp.where(rank < k, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]) & (rank < k)
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.where(top_p[:, None] < 1, jnp.maximum(threshold, kth), kth)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def sample_rows(logits, rows):
    """logits float32 [B, V] -> (int32 [B], the rows' next PRNG keys), each row with its own
    `RowControls` temperature (0 = argmax), top-k, top-p and key. The sort behind top-k/top-p
    runs only when some row asks for them."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    split = jax.vmap(jax.random.split)(rows.keys)
    keys, subs = split[:, 0], split[:, 1]

    def sampled(logits):
        t = jnp.where(rows.temperature > 0, rows.temperature, 1.0)
        scaled = logits / t[:, None]
        filtered = jax.lax.cond(jnp.any((rows.top_k > 0) | (rows.top_p < 1)), _filter_rows,
                                lambda x, *_: x, scaled, rows.top_k, rows.top_p)
        draw = jax.vmap(lambda key, row: jax.random.categorical(key, row))(subs, filtered)
        return jnp.where(rows.temperature > 0, draw.astype(jnp.int32), greedy)

    token = jax.lax.cond(jnp.any(rows.temperature > 0), sampled, lambda _: greedy, logits)
    return token, keys
