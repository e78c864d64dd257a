"""Metrics that compare a sparse decode with the dense one on the same (teacher-forced) tokens,
and answer scoring for the retrieval tasks."""

from __future__ import annotations

import numpy as np

from sfi_jax.eval.tasks import extract_answers


def _log_softmax(logits):
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kl_divergence(p_logits, q_logits):
    """KL(p || q) in nats over the last axis, from logits; shape of the leading axes."""
    lp, lq = _log_softmax(p_logits), _log_softmax(q_logits)
    return np.maximum((np.exp(lp) * (lp - lq)).sum(axis=-1), 0.0)


def top1_agreement(p_logits, q_logits):
    """True where both logits rank the same token first."""
    return np.argmax(p_logits, axis=-1) == np.argmax(q_logits, axis=-1)


def log_loss(logits, targets):
    """-log p(target) in nats; logits [..., V], targets [...] int."""
    lp = _log_softmax(logits)
    return -np.take_along_axis(lp, np.asarray(targets)[..., None], axis=-1)[..., 0]


def since_last_slow(slow):
    """Steps since the last slow step, per decode step (0 at a slow step); bool [B, T] -> int
    [B, T]. Steps before any slow step count from the start (as if step -1 were slow)."""
    slow = np.asarray(slow, bool)
    B, T = slow.shape
    out = np.zeros((B, T), np.int64)
    last = np.full((B,), -1)
    for t in range(T):
        last = np.where(slow[:, t], t, last)
        out[:, t] = t - last
    return out


def teacher_forced_metrics(dense_logits, sparse_logits, targets, slow):
    """Per-token metrics of a teacher-forced continuation.

    dense_logits, sparse_logits: [B, N, V], the logits that produced tokens 0..N-1 (token 0 comes
    from the prefill, identical in both, and is dropped); targets [B, N] the true tokens; slow
    [B, N-1] the slow flags of decode steps 0..N-2 (step i produces token i+1). Returns a dict of
    [B, N-1] arrays: kl, top1, dloss (sparse log-loss minus dense), dense_loss, since (steps since
    the last slow step) and slow.
    """
    d, s = dense_logits[:, 1:], sparse_logits[:, 1:]
    t = np.asarray(targets)[:, 1:]
    dl, sl = log_loss(d, t), log_loss(s, t)
    slow = np.asarray(slow, bool)[:, :d.shape[1]]
    return {"kl": kl_divergence(d, s), "top1": top1_agreement(d, s), "dloss": sl - dl,
            "dense_loss": dl, "since": since_last_slow(slow), "slow": slow}


def answer_correct(task: str, answers, generated_text: str) -> tuple[bool, float]:
    """(all answers found, share of answers found) in the generated answer text.

    Single-answer tasks take the first number generated (a wrong number followed by the right
    one is wrong); multi-answer tasks need every expected value among what was generated.
    """
    found = extract_answers(task, generated_text)
    if len(answers) == 1:
        ok = bool(found) and found[0] == answers[0]
        return ok, float(ok)
    hit = sum(a in found for a in answers)
    return hit == len(answers), hit / len(answers)


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % by default): unlike the normal
    approximation it stays inside [0, 1] and is not empty at 0 or n successes."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got successes={successes}, n={n}")
    p = successes / n
    denom = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, mid - half), min(1.0, mid + half)
