"""The SFI selector (SFI_METHOD.md §4), vectorised over batch, KV heads and positions.

Shapes: logits [B, Hkv, R, S], key_norms [B, Hkv, S], allowed range J = [lo[b], hi[b]) per
batch row. Everything outside J is masked to -inf (scores) or 0 (probabilities), so empty and
one-element ranges give no NaN. `selector_scores` and `topk_positions` are the two halves of
`select`, kept separate so they can be tested and profiled on their own. The scores' steps and
the radix search are computed in `kernels.selector` (jnp or Triton kernels).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from sfi_jax.config import SFIConfig
from sfi_jax.kernels import selector as selector_kernels
from sfi_jax.kernels.common import sortable_keys
from sfi_jax.kernels.selector_reference import (  # noqa: F401 (the selector's public steps)
    NEG_INF, ScoreParams, adjust_scores, allowed_mask, base_scores, cross_head, evidence,
    fusion_lambda, prior, soft_nms, successor_spread, window_max)
from sfi_jax.options import resolve


def score_params(sfi: SFIConfig) -> ScoreParams:
    """The numbers of `sfi` that the scores' kernels take."""
    return ScoreParams(*(getattr(sfi, name) for name in ScoreParams._fields))


@functools.partial(jax.jit, static_argnames=("sfi", "cross_head_reduce", "impl", "adjust"))
def selector_scores(logits, key_norms, allowed_lo, allowed_hi, sfi: SFIConfig, *,
                    cross_head_reduce=None, impl: str = "xla", adjust: str = "xla"):
    """z_adj [B, H, S] float32 of SFI_METHOD.md §4 steps 1-6; -inf outside J.

    cross_head_reduce: None (all KV heads are local), an axis name (KV heads sharded over that
    mesh axis under shard_map: max and sum are finished with pmax / psum), or fn(x, op).
    impl: jnp ("xla"), or kernels for steps 1-4: Triton's ("pallas_gpu") or their Mosaic GPU
    twins ("mosaic_gpu"), interpret mode off the GPU; "auto" is "pallas_gpu" on GPU, else
    "xla" (`EngineOptions.selector_scores`).
    adjust: steps 5-6 by jnp ("xla") or, after the steps 1-4 kernels, one Triton pass
    ("kernel"; `EngineOptions.selector_adjust`).
    """
    return selector_scores_at(logits[:, None], 0, key_norms[:, None], 0, allowed_lo,
                              allowed_hi, sfi, cross_head_reduce=cross_head_reduce, impl=impl,
                              adjust=adjust)


def selector_scores_at(logits, slot, key_norms, row, allowed_lo, allowed_hi, sfi: SFIConfig, *,
                       cross_head_reduce=None, impl: str = "xla", adjust: str = "xla"):
    """`selector_scores` of logits[:, slot] [N, H, R, S] and key_norms[:, row] [N, H, S], from
    logits [N, M, H, R, S] and key_norms [N, B, H, S]: the kernel reads them in place (the
    engine's scratch buffer and key-norm cache), where a sliced operand would be a copy."""
    return selector_kernels.scores_at(logits, slot, key_norms, row, allowed_lo, allowed_hi,
                                      score_params(sfi), cross_head_reduce=cross_head_reduce,
                                      impl=impl, adjust=adjust)


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


def _topk_threshold(scores, k: int, out_k: int, radix_bits: int, kernel: str | None = None):
    keys = sortable_keys(scores)
    t = selector_kernels.kth_largest(scores, k, radix_bits, kernel)[..., None]
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
    # below 8 caps per row the pre-filter no longer pays (docs/findings.md)
    if size < 8 * cap or k < 64:
        return None
    stride = max(1, size // PREFILTER_SAMPLE)
    m = -(-size // stride)
    # expected candidates ~ 0.7 * cap: the rank's relative spread ~ 1/sqrt(rank) keeps the count
    # inside [k, cap] unless the row is strongly clustered (then the exact fallback runs)
    rank = max(1, min(m - 1, round(0.7 * cap * m / size)))
    return stride, rank, cap


def _prefilter(rows, k: int, plan, radix_bits: int | None = None,
               kernel: str | None = None):
    """Candidates of the k largest: the positions (ascending, -1 padded) of the values at or
    above a threshold read off a strided sample, and whether every row kept between k and cap.
    The sample's threshold comes from lax.top_k (a sort), or with radix_bits from the radix
    search on the float bits (a few fused counts)."""
    stride, rank, cap = plan
    sample = rows[:, ::stride]
    if radix_bits is None:
        keep = rows >= lax.top_k(sample, rank + 1)[0][:, rank:rank + 1]
    else:
        t = selector_kernels.kth_largest(sample, rank + 1, radix_bits, kernel)[:, None]
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
                      kernel: str | None = None):
    """The exact top-k of long rows from a few passes: a sampled threshold keeps ~1.4 k
    candidates per row, which are ranked (in position order, so ties go to the lowest
    positions as in lax.top_k) by lax.top_k and a sort, or with rank_by_radix by the radix
    threshold (no sort at all); when any row kept fewer than k or more than the cap, the radix
    threshold runs over the whole rows instead. kernel: the radix searches by a kernel
    ("pallas_gpu" or "mosaic_gpu", `selector_kernels.kth_largest`) instead of jnp."""
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


_RADIX_KERNELS = {"radix_kernel": "pallas_gpu", "radix_mosaic_gpu": "mosaic_gpu"}


@functools.partial(jax.jit, static_argnames=("k", "impl", "radix_bits"))
def topk_positions(scores, k: int, *, impl: str = "lax", radix_bits: int | None = None):
    """Positions of the k largest finite scores per row, ascending, padded with -1. [..., k].

    impl "lax" uses lax.top_k; "auto" as `EngineOptions.selector_topk` resolves it (a GPU kernel
    on GPU, else "lax"); "threshold" avoids a
    full top-k over long rows: a threshold read off a strided sample keeps ~1.4 k candidates,
    which lax.top_k ranks, and where a row keeps too few or too many it finds the exact k-th
    largest value by a radix search on the float bits and compacts the positions above it.
    "radix" is "threshold" with no sort left: the sample's threshold and the candidates' k-th
    largest come from the radix search too. "radix_kernel" is "radix" with each radix search
    in one Triton-lowered Pallas kernel (interpret mode off the GPU; radix_bits 1, 2 or 4);
    "radix_mosaic_gpu" the same in its Mosaic GPU twin (Hopper).
    radix_bits: bits fixed per radix round (None: 2 for the kernels, else 4).
    Ties go to the lowest positions in every path. All return the same set.
    """
    impl = resolve("selector_topk", impl)
    kernel = _RADIX_KERNELS.get(impl)
    if radix_bits is None:
        radix_bits = 2 if kernel else 4
    if radix_bits not in ((1, 2, 4) if kernel else (1, 2, 4, 8)):
        raise ValueError(f"radix_bits must be 1, 2, 4{'' if kernel else ' or 8'}"
                         f" with topk impl {impl!r}, got {radix_bits!r}")
    kk = min(k, scores.shape[-1])
    scores = scores.astype(jnp.float32)
    if impl == "lax":
        return _topk_lax(scores, kk, k)
    return _topk_prefiltered(scores, kk, k, radix_bits, rank_by_radix=impl != "threshold",
                             kernel=kernel)


def select(logits, key_norms, allowed_lo, allowed_hi, sfi: SFIConfig, *, topk_impl: str = "lax",
           cross_head_reduce=None, scores_impl: str = "xla"):
    """Selected positions int32 [B, H, sfi.k_select]: the top-k of J by z_adj, in ascending
    position order, -1 in the slots beyond min(k_select, |J|).

    Both halves are jitted with static arguments, so this is cheap to call eagerly and
    inlines under an outer jit or shard_map.
    """
    z = selector_scores(logits, key_norms, allowed_lo, allowed_hi, sfi,
                        cross_head_reduce=cross_head_reduce, impl=scores_impl)
    return topk_positions(z, sfi.k_select, impl=topk_impl)
