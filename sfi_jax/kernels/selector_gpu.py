"""The selector's scores (SFI_METHOD.md §4) as Triton-lowered Pallas kernels: a few passes over
the logits instead of the dozens of XLA reductions and elementwise passes the jnp version
(`selector.select.base_scores`, `adjust_scores`) becomes on the GPU.

Steps 1-4 need two sums over all of J per (n, KV head): each row's log-sum-exp, then the
evidence's normaliser and the dot products of the fusion weight lambda. So three kernels, each
over chunks of positions of every (n, head) (enough programs to fill the GPU at one refreshed
row), with the chunks' partial sums merged by a few tiny XLA ops in between:
`_row_stats` (per-row online max and sum), `_fusion_stats` (g = log(mu) / a and the prior
r, as max-shifted running sums: f is never stored) and `_write_scores` (z = log((1 - lambda)
f + lambda r + eps), -inf outside J). The logits are read from the engine's scratch buffer
[N, M, H, R, S] at a slot and the key norms from the cache's [N, B, H, S] at a row, so no
per-slot copy is made. Steps 5-6 (soft-NMS, cross-head) can be one more kernel over z
(`adjust_scores`, opt-in with EngineOptions(selector_adjust="kernel")).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sfi_jax.kernels.common import pow2, sortable_keys  # sortable_keys: the jnp radix search's key order
from sfi_jax.kernels.selector_reference import merge_chunk_fusion, merge_chunk_lse, prior_terms

from sfi_jax.kernels.triton_lowering import M_INIT as _M_INIT, plgpu_triton

_TILE = 4096  # logits per block (rows x positions), a few registers per thread
_CHUNK_BLOCKS = 8  # blocks per program: 8K positions of 4 rows (36 x 8 x 16 programs at 128K)
# (both first guesses, not tuned on a GPU yet)


class _Plan:
    """Static shapes of one call, and the per-(n, head) helpers the three kernels share."""

    def __init__(self, params, r, s_len, tile=_TILE, chunk_blocks=_CHUNK_BLOCKS):
        self.params, self.r, self.s_len = params, r, s_len
        self.rp = pow2(r)
        self.blk = min(pow2(s_len), max(16, tile // self.rp))
        self.chunk_blocks = chunk_blocks
        self.n_chunks = pl.cdiv(s_len, self.blk * chunk_blocks)

    def blocks(self, c, lo, hi):
        """Block range of chunk c inside J (empty when they do not meet)."""
        first = jnp.maximum(c * self.chunk_blocks, lo // self.blk)
        stop = jnp.minimum((c + 1) * self.chunk_blocks, pl.cdiv(hi, self.blk))
        return first, jnp.maximum(stop, first)

    def load(self, logits_ref, at, start, lo, hi):
        """Logits [rp, blk] (-inf outside J and past R), positions, and the J mask."""
        pos = start + jnp.arange(self.blk)
        inj = (pos >= lo) & (pos < hi)
        rvalid = jnp.arange(self.rp) < self.r
        x = plgpu_triton.load(logits_ref.at[(*at, pl.ds(0, self.rp), pl.ds(start, self.blk))],
                              mask=rvalid[:, None] & inj[None, :], other=-jnp.inf)
        return x.astype(jnp.float32), pos, inj

    def evidence(self, x, lse, inj):
        """g = log(sum_r p_r^a) / a per position (-inf where no row has mass) and its mask."""
        a = self.params.power_alpha
        mu = jnp.sum(jnp.exp(a * (x - lse[:, None])), axis=0)
        ok = inj & (mu > 0)
        return jnp.where(ok, jnp.log(jnp.where(ok, mu, 1.0)) / a, -jnp.inf), ok

    def prior(self, norms_ref, at, start, pos, inj, lo, hi):
        """pi_kn * pi_pos (unnormalised), 0 outside J."""
        kn = plgpu_triton.load(norms_ref.at[(*at, pl.ds(start, self.blk))], mask=inj, other=1.0)
        return prior_terms(kn, pos, inj, lo, hi, self.params)


def _row_stats_kernel(idx_ref, lo_ref, hi_ref, logits_ref, m_ref, l_ref, *, plan):
    """Chunk c of J: each row's running max and sum of exp (partials of its log-sum-exp)."""
    n, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[n], hi_ref[n]
    at = (n, idx_ref[0], h)

    def body(i, carry):
        m, l = carry
        x, _, _ = plan.load(logits_ref, at, i * plan.blk, lo, hi)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        return m_new, l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new[:, None]), axis=1)

    m, l = lax.fori_loop(*plan.blocks(c, lo, hi), body,
                         (jnp.full((plan.rp,), _M_INIT, jnp.float32),
                          jnp.zeros((plan.rp,), jnp.float32)))
    plgpu_triton.store(m_ref.at[n, h, c, pl.ds(0, plan.rp)], m)
    plgpu_triton.store(l_ref.at[n, h, c, pl.ds(0, plan.rp)], l)


def _fusion_stats_kernel(idx_ref, lo_ref, hi_ref, logits_ref, norms_ref, lse_ref, out_ref, g_ref,
                         *pi_ref, plan):
    """Chunk c of J: max of g, sums of exp(g - max), exp(2 (g - max)), exp(g - max) * pi, pi
    and pi^2 (partials of the evidence normaliser and of f.f, f.r, r.r). Also stores g and pi
    (the unnormalised prior) for J's blocks, so the last pass reads two floats per position
    instead of the R logits and the key norm, and computes no transcendentals again."""
    n, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[n], hi_ref[n]
    lse = plgpu_triton.load(lse_ref.at[n, h, pl.ds(0, plan.rp)])
    with_prior = plan.params.lam_clip > 0.0

    def body(i, carry):
        gm, s1, s2, s3, p1, p2 = carry
        start = i * plan.blk
        x, pos, inj = plan.load(logits_ref, (n, idx_ref[0], h), start, lo, hi)
        g, ok = plan.evidence(x, lse, inj)
        inside = pos < plan.s_len
        plgpu_triton.store(g_ref.at[n, h, pl.ds(start, plan.blk)], g, mask=inside)
        gm_new = jnp.maximum(gm, jnp.max(jnp.where(ok, g, _M_INIT)))
        sc = jnp.exp(gm - gm_new)
        e = jnp.where(ok, jnp.exp(g - gm_new), 0.0)
        s1, s2 = s1 * sc + jnp.sum(e), s2 * sc * sc + jnp.sum(e * e)
        if with_prior:
            pi = plan.prior(norms_ref, (n, idx_ref[1], h), start, pos, inj, lo, hi)
            plgpu_triton.store(pi_ref[0].at[n, h, pl.ds(start, plan.blk)], pi, mask=inside)
            s3 = s3 * sc + jnp.sum(e * pi)
            p1, p2 = p1 + jnp.sum(pi), p2 + jnp.sum(pi * pi)
        return gm_new, s1, s2, s3, p1, p2

    zero = jnp.float32(0.0)
    stats = lax.fori_loop(*plan.blocks(c, lo, hi), body,
                          (jnp.float32(_M_INIT), zero, zero, zero, zero, zero))
    plgpu_triton.store(out_ref.at[n, h, c, pl.ds(0, 8)],
                       sum(jnp.where(jnp.arange(8) == k, v, 0.0) for k, v in enumerate(stats)))


def _write_scores_kernel(lo_ref, hi_ref, fuse_ref, g_ref, *refs, plan, pad):
    """Chunk c of all positions: z = log((1 - lambda) f + lambda r + eps) in J, -inf outside,
    from the stored g and pi; z is stored at offset `pad` of a row of S + 2 pad positions whose
    pads are -inf (chunk 0 and the last chunk write them), so the next kernel's shifted reads
    start at or after 0."""
    pi_ref, z_ref = refs if plan.params.lam_clip > 0.0 else (None, refs[0])
    n, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[n], hi_ref[n]
    gm, inv_s1, inv_p1, lam = (fuse_ref[n, h, k] for k in range(4))
    eps = plan.params.eps
    if pad:  # Triton's arrays have power-of-two sizes: each pad by a masked [pow2(pad)]
        width = pow2(pad)  # store inside the row (width <= 2 pad), at its start and its end
        neg = jnp.full((width,), -jnp.inf, jnp.float32)
        lanes = jnp.arange(width)
        plgpu_triton.store(z_ref.at[n, h, pl.ds(0, width)], neg, mask=(lanes < pad) & (c == 0))
        plgpu_triton.store(z_ref.at[n, h, pl.ds(plan.s_len + 2 * pad - width, width)], neg,
                           mask=(lanes >= width - pad) & (c == plan.n_chunks - 1))

    def body(i, carry):
        start = i * plan.blk
        pos = start + jnp.arange(plan.blk)
        inj = (pos >= lo) & (pos < hi)
        g = plgpu_triton.load(g_ref.at[n, h, pl.ds(start, plan.blk)], mask=inj, other=-jnp.inf)
        ok = inj & (g > -jnp.inf)
        s = (1.0 - lam) * jnp.where(ok, jnp.exp(jnp.where(ok, g, gm) - gm) * inv_s1, 0.0)
        if pi_ref is not None:
            pi = plgpu_triton.load(pi_ref.at[n, h, pl.ds(start, plan.blk)], mask=inj, other=0.0)
            s = s + lam * pi * inv_p1
        z = jnp.where(inj, jnp.log(s + eps), -jnp.inf)
        plgpu_triton.store(z_ref.at[n, h, pl.ds(pad + start, plan.blk)], z,
                           mask=pos < plan.s_len)
        return carry

    first = c * plan.chunk_blocks
    lax.fori_loop(first, jnp.minimum(first + plan.chunk_blocks, pl.cdiv(plan.s_len, plan.blk)),
                  body, 0)


@functools.partial(jax.jit, static_argnames=("params", "interpret", "pad", "num_warps", "tile",
                                             "chunk_blocks"))
def base_scores(logits, key_norms, lo, hi, slot, row, *, params, interpret=False, pad=0,
                num_warps=4, tile=_TILE, chunk_blocks=_CHUNK_BLOCKS):
    """z [N, H, S] float32 of SFI_METHOD.md §4 steps 1-4 (-inf outside J = [lo[n], hi[n])).

    logits [N, M, H, R, S] (read at index `slot` of axis 1), key_norms [N, B, H, S] (read at
    `row`); lo, hi int32 [N], already clipped to [0, S]. params: the selector's `ScoreParams`. pad > 0 (any
    size, `adjust_pad`): z comes as [N, H, S + 2 pad] with -inf pads on both sides
    (`adjust_scores`' input).
    num_warps, tile (logits per block), chunk_blocks (blocks per program): tuning knobs
    (scripts/bench/bench_selector_kernels.py times a few).
    """
    n_sets, _, hkv, r, s_len = logits.shape
    if key_norms.shape[0] != n_sets or key_norms.shape[2:] != (hkv, s_len):
        raise ValueError(f"key_norms {key_norms.shape} do not match logits {logits.shape}")
    plan = _Plan(params, r, s_len, tile, chunk_blocks)
    idx = jnp.stack([jnp.asarray(slot, jnp.int32), jnp.asarray(row, jnp.int32)])
    lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
    kw = _call_kwargs(plan, n_sets, hkv, num_warps, interpret)
    lse = _row_lse(plan, kw, idx, lo, hi, logits)
    fuse, g_pi = _fusion(plan, kw, idx, lo, hi, logits, key_norms, lse)
    return pl.pallas_call(
        functools.partial(_write_scores_kernel, plan=plan, pad=pad),
        out_shape=jax.ShapeDtypeStruct((n_sets, hkv, s_len + 2 * pad), jnp.float32),
        name="sfi_selector_scores", **kw)(lo, hi, fuse, *g_pi)


def _call_kwargs(plan, n_sets, hkv, num_warps, interpret):
    """pallas_call arguments shared by the three passes: one program per chunk of each
    (n, KV head)."""
    return dict(grid=(n_sets, hkv, plan.n_chunks), interpret=interpret,
                compiler_params=plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=2))


def _row_lse(plan, kw, idx, lo, hi, logits):
    """Pass 1: each query row's log-sum-exp over J [N, H, rp]."""
    n_sets, hkv = kw["grid"][:2]
    part = jax.ShapeDtypeStruct((n_sets, hkv, plan.n_chunks, plan.rp), jnp.float32)
    m, l = pl.pallas_call(functools.partial(_row_stats_kernel, plan=plan),
                          out_shape=[part, part], name="sfi_selector_row_stats",
                          **kw)(idx, lo, hi, logits)
    return merge_chunk_lse(m, l)


def _fusion(plan, kw, idx, lo, hi, logits, key_norms, lse):
    """Pass 2: (max g, normalisers, lambda) [N, H, 4], and g (and the prior) per position."""
    n_sets, hkv = kw["grid"][:2]
    per_position = jax.ShapeDtypeStruct((n_sets, hkv, plan.s_len), jnp.float32)
    stats, *g_pi = pl.pallas_call(
        functools.partial(_fusion_stats_kernel, plan=plan),
        out_shape=[jax.ShapeDtypeStruct((n_sets, hkv, plan.n_chunks, 8), jnp.float32),
                   per_position] + [per_position] * (plan.params.lam_clip > 0.0),
        name="sfi_selector_fusion_stats", **kw)(idx, lo, hi, logits, key_norms, lse)
    return merge_chunk_fusion(stats, plan.params.lam_clip), g_pi


def _adjust_kernel(lo_ref, hi_ref, z_ref, out_ref, *, hkv, hp, s_len, blk, radius, alpha_soft,
                   alpha_cross, cross_temp, log_eps):
    """Soft-NMS then cross-head exclusivity for one block of positions of all KV heads at once
    (a [heads, blk] tile); z_ref holds each row at offset `radius` between -inf pads
    (`base_scores(pad=radius)`).

    The window max over |i - j| <= radius is the max of 2 radius + 1 shifted loads of the
    tile: Triton has no in-register shifts, and after the first load the others hit the L1
    cache, so the block is read from memory about once. The cross-head softmax reduces over
    the tile's head axis in registers."""
    n, b = pl.program_id(0), pl.program_id(1)
    lo, hi = lo_ref[n], hi_ref[n]
    start = b * blk
    pos = start + jnp.arange(blk)
    inj = (pos >= lo) & (pos < hi)
    heads = jnp.arange(hp) < hkv

    def load(shift):  # [hp, blk] at positions pos + shift; the pads hold -radius..-1, S..
        ok = heads[:, None] & (pos + shift < s_len + radius)[None, :]
        return plgpu_triton.load(z_ref.at[n, pl.ds(0, hp), pl.ds(radius + start + shift, blk)],
                                 mask=ok, other=-jnp.inf)

    z = load(0)
    if radius > 0 and alpha_soft != 0.0:
        m = z
        for shift in range(1, radius + 1):
            m = jnp.maximum(m, jnp.maximum(load(-shift), load(shift)))
        z = jnp.where(inj[None, :], z - alpha_soft * jnp.maximum(m - z, 0.0), -jnp.inf)
    if alpha_cross != 0.0:
        y = jnp.where(heads[:, None], z / cross_temp, -jnp.inf)
        mx = jnp.max(y, axis=0)
        mx = jnp.where(mx > -jnp.inf, mx, 0.0)
        total = jnp.sum(jnp.exp(y - mx[None, :]), axis=0)
        log_norm = mx + jnp.log(jnp.where(total > 0, total, 1.0))
        z = jnp.where(inj[None, :], z + alpha_cross * jnp.maximum(y - log_norm[None, :], log_eps),
                      -jnp.inf)
    plgpu_triton.store(out_ref.at[n, pl.ds(0, hp), pl.ds(start, blk)], z,
                       mask=heads[:, None] & (pos < s_len)[None, :])


ADJUST_MAX_RADIUS = 64  # 2 r + 1 loads per block: beyond this the jnp steps run instead


def adjust_supported(params) -> bool:
    """The adjust kernel unrolls one load per window offset, so the radius is bounded."""
    return params.alpha_soft == 0.0 or params.nms_radius <= ADJUST_MAX_RADIUS


def adjust_pad(params) -> int:
    """The -inf padding `adjust_scores` reads around each row (`base_scores(pad=...)`)."""
    return params.nms_radius if params.alpha_soft != 0.0 else 0


@functools.partial(jax.jit, static_argnames=("params", "interpret", "block", "num_warps"))
def adjust_scores(z_padded, lo, hi, *, params, interpret=False, block=512, num_warps=4):
    """Soft-NMS and cross-head exclusivity (SFI_METHOD.md §4 steps 5-6), all KV heads local, in
    one pass: z_padded [N, H, S + 2 pad] from `base_scores(pad=adjust_pad(params))` -> [N, H, S].
    block (positions per program, a power of two) and num_warps: tuning knobs (the defaults
    the fastest that scripts/bench/bench_selector_kernels.py found)."""
    if not adjust_supported(params):
        raise ValueError(f"nms_radius {params.nms_radius} > {ADJUST_MAX_RADIUS}: use the jnp steps")
    radius = adjust_pad(params)
    n_sets, hkv, padded = z_padded.shape
    s_len = padded - 2 * radius
    blk = min(pow2(s_len), block)
    kernel = functools.partial(
        _adjust_kernel, hkv=hkv, hp=pow2(hkv), s_len=s_len, blk=blk, radius=radius,
        alpha_soft=params.alpha_soft, alpha_cross=params.alpha_cross, cross_temp=params.cross_temp,
        log_eps=math.log(params.eps))
    return pl.pallas_call(
        kernel, grid=(n_sets, pl.cdiv(s_len, blk)),
        out_shape=jax.ShapeDtypeStruct((n_sets, hkv, s_len), jnp.float32),
        compiler_params=plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="sfi_selector_adjust",
    )(jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32), z_padded)


# ----------------------------------------------------------------------------- top-k threshold

def _kth_key_kernel(x_ref, out_ref, *, k, radix_bits, s_len, blk):
    """Row n's k-th largest key, radix_bits per round: every round counts the keys at or above
    each of the 2**radix_bits candidate digits in one sweep of the row (after the first round
    from L2), so a round costs one read instead of one per candidate."""
    n = pl.program_id(0)
    n_cand = 1 << radix_bits
    digits = jnp.arange(n_cand, dtype=jnp.int32)
    prefix = jnp.zeros((n_cand,), jnp.uint32)  # every lane holds the same prefix
    for shift in range(32 - radix_bits, -1, -radix_bits):
        cand = prefix + (digits.astype(jnp.uint32) << shift)

        def body(i, counts, cand=cand):
            pos = i * blk + jnp.arange(blk)
            x = plgpu_triton.load(x_ref.at[n, pl.ds(i * blk, blk)], mask=pos < s_len, other=0.0)
            keys = jnp.where(pos < s_len, sortable_keys(x), jnp.uint32(0))  # 0: below every digit
            hit = (keys[None, :] >= cand[:, None]).astype(jnp.int32)
            return counts + jnp.sum(hit, axis=1)

        counts = lax.fori_loop(0, pl.cdiv(s_len, blk), body, jnp.zeros((n_cand,), jnp.int32))
        # digit 0 (the prefix itself) always has >= k keys; the new digit counts the others
        step = jnp.sum(((counts >= k) & (digits >= 1)).astype(jnp.int32))
        prefix = prefix + (step.astype(jnp.uint32) << shift)
    plgpu_triton.store(out_ref.at[n, pl.ds(0, n_cand)], prefix)


KTH_RADIX_BITS = (1, 2, 4)  # the kernel's candidate tile is [2**bits, block]


@functools.partial(jax.jit, static_argnames=("k", "radix_bits", "interpret", "num_warps"))
def kth_largest_key(scores, k: int, *, radix_bits: int = 4, interpret=False, num_warps=8):
    """The k-th largest sortable key (`kernels.common.sortable_keys`) of each row of float32
    scores [N, S], uint32 [N]: the radix search of `select._kth_largest_key` as one program
    per row (the XLA version re-reads each row once per candidate digit per round)."""
    if radix_bits not in KTH_RADIX_BITS:
        raise ValueError(f"radix_bits must be one of {KTH_RADIX_BITS}, got {radix_bits!r}")
    n_rows, s_len = scores.shape
    if not 1 <= k <= s_len:
        raise ValueError(f"k={k} must be in [1, {s_len}] (the row length)")
    n_cand = 1 << radix_bits
    blk = min(pow2(s_len), max(16, 16384 // n_cand))
    out = pl.pallas_call(
        functools.partial(_kth_key_kernel, k=k, radix_bits=radix_bits, s_len=s_len, blk=blk),
        out_shape=jax.ShapeDtypeStruct((n_rows, n_cand), jnp.uint32), grid=(n_rows,),
        compiler_params=plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=3),
        interpret=interpret, name="sfi_kth_largest_key")(scores.astype(jnp.float32))
    return out[:, 0]
