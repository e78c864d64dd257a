"""The selector's scores (SFI_METHOD.md §4 steps 1-6) and the radix search for a k-th largest
key, in jnp: the references of the kernels in `selector_gpu`, and the path used off the GPU.

Shapes: logits [B, Hkv, R, S], key_norms [B, Hkv, S], allowed range J = [lo[b], hi[b]) per
batch row. Everything outside J is masked to -inf (scores) or 0 (probabilities), so empty and
one-element ranges give no NaN.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

NEG_INF = float("-inf")


class ScoreParams(NamedTuple):
    """The numbers the selector's scores use (SFI_METHOD.md §4; `SFIConfig` holds them with
    their defaults and checks, `selector.score_params` takes them from it). Hashable: the jitted
    kernels take it as a static argument."""

    power_alpha: float
    lam_clip: float
    alpha_soft: float
    alpha_cross: float
    cross_temp: float
    nms_radius: int
    gamma: float
    beta: float
    p: float
    eta: float
    eps: float
    successor_radius: int = 0


def allowed_mask(size: int, lo, hi):
    """Bool [B, S]: position s of row b lies in [lo[b], hi[b])."""
    pos = jnp.arange(size, dtype=jnp.int32)
    lo = jnp.asarray(lo, jnp.int32)[:, None]
    hi = jnp.asarray(hi, jnp.int32)[:, None]
    return (pos >= lo) & (pos < hi)


def _masked_softmax(x, mask, axis=-1):
    """Softmax over the masked entries; all-masked slices give zeros instead of NaN."""
    x = jnp.where(mask, x, NEG_INF)
    mx = jnp.max(x, axis=axis, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    e = jnp.exp(x - mx)
    total = jnp.sum(e, axis=axis, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def evidence(logits, in_j, power_alpha: float):
    """f(j): per-row softmax over J, power mean over the R rows, renormalised. [B, H, S].

    Done in the log domain (mu^(1/a) is renormalised through a max-shifted softmax), so tiny
    probabilities at 128K positions do not underflow to ties.
    """
    mask = in_j[:, None, None, :]
    x = jnp.where(mask, logits.astype(jnp.float32), NEG_INF)
    mx = jnp.max(x, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    total = jnp.sum(jnp.exp(x - mx), axis=-1, keepdims=True)
    log_total = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)), 0.0)
    logp = x - mx - log_total  # -inf outside J and where a row masks a position
    mu = jnp.sum(jnp.exp(power_alpha * logp), axis=2)  # the 1/R factor cancels below
    g = jnp.log(mu) / power_alpha
    return _masked_softmax(g, in_j[:, None, :] & (mu > 0))


def prior(key_norms, lo, hi, in_j, params: ScoreParams):
    """r(j): key-norm prior times position prior, normalised over J. [B, H, S]."""
    eps = params.eps
    size = key_norms.shape[-1]
    pos = jnp.arange(size, dtype=jnp.float32)[None, :]
    lo_f = jnp.asarray(lo, jnp.float32)[:, None]
    last = jnp.asarray(hi, jnp.float32)[:, None] - 1.0
    span = jnp.maximum(last - lo_f, 0.0) + eps
    u = jnp.where(in_j, (pos - lo_f) / span, 0.0)
    # 1 - u written as (max J - j + eps) / span keeps the newest position's eps^eta exact.
    one_minus_u = jnp.where(in_j, (last - pos + eps) / span, 1.0)
    pi_pos = jnp.exp(-params.beta * u**params.p) * (one_minus_u + eps) ** params.eta
    pi_kn = (key_norms.astype(jnp.float32) + eps) ** (-params.gamma)
    pi = jnp.where(in_j[:, None, :], pi_kn * pi_pos[:, None, :], 0.0)
    total = jnp.sum(pi, axis=-1, keepdims=True)
    return pi / jnp.where(total > 0, total, 1.0)


def fusion_lambda(f, r, lam_clip: float):
    """lam = clip((f.f - f.r) / |f - r|^2, 0, lam_clip), 0 when the denominator is 0. [B, H, 1]."""
    d = f - r
    den = jnp.sum(d * d, axis=-1, keepdims=True)
    num = jnp.sum(f * d, axis=-1, keepdims=True)
    lam = jnp.clip(num / jnp.where(den > 0, den, 1.0), 0.0, lam_clip)
    return jnp.where(den > 0, lam, 0.0)


def window_max(x, radius: int):
    """Max over |i - j| <= radius along the last axis (-inf padding), by doubling windows:
    log2(2r+1) elementwise passes instead of 2r+1."""
    if radius == 0:
        return x
    width = 2 * radius + 1
    size = x.shape[-1]
    pad = [(0, 0)] * (x.ndim - 1)
    xp = jnp.pad(x, pad + [(radius, radius)], constant_values=NEG_INF)
    t, w = xp, 1
    while 2 * w <= width:  # t[i] = max xp[i : i + w]
        shifted = jnp.pad(t[..., w:], pad + [(0, w)], constant_values=NEG_INF)
        t = jnp.maximum(t, shifted)
        w *= 2
    return jnp.maximum(t[..., :size], t[..., width - w : width - w + size])


def soft_nms(z, in_j, radius: int, alpha_soft: float):
    """z - alpha_soft * (m - z) with m the local max over |i - j| <= radius inside J."""
    if alpha_soft == 0.0 or radius == 0:
        return z
    m = window_max(z, radius)
    return jnp.where(in_j[:, None, :], z - alpha_soft * jnp.maximum(m - z, 0.0), NEG_INF)


def _reduce(x, op: str, cross_head_reduce):
    """Finish a per-device reduction over heads: nothing, a collective over an axis name, or a
    user callable fn(x, op) with op in {"max", "sum"}."""
    if cross_head_reduce is None:
        return x
    if callable(cross_head_reduce):
        return cross_head_reduce(x, op)
    return lax.pmax(x, cross_head_reduce) if op == "max" else lax.psum(x, cross_head_reduce)


def cross_head(z, in_j, params: ScoreParams, cross_head_reduce=None):
    """z + alpha_cross * log(max(q, eps)), q = softmax over all KV heads of z / T."""
    if params.alpha_cross == 0.0:
        return z
    y = z / params.cross_temp
    mx = _reduce(jnp.max(y, axis=1, keepdims=True), "max", cross_head_reduce)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    total = _reduce(jnp.sum(jnp.exp(y - mx), axis=1, keepdims=True), "sum", cross_head_reduce)
    log_total = jnp.log(jnp.where(total > 0, total, 1.0))
    log_q = jnp.maximum(y - mx - log_total, math.log(params.eps))
    return jnp.where(in_j[:, None, :], z + params.alpha_cross * log_q, NEG_INF)


SUCCESSOR_PENALTY = 1e-3


def successor_spread(z, in_j, radius: int, penalty: float = SUCCESSOR_PENALTY):
    """max(z[j], z[j - s] - s * penalty for s = 1..radius) inside J: successors of a strong
    position rank just below it (an extension; SFIConfig.successor_radius)."""
    out = z
    for s in range(1, radius + 1):
        pad = [(0, 0)] * (z.ndim - 1) + [(s, 0)]
        shifted = jnp.pad(z[..., :-s], pad, constant_values=NEG_INF) - s * penalty
        out = jnp.maximum(out, shifted)
    return jnp.where(in_j[:, None, :], out, NEG_INF)


def clipped_range(size, lo, hi):
    return (jnp.clip(jnp.asarray(lo, jnp.int32), 0, size),
            jnp.clip(jnp.asarray(hi, jnp.int32), 0, size))


# ------------------------------------------------ shared by the scores kernels (selector_gpu,
# selector_mgpu): the prior's per-position terms and the merges of their chunk partials

def prior_terms(kn, pos, inj, lo, hi, c: ScoreParams):
    """pi_kn * pi_pos (unnormalised) at positions pos (int) with key norms kn, 0 outside J
    (inj); lo, hi: J's int bounds (scalars)."""
    lo_f, last = lo.astype(jnp.float32), hi.astype(jnp.float32) - 1.0
    span = jnp.maximum(last - lo_f, 0.0) + c.eps
    posf = pos.astype(jnp.float32)
    u = jnp.where(inj, (posf - lo_f) / span, 0.0)
    omu = jnp.where(inj, (last - posf + c.eps) / span, 1.0)
    u_p = jnp.where(u > 0, jnp.exp(c.p * jnp.log(jnp.where(u > 0, u, 1.0))), 0.0)
    pi_pos = jnp.exp(-c.beta * u_p) * jnp.exp(c.eta * jnp.log(omu + c.eps))
    pi_kn = jnp.exp(-c.gamma * jnp.log(jnp.where(inj, kn.astype(jnp.float32), 1.0) + c.eps))
    return jnp.where(inj, pi_kn * pi_pos, 0.0)


def merge_chunk_lse(m, l):
    """Per-row log-sum-exp [N, H, rp] from chunk partials [N, H, C, rp]; +inf for rows with no
    mass in J (their p_r^a is then zero)."""
    mx = jnp.max(m, axis=2)
    total = jnp.sum(l * jnp.exp(m - mx[:, :, None]), axis=2)
    return jnp.where(total > 0, mx + jnp.log(jnp.where(total > 0, total, 1.0)), jnp.inf)


def merge_chunk_fusion(stats, lam_clip):
    """(max g, 1 / evidence normaliser, 1 / prior normaliser, lambda) [N, H, 4] from chunk
    partials [N, H, C, 8]; lambda = (f.f - f.r) / |f - r|^2, clipped, 0 when that is 0."""
    gm_c, s1, s2, s3, p1, p2 = (stats[..., k] for k in range(6))
    gm = jnp.max(gm_c, axis=2)
    sc = jnp.exp(gm_c - gm[:, :, None])
    s1, s2, s3 = (jnp.sum(v * w, axis=2) for v, w in ((s1, sc), (s2, sc * sc), (s3, sc)))
    p1, p2 = jnp.sum(p1, axis=2), jnp.sum(p2, axis=2)
    inv_s1 = jnp.where(s1 > 0, 1.0 / jnp.where(s1 > 0, s1, 1.0), 0.0)
    inv_p1 = jnp.where(p1 > 0, 1.0 / jnp.where(p1 > 0, p1, 1.0), 0.0)
    ff, fr, rr = s2 * inv_s1 * inv_s1, s3 * inv_s1 * inv_p1, p2 * inv_p1 * inv_p1
    den, num = ff - 2.0 * fr + rr, ff - fr
    lam = jnp.where(den > 0, jnp.clip(num / jnp.where(den > 0, den, 1.0), 0.0, lam_clip), 0.0)
    if lam_clip == 0.0:
        lam = jnp.zeros_like(lam)
    return jnp.stack([gm, inv_s1, inv_p1, lam], axis=-1)


def base_scores(logits, key_norms, allowed_lo, allowed_hi, params: ScoreParams):
    """z = log(s + eps) of SFI_METHOD.md §4 steps 1-4, [B, H, S] float32, -inf outside J
    (lo, hi already clipped to [0, S]); the jnp reference of `selector_gpu.base_scores`."""
    in_j = allowed_mask(logits.shape[-1], allowed_lo, allowed_hi)
    f = evidence(logits, in_j, params.power_alpha)
    if params.lam_clip > 0.0:
        r = prior(key_norms, allowed_lo, allowed_hi, in_j, params)
        lam = fusion_lambda(f, r, params.lam_clip)
        s = (1.0 - lam) * f + lam * r
    else:
        s = f
    return jnp.where(in_j[:, None, :], jnp.log(s + params.eps), NEG_INF)


def adjust_scores(z, allowed_lo, allowed_hi, params: ScoreParams, cross_head_reduce=None):
    """Steps 5-6 (soft-NMS, cross-head exclusivity) and the successor spread on z [B, H, S]."""
    in_j = allowed_mask(z.shape[-1], allowed_lo, allowed_hi)
    z = soft_nms(z, in_j, params.nms_radius, params.alpha_soft)
    z = cross_head(z, in_j, params, cross_head_reduce)
    if params.successor_radius > 0:
        z = successor_spread(z, in_j, params.successor_radius)
    return z


def kth_largest_key(keys, k: int, radix_bits: int):
    """Exact k-th largest key per row: a radix search fixing radix_bits per round, each round
    one fused count of keys >= each candidate digit (no sort, no histogram scatter)."""
    prefix = jnp.zeros(keys.shape[:-1], jnp.uint32)
    digits = jnp.arange(1, 2**radix_bits, dtype=jnp.uint32)
    for shift in range(32 - radix_bits, -1, -radix_bits):
        cand = prefix[..., None] + (digits << shift)  # count(keys >= prefix) >= k holds throughout
        counts = jnp.sum(keys[..., None, :] >= cand[..., :, None], axis=-1, dtype=jnp.int32)
        prefix = prefix + (jnp.sum(counts >= k, axis=-1, dtype=jnp.uint32) << shift)
    return prefix
