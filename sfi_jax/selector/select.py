"""The SFI selector (SFI_METHOD.md §4), vectorised over batch, KV heads and positions.

Shapes: logits [B, Hkv, R, S], key_norms [B, Hkv, S], allowed range J = [lo[b], hi[b]) per
batch row. Everything outside J is masked to -inf (scores) or 0 (probabilities), so empty and
one-element ranges give no NaN. `selector_scores` and `topk_positions` are the two halves of
`select`, kept separate so they can be tested and profiled on their own.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from sfi_jax.config import SFIConfig
from sfi_jax.kernels.common import interpret_for, sortable_keys
from sfi_jax.options import SELECTOR_ADJUST, resolve

NEG_INF = float("-inf")


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


def prior(key_norms, lo, hi, in_j, cfg: SFIConfig):
    """r(j): key-norm prior times position prior, normalised over J. [B, H, S]."""
    eps = cfg.eps
    size = key_norms.shape[-1]
    pos = jnp.arange(size, dtype=jnp.float32)[None, :]
    lo_f = jnp.asarray(lo, jnp.float32)[:, None]
    last = jnp.asarray(hi, jnp.float32)[:, None] - 1.0
    span = jnp.maximum(last - lo_f, 0.0) + eps
    u = jnp.where(in_j, (pos - lo_f) / span, 0.0)
    # 1 - u written as (max J - j + eps) / span keeps the newest position's eps^eta exact.
    one_minus_u = jnp.where(in_j, (last - pos + eps) / span, 1.0)
    pi_pos = jnp.exp(-cfg.beta * u**cfg.p) * (one_minus_u + eps) ** cfg.eta
    pi_kn = (key_norms.astype(jnp.float32) + eps) ** (-cfg.gamma)
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


def cross_head(z, in_j, cfg: SFIConfig, cross_head_reduce=None):
    """z + alpha_cross * log(max(q, eps)), q = softmax over all KV heads of z / T."""
    if cfg.alpha_cross == 0.0:
        return z
    y = z / cfg.cross_temp
    mx = _reduce(jnp.max(y, axis=1, keepdims=True), "max", cross_head_reduce)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    total = _reduce(jnp.sum(jnp.exp(y - mx), axis=1, keepdims=True), "sum", cross_head_reduce)
    log_total = jnp.log(jnp.where(total > 0, total, 1.0))
    log_q = jnp.maximum(y - mx - log_total, math.log(cfg.eps))
    return jnp.where(in_j[:, None, :], z + cfg.alpha_cross * log_q, NEG_INF)


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


def _clipped_range(size, lo, hi):
    return (jnp.clip(jnp.asarray(lo, jnp.int32), 0, size),
            jnp.clip(jnp.asarray(hi, jnp.int32), 0, size))


def base_scores(logits, key_norms, allowed_lo, allowed_hi, cfg: SFIConfig):
    """z = log(s + eps) of SFI_METHOD.md §4 steps 1-4, [B, H, S] float32, -inf outside J
    (lo, hi already clipped to [0, S]); the jnp reference of kernels.selector_gpu."""
    in_j = allowed_mask(logits.shape[-1], allowed_lo, allowed_hi)
    f = evidence(logits, in_j, cfg.power_alpha)
    if cfg.lam_clip > 0.0:
        r = prior(key_norms, allowed_lo, allowed_hi, in_j, cfg)
        lam = fusion_lambda(f, r, cfg.lam_clip)
        s = (1.0 - lam) * f + lam * r
    else:
        s = f
    return jnp.where(in_j[:, None, :], jnp.log(s + cfg.eps), NEG_INF)


def adjust_scores(z, allowed_lo, allowed_hi, cfg: SFIConfig, cross_head_reduce=None):
    """Steps 5-6 (soft-NMS, cross-head exclusivity) and the successor spread on z [B, H, S]."""
    in_j = allowed_mask(z.shape[-1], allowed_lo, allowed_hi)
    z = soft_nms(z, in_j, cfg.nms_radius, cfg.alpha_soft)
    z = cross_head(z, in_j, cfg, cross_head_reduce)
    if cfg.successor_radius > 0:
        z = successor_spread(z, in_j, cfg.successor_radius)
    return z


@functools.partial(jax.jit, static_argnames=("cfg", "cross_head_reduce", "impl", "adjust"))
def selector_scores(logits, key_norms, allowed_lo, allowed_hi, cfg: SFIConfig, *,
                    cross_head_reduce=None, impl: str = "xla", adjust: str = "xla"):
    """z_adj [B, H, S] float32 of SFI_METHOD.md §4 steps 1-6; -inf outside J.

    cross_head_reduce: None (all KV heads are local), an axis name (KV heads sharded over that
    mesh axis under shard_map: max and sum are finished with pmax / psum), or fn(x, op).
    impl: jnp ("xla"), or Triton kernels for steps 1-4 ("pallas_gpu", interpret mode off the
    GPU); "auto" is "pallas_gpu" on GPU, else "xla" (`EngineOptions.selector_scores`).
    adjust: steps 5-6 by jnp ("xla") or, after the steps 1-4 kernels, one Triton pass
    ("kernel"; `EngineOptions.selector_adjust`).
    """
    return selector_scores_at(logits[:, None], 0, key_norms[:, None], 0, allowed_lo,
                              allowed_hi, cfg, cross_head_reduce=cross_head_reduce, impl=impl,
                              adjust=adjust)


def selector_scores_at(logits, slot, key_norms, row, allowed_lo, allowed_hi, cfg: SFIConfig, *,
                       cross_head_reduce=None, impl: str = "xla", adjust: str = "xla"):
    """`selector_scores` of logits[:, slot] [N, H, R, S] and key_norms[:, row] [N, H, S], from
    logits [N, M, H, R, S] and key_norms [N, B, H, S]: the kernel reads them in place (the
    engine's scratch buffer and key-norm cache), where a sliced operand would be a copy."""
    size = logits.shape[-1]
    lo, hi = _clipped_range(size, allowed_lo, allowed_hi)
    if adjust not in SELECTOR_ADJUST:
        raise ValueError(f"adjust={adjust!r}: expected one of {SELECTOR_ADJUST}")
    by_kernel = adjust == "kernel"
    if resolve("selector_scores", impl) == "pallas_gpu":
        from sfi_jax.kernels import selector_gpu

        kw = dict(cfg=cfg, interpret=interpret_for("pallas_gpu"))
        fused = (by_kernel and cross_head_reduce is None
                 and selector_gpu.adjust_supported(cfg))
        z = selector_gpu.base_scores(logits, key_norms, lo, hi, slot, row,
                                     pad=selector_gpu.adjust_pad(cfg) if fused else 0, **kw)
        if fused:
            z = selector_gpu.adjust_scores(z, lo, hi, **kw)  # steps 5-6 in one pass
            if cfg.successor_radius > 0:
                z = successor_spread(z, allowed_mask(size, lo, hi), cfg.successor_radius)
            return z
    else:
        lg = lax.dynamic_index_in_dim(logits, slot, axis=1, keepdims=False)
        kn = lax.dynamic_index_in_dim(key_norms, row, axis=1, keepdims=False)
        z = base_scores(lg, kn, lo, hi, cfg)
    return adjust_scores(z, lo, hi, cfg, cross_head_reduce)


def _kth_largest_key(keys, k: int, radix_bits: int):
    """Exact k-th largest key per row: a radix search fixing radix_bits per round, each round
    one fused count of keys >= each candidate digit (no sort, no histogram scatter)."""
    prefix = jnp.zeros(keys.shape[:-1], jnp.uint32)
    digits = jnp.arange(1, 2**radix_bits, dtype=jnp.uint32)
    for shift in range(32 - radix_bits, -1, -radix_bits):
        cand = prefix[..., None] + (digits << shift)  # count(keys >= prefix) >= k holds throughout
        counts = jnp.sum(keys[..., None, :] >= cand[..., :, None], axis=-1, dtype=jnp.int32)
        prefix = prefix + (jnp.sum(counts >= k, axis=-1, dtype=jnp.uint32) << shift)
    return prefix


def _kth_largest(scores, k: int, radix_bits: int, kernel: bool):
    """The k-th largest sortable key of each row of scores [..., S]: by jnp, or with kernel by
    one Triton-lowered Pallas program per row (kernels.selector_gpu; interpret mode off the
    GPU), which reads a row once per round instead of once per candidate digit."""
    if not kernel:
        return _kth_largest_key(sortable_keys(scores), k, radix_bits)
    from sfi_jax.kernels import selector_gpu

    rows = scores.reshape(-1, scores.shape[-1])
    t = selector_gpu.kth_largest_key(rows, k, radix_bits=radix_bits, interpret=interpret_for("pallas_gpu"))
    return t.reshape(scores.shape[:-1])


def _count_prefix(mask):
    """Inclusive running count of True along the last axis, int32. Blocks of 128 are counted by
    one matmul with a triangular matrix (exact: block counts <= 128, totals < 2**24), then the
    block offsets by a short cumsum: a few passes over the data on the GPU, where a cumsum over
    a long axis is a many-pass scan."""
    size = mask.shape[-1]
    blk = 128
    nb = -(-size // blk)
    pad = [(0, 0)] * (mask.ndim - 1) + [(0, nb * blk - size)]
    x = jnp.pad(mask, pad).reshape(mask.shape[:-1] + (nb, blk)).astype(jnp.bfloat16)
    tri = jnp.triu(jnp.ones((blk, blk), jnp.bfloat16))  # tri[i, j] = (i <= j)
    within = jnp.einsum("...i,ij->...j", x, tri, preferred_element_type=jnp.float32)
    totals = within[..., -1].astype(jnp.int32)
    offsets = jnp.cumsum(totals, axis=-1, dtype=jnp.int32) - totals
    out = within.astype(jnp.int32) + offsets[..., None]
    return out.reshape(mask.shape[:-1] + (nb * blk,))[..., :size]


def _topk_threshold(scores, k: int, out_k: int, radix_bits: int, kernel: bool = False):
    keys = sortable_keys(scores)
    t = _kth_largest(scores, k, radix_bits, kernel)[..., None]
    gt = keys > t
    eq = keys == t
    quota = k - jnp.sum(gt, axis=-1, keepdims=True, dtype=jnp.int32)
    # Ties at the threshold go to the lowest positions, like lax.top_k.
    sel = (gt | (eq & (_count_prefix(eq) <= quota))) & (scores > NEG_INF)
    # Compaction by binary search: output slot j holds the first position where the running
    # count of selected positions reaches j + 1 (a gather per slot; a scatter over every
    # position was the slowest part of the selector on the GPU).
    size = scores.shape[-1]
    pos, _ = _compact_true(sel.reshape(-1, size), out_k)
    return pos.reshape(scores.shape[:-1] + (out_k,))


PREFILTER_SAMPLE = 4096  # strided sample size for the candidate threshold


def _prefilter_plan(size: int, k: int):
    """(stride, sample rank, candidate cap) for the sampled pre-filter, or None when the rows are
    too short for it to pay (the candidates would be a large share of the row)."""
    cap = 2 * k + 1024
    # H200, k 2048, 36 layers x 8 heads: 128K 3.7 -> 2.2 ms per selection, 32K 0.90 -> 1.03
    if size < 8 * cap or k < 64:
        return None
    stride = max(1, size // PREFILTER_SAMPLE)
    m = -(-size // stride)
    # expected candidates ~ 0.7 * cap: the rank's relative spread ~ 1/sqrt(rank) keeps the count
    # inside [k, cap] unless the row is strongly clustered (then the exact fallback runs)
    rank = max(1, min(m - 1, round(0.7 * cap * m / size)))
    return stride, rank, cap


def _prefilter(rows, k: int, plan, radix_bits: int | None = None, kernel: bool = False):
    """Candidates of the k largest: the positions (ascending, -1 padded) of the values at or
    above a threshold read off a strided sample, and whether every row kept between k and cap.
    The sample's threshold comes from lax.top_k (a sort), or with radix_bits from the radix
    search on the float bits (a few fused counts)."""
    stride, rank, cap = plan
    sample = rows[:, ::stride]
    if radix_bits is None:
        keep = rows >= lax.top_k(sample, rank + 1)[0][:, rank:rank + 1]
    else:
        t = _kth_largest(sample, rank + 1, radix_bits, kernel)[:, None]
        keep = sortable_keys(rows) >= t
    pos, n = _compact_true(keep & (rows > NEG_INF), cap)
    return pos, jnp.all((n >= k) & (n <= cap))


def _compact_true(mask, out_k: int):
    """Positions of the True entries of mask [N, S], ascending, the first out_k, -1 padded, and
    the count of True per row. Binary search of the running count (a gather per output slot; a
    scatter over every position was the slowest part of the selector on the GPU)."""
    count = _count_prefix(mask)
    want = jnp.arange(1, out_k + 1, dtype=jnp.int32)
    pos = jax.vmap(lambda c: jnp.searchsorted(c, want, side="left", method="scan_unrolled"))(count)
    total = count[:, -1]
    return jnp.where(want[None, :] <= total[:, None], pos, -1).astype(jnp.int32), total


def _topk_prefiltered(scores, k: int, out_k: int, radix_bits: int, rank_by_radix: bool,
                      kernel: bool = False):
    """The exact top-k of long rows from a few passes: a sampled threshold keeps ~1.4 k
    candidates per row, which are ranked (in position order, so ties go to the lowest
    positions as in lax.top_k) by lax.top_k and a sort, or with rank_by_radix by the radix
    threshold (no sort at all); when any row kept fewer than k or more than the cap, the radix
    threshold runs over the whole rows instead. kernel: the radix searches by
    kernels.selector_gpu.kth_largest_key."""
    size = scores.shape[-1]
    plan = _prefilter_plan(size, k)
    if plan is None:
        return _topk_threshold(scores, k, out_k, radix_bits, kernel)
    rows = scores.reshape(-1, size)
    cand, ok = _prefilter(rows, k, plan, radix_bits if rank_by_radix else None, kernel)

    def ranked(rows, cand):
        vals = jnp.where(cand >= 0, jnp.take_along_axis(rows, jnp.maximum(cand, 0), axis=-1),
                         NEG_INF)
        if rank_by_radix:
            idx = _topk_threshold(vals, k, out_k, radix_bits, kernel)
        else:
            idx = _topk_lax(vals, k, out_k)
        return jnp.where(idx >= 0, jnp.take_along_axis(cand, jnp.maximum(idx, 0), axis=-1), -1)

    def exact(rows, cand):
        return _topk_threshold(rows, k, out_k, radix_bits, kernel)

    out = lax.cond(ok, ranked, exact, rows, cand)
    return out.reshape(scores.shape[:-1] + (out_k,))


def _topk_lax(scores, k: int, out_k: int):
    size = scores.shape[-1]
    vals, idx = lax.top_k(scores, k)
    idx = jnp.sort(jnp.where(vals > NEG_INF, idx, size), axis=-1)
    idx = jnp.where(idx < size, idx, -1).astype(jnp.int32)
    if out_k > k:
        idx = jnp.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, out_k - k)], constant_values=-1)
    return idx


@functools.partial(jax.jit, static_argnames=("k", "impl", "radix_bits"))
def topk_positions(scores, k: int, *, impl: str = "lax", radix_bits: int | None = None):
    """Positions of the k largest finite scores per row, ascending, padded with -1. [..., k].

    impl "lax" uses lax.top_k; "auto" is "radix_kernel" on GPU, else "lax"; "threshold" avoids a
    full top-k over long rows: a threshold read off a strided sample keeps ~1.4 k candidates,
    which lax.top_k ranks, and where a row keeps too few or too many it finds the exact k-th
    largest value by a radix search on the float bits and compacts the positions above it.
    "radix" is "threshold" with no sort left: the sample's threshold and the candidates' k-th
    largest come from the radix search too. "radix_kernel" is "radix" with each radix search
    in one Triton-lowered Pallas kernel (interpret mode off the GPU; radix_bits 1, 2 or 4).
    radix_bits: bits fixed per radix round (None: 2 for "radix_kernel", the fastest on the
    H200 at 32K, else 4).
    Ties go to the lowest positions in every path. All return the same set.
    """
    impl = resolve("selector_topk", impl)
    if radix_bits is None:
        radix_bits = 2 if impl == "radix_kernel" else 4
    if radix_bits not in ((1, 2, 4) if impl == "radix_kernel" else (1, 2, 4, 8)):
        raise ValueError(f"radix_bits must be 1, 2, 4{'' if impl == 'radix_kernel' else ' or 8'}"
                         f" with topk impl {impl!r}, got {radix_bits!r}")
    kk = min(k, scores.shape[-1])
    scores = scores.astype(jnp.float32)
    if impl == "lax":
        return _topk_lax(scores, kk, k)
    return _topk_prefiltered(scores, kk, k, radix_bits, rank_by_radix=impl != "threshold",
                             kernel=impl == "radix_kernel")


def select(logits, key_norms, allowed_lo, allowed_hi, cfg: SFIConfig, *, topk_impl: str = "lax",
           cross_head_reduce=None, scores_impl: str = "xla"):
    """Selected positions int32 [B, H, cfg.k_select]: the top-k of J by z_adj, in ascending
    position order, -1 in the slots beyond min(k_select, |J|).

    Both halves are jitted with static arguments, so this is cheap to call eagerly and
    inlines under an outer jit or shard_map.
    """
    z = selector_scores(logits, key_norms, allowed_lo, allowed_hi, cfg,
                        cross_head_reduce=cross_head_reduce, impl=scores_impl)
    return topk_positions(z, cfg.k_select, impl=topk_impl)
