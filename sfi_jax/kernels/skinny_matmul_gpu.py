"""Weight-streaming matmul for a few rows (a decode step's 1-64 tokens): Pallas with the
Triton lowering.

At decode batch sizes a projection reads its whole weight for a handful of rows, so its time is
the weight's bytes over the bandwidth. XLA's gemm fusions for one row do not stream at that
limit (profile_batch1.md in docs/findings.md). Here program (j, s) reads one column block of the weight
over one K split, so the grid has enough programs to keep every SM's loads in flight; each
split writes float32 partial sums that the caller's next elementwise fusion adds up.

Optional RMSNorm of the input rows, so the norm costs no launch of its own: each block of the
rows is multiplied by the norm's weight (the product rounded to the input dtype) on its way
into the matmul, and each split also writes its part of the rows' sums of squares; the row scale
applies to the summed product (a per-row factor commutes with the product). Optional second
weight of the same shape (gate and up projections): both read with one load of the input block.

Fused epilogues (`skinny_matmul_fused`, up to FUSED_MAX_ROWS rows): every program also bumps its
column block's counter, and the block's last program adds the splits up and applies what would
otherwise be the next XLA fusion (the heads' norm + rope, a residual add, the SiLU product).

K-major weights ([N, K], `skinny_matmul_kmajor`, up to FUSED_MAX_ROWS rows): each output
column's weights are contiguous, so a program covers whole columns over all of K and applies
the residual add or the SiLU product itself, without splits (`modeling.K_MAJOR`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sfi_jax.kernels.common import dot_precision, pow2
from sfi_jax.kernels.triton_lowering import (NUM_SMS as _NUM_SMS, dependents_mask,
                                             launch_dependents, plgpu_triton, signals_dependents)

_MIN_ROWS = 16  # smallest M of tl.dot
MODES = ("dot", "fma", "fma_defer")
MAX_ROWS = 64
FUSED_MAX_ROWS = 4  # the epilogue walks the rows one by one
EPILOGUES = ("residual", "silu", "heads")
SYNC_SIZE = 1024  # counters: at least the column blocks of any one call
_SMEM_BYTES = 200 * 1024  # of the H100/H200's 227 KiB per block, some left to Triton


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning knobs: block_n, block_k powers of two >= 16; programs the grid size aimed for;
    mode how a tile is multiplied: "dot" (tl.dot, rows padded to 16), "fma" (multiply-adds in
    registers, rows padded to a power of two, reduced over the tile's K every block) or
    "fma_defer" (the same, summed over K once at the end: more registers, no per-block
    reduction across threads)."""

    block_n: int = 256
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    programs: int = 4 * _NUM_SMS
    mode: str = "dot"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


def default_config(n: int, k: int, rows: int = 1) -> Config:
    """The H200 sweeps' best (benchmarks/skinny_matmul.md). Out of the hidden state (q/k/v,
    gate/up: N > K): 256 x 32 tiles multiplied in registers for one row, 256 x 64 tl.dot tiles
    on 2 stages for more (the register product grows with the rows). Into it (o, down: N < K):
    128 x 64 tiles on 8 programs per SM up to K = 4096, 128 x 128 on 2 per SM beyond."""
    if n < k:
        if k <= 4096:
            return Config(block_n=128, block_k=64, num_warps=4, num_stages=2,
                          programs=8 * _NUM_SMS)
        return Config(block_n=128, block_k=128, num_warps=4, num_stages=4, programs=2 * _NUM_SMS)
    if rows == 1:
        return Config(block_n=256, block_k=32, num_warps=4, num_stages=3, programs=4 * _NUM_SMS,
                      mode="fma")
    return Config(block_n=256, block_k=64, num_warps=4, num_stages=2, programs=4 * _NUM_SMS)


def plan(n: int, k: int, config: Config) -> tuple[int, int]:
    """(K per split, a multiple of block_k; number of splits) for an [k, n] weight."""
    bk = config.block_k
    n_blocks = -(-n // config.block_n)
    want = max(1, min(-(-config.programs // n_blocks), -(-k // bk)))
    k_split = -(-(-(-k // want)) // bk) * bk
    return k_split, -(-k // k_split)


def _timer(dep):
    """%globaltimer_lo (ns, wrapping at 2**32) as int32 [len(dep)], read once `dep` (int32) is
    computed (`skinny_matmul_fused(phase_stamps=True)`)."""
    out, = plgpu_triton.elementwise_inline_asm(
        "mov.u32 $0, %globaltimer_lo;", args=[dep], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(dep.shape, jnp.int32)])
    return out


def _kernel(x_ref, nw_ref, *refs, n_w, rows, n_rows, k, n, bn, bk, k_split, n_splits, normed,
            precision, mode, epilogue, eps, heads, interpret, signal, stamp):
    """Program (j, s): column block j over K split s. With an epilogue, the refs continue with
    the counters (aliased, read from the output side), the epilogue's inputs and outputs.
    signal: signal the dependents after the counter; stamp: also store the phase stamps."""
    w_refs, refs = refs[:n_w], refs[n_w:]
    if epilogue is not None:
        n_in = {"residual": 1, "silu": 0, "heads": 4}[epilogue]
        refs = refs[1:]  # the counters' input side
        ep_in, refs = refs[:n_in], refs[n_in:]
    o_refs, ss_ref, refs = refs[:n_w], refs[n_w] if normed else None, refs[n_w + normed:]
    j, s = pl.program_id(0), pl.program_id(1)
    if stamp:
        t0 = _timer(jnp.zeros((16,), jnp.int32) + j * n_splits + s)
    rmask = jnp.arange(rows) < n_rows
    cmask = j * bn + jnp.arange(bn) < n
    idx = jnp.arange(bk)
    start = s * k_split
    n_iter = pl.cdiv(jnp.minimum(k_split, k - start), bk)

    def body(i, carry):
        accs, sq = carry
        k0 = start + i * bk
        kmask = k0 + idx < k
        xb = plgpu_triton.load(x_ref.at[pl.ds(0, rows), pl.ds(k0, bk)],
                               mask=rmask[:, None] & kmask[None, :], other=0.0)
        if normed:  # the norm's weight now, its row scale after the sum over splits
            xf = xb.astype(jnp.float32)
            sq = sq + xf * xf
            nw = plgpu_triton.load(nw_ref.at[pl.ds(k0, bk)], mask=kmask, other=0.0)
            xb = (xf * nw.astype(jnp.float32)[None, :]).astype(x_ref.dtype)
        xb = xb.astype(w_refs[0].dtype)
        if mode != "dot":  # the rows as a column per row, broadcast over the tile's columns
            xcol = xb.astype(jnp.float32)[:, :, None]
        out = []
        for w_ref, acc in zip(w_refs, accs):
            wb = plgpu_triton.load(w_ref.at[pl.ds(k0, bk), pl.ds(j * bn, bn)],
                                   mask=kmask[:, None] & cmask[None, :], other=0.0)
            if mode == "dot":
                out.append(acc + plgpu_triton.dot(xb, wb, precision=precision))
            elif mode == "fma":
                out.append(acc + jnp.sum(xcol * wb.astype(jnp.float32)[None], axis=1))
            else:
                out.append(acc + xcol * wb.astype(jnp.float32)[None])
        return tuple(out), sq

    zeros = jnp.zeros((rows, bk, bn) if mode == "fma_defer" else (rows, bn), jnp.float32)
    accs, sq = lax.fori_loop(0, n_iter, body, (tuple(zeros for _ in w_refs),
                                               jnp.zeros((rows, bk) if normed else (1, 1),
                                                         jnp.float32)))
    if mode == "fma_defer":
        accs = tuple(jnp.sum(acc, axis=1) for acc in accs)
    if stamp:
        t1 = _timer(jnp.zeros((16,), jnp.int32)
                    + lax.bitcast_convert_type(jnp.sum(accs[0]), jnp.int32))
    for o_ref, acc in zip(o_refs, accs):  # (block-major for the epilogue: see `_call`)
        at = (s, pl.ds(0, rows), pl.ds(j * bn, bn)) if epilogue is None else \
            (j, s, pl.ds(0, rows), pl.ds(0, bn))
        plgpu_triton.store(o_ref.at[at], acc, mask=rmask[:, None] & cmask[None, :])
    if normed:  # this split's sums of squares of the rows: once, or per column block for the
        # epilogue (whose last program reads its own block's copies)
        at = (s, pl.ds(0, rows)) if epilogue is None else (j, s, pl.ds(0, rows))
        plgpu_triton.store(ss_ref.at[at], jnp.sum(sq, axis=1),
                           mask=rmask & ((j == 0) | (epilogue is not None)))
    if epilogue is None:
        return
    *ep_out, sync_ref, st_ref = refs if stamp else (*refs, None)
    # the epilogue's own inputs (the residual's columns, the rope's and the head norms' rows)
    # come now, in every program, so the last one waits on nothing but the other splits
    pre = _preload(ep_in, epilogue, n_rows=n_rows, c0=j * bn, bn=bn, cmask=cmask, heads=heads)
    # the block's last program to finish adds the splits up: every thread's stores happen
    # before the counter's (release) increment; its acquire orders the other splits' stores
    # before this program's loads
    if not interpret:
        plgpu_triton.debug_barrier()
    done = plgpu_triton.atomic_add(sync_ref, (j,), jnp.array(1, jnp.int32))
    # the dependents' signal after this program's stores (its operand: the counter); its
    # result's always-true test keeps it
    sig = launch_dependents(jnp.arange(16), signal, after=jnp.zeros((16,), jnp.int32) + done)
    if stamp:
        t2 = _timer(jnp.zeros((16,), jnp.int32) + done)
        for i, t in enumerate((t0, t1, t2, t2)):
            plgpu_triton.store(st_ref.at[j * n_splits + s, i, pl.ds(0, 16)], t)

    @pl.when((done == n_splits - 1) & (jnp.min(sig) >= 0))
    def _():
        _epilogue(o_refs, ss_ref, pre, ep_out, j=j, n_rows=n_rows, n_splits=n_splits, k=k,
                  n=n, bn=bn, normed=normed, epilogue=epilogue, eps=eps, heads=heads)
        if stamp:  # the epilogue's stores visible (an atomic's release after them)
            fin = plgpu_triton.atomic_add(sync_ref, (j,), jnp.array(0, jnp.int32))
            plgpu_triton.store(st_ref.at[j * n_splits + s, 3, pl.ds(0, 16)],
                               _timer(jnp.zeros((16,), jnp.int32) + fin))
        # back to zero for the next call: no other program touches the counter now, and the
        # next kernel to read it starts after this one ends (a plain store, not an atomic that
        # would hold up the loads above)
        plgpu_triton.store(sync_ref.at[pl.ds(j, 1)], jnp.zeros((1,), jnp.int32))


def _preload(ep_in, epilogue, *, n_rows, c0, bn, cmask, heads):
    """The epilogue's inputs that no other program writes, per row: the residual's columns
    [c0, c0 + bn) (cmask: those within N), or the rope's cos and sin with the head norms' two
    halves."""
    rows = [jnp.int32(r) for r in range(n_rows)]  # (interpret mode takes array indices only)
    if epilogue == "residual":
        res_ref, = ep_in
        return [plgpu_triton.load(res_ref.at[r, pl.ds(c0, bn)], mask=cmask, other=0.0)
                for r in rows]
    if epilogue == "silu":
        return None
    cos_ref, sin_ref, qn_ref, kn_ref = ep_in
    half = heads["d"] // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    rope = [(plgpu_triton.load(cos_ref.at[r, lo]), plgpu_triton.load(sin_ref.at[r, lo]))
            for r in rows]
    norms = None
    if heads["qk_norm"]:
        norms = [[plgpu_triton.load(ref.at[at]).astype(jnp.float32) for at in (lo, hi)]
                 for ref in (qn_ref, kn_ref)]
    return rope, norms


def _epilogue(o_refs, ss_ref, pre, ep_out, *, j, n_rows, n_splits, k, n, bn, normed, epilogue,
              eps, heads):
    """Column block j's products (split sums times the norm's row scale, rounded to the
    activation dtype as the unfused path rounds them), then the epilogue, row by row. Each
    row's loads all come before its first sum, so they are one round trip, not one each."""
    sp = max(2, pow2(n_splits))
    smask = jnp.arange(sp) < n_splits
    f32 = jnp.float32
    dt = ep_out[0].dtype

    def partials(o_ref, r, off, width):  # columns [off, off + width) of the block
        cm = j * bn + off + jnp.arange(width) < n
        return plgpu_triton.load(o_ref.at[j, pl.ds(0, sp), r, pl.ds(off, width)],
                                 mask=smask[:, None] & cm[None, :], other=0.0)

    def total(p, scale):
        return (jnp.sum(p, axis=0) * scale).astype(dt).astype(f32)

    c0 = j * bn
    cmask = c0 + jnp.arange(bn) < n
    for row in range(n_rows):
        r = jnp.int32(row)  # (interpret mode takes array indices only)
        if normed:
            sq = plgpu_triton.load(ss_ref.at[j, pl.ds(0, sp), r], mask=smask, other=0.0)
        if epilogue == "heads":
            d = heads["d"]
            parts = [(partials(o_refs[0], r, i * d, d // 2),
                      partials(o_refs[0], r, i * d + d // 2, d // 2)) for i in range(bn // d)]
        else:
            parts = [partials(o_ref, r, 0, bn) for o_ref in o_refs]
        scale = lax.rsqrt(jnp.sum(sq) / k + eps) if normed else 1.0
        if epilogue == "residual":  # x + o(attn) or x + down(h)
            y = total(parts[0], scale)
            plgpu_triton.store(ep_out[0].at[r, pl.ds(c0, bn)],
                               (pre[row].astype(f32) + y).astype(dt), mask=cmask)
        elif epilogue == "silu":  # silu(gate) * up
            g, u = (total(p, scale) for p in parts)
            plgpu_triton.store(ep_out[0].at[r, pl.ds(c0, bn)],
                               (g / (1.0 + jnp.exp(-g)) * u).astype(dt), mask=cmask)
        else:
            rope, norms = pre
            _heads([(total(a, scale), total(b, scale)) for a, b in parts], rope[row], norms,
                   ep_out, r, j, bn=bn, eps=eps, **heads)


def _heads(halves, rope, norms, ep_out, r, j, *, bn, eps, hq, hkv, d, qk_norm):
    """The heads of column block j (whole heads: bn is a multiple of d) for row r, from their
    halves' products: q and k heads RMS-normed per head (norms: the q and k norms' halves) and
    rotated (rotate-half, rope: cos and sin), v heads as they are (`heads_gpu`)."""
    q_out, k_out, v_out = ep_out
    half = d // 2
    f32 = jnp.float32
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    cos, sin = rope
    every = jnp.arange(half) >= 0
    for i, (x1, x2) in enumerate(halves):
        h = j * (bn // d) + i
        is_q, is_k = h < hq, (h >= hq) & (h < hq + hkv)
        is_v = (h >= hq + hkv) & (h < hq + 2 * hkv)  # (a last block may pass the heads)
        y1, y2 = x1, x2
        if qk_norm:
            qn, kn = norms
            w1, w2 = jnp.where(is_q, qn[0], kn[0]), jnp.where(is_q, qn[1], kn[1])
            inv = lax.rsqrt((jnp.sum(x1 * x1) + jnp.sum(x2 * x2)) / d + eps)
            y1 = (y1 * inv * w1).astype(q_out.dtype).astype(f32)
            y2 = (y2 * inv * w2).astype(q_out.dtype).astype(f32)
        rot1 = (y1 * cos - y2 * sin).astype(q_out.dtype)
        rot2 = (y2 * cos + y1 * sin).astype(q_out.dtype)
        for out, keep, at, a, b in (
                (q_out, is_q, jnp.minimum(h, hq - 1), rot1, rot2),
                (k_out, is_k, jnp.clip(h - hq, 0, hkv - 1), rot1, rot2),
                (v_out, is_v, jnp.clip(h - hq - hkv, 0, hkv - 1), x1.astype(q_out.dtype),
                 x2.astype(q_out.dtype))):
            plgpu_triton.store(out.at[r, at, lo], a, mask=every & keep)
            plgpu_triton.store(out.at[r, at, hi], b, mask=every & keep)


def _fit(cfg: Config, rows: int, n_w: int, x_bytes: int, w_bytes: int) -> Config:
    """A config whose pipelined tiles fit in shared memory: fewer stages (down to 2), then a
    smaller block_k (float32 weights, two weights)."""
    cfg = dataclasses.replace(cfg, block_k=max(16, cfg.block_k))
    while True:
        stage = cfg.block_k * (rows * x_bytes + n_w * cfg.block_n * w_bytes)
        if stage * cfg.num_stages <= _SMEM_BYTES:
            return cfg
        if cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 16:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        else:
            return dataclasses.replace(cfg, num_stages=1)


def _setup(x, weights, config):
    """The checked shapes and the config fitted to them: (cfg, padded rows, K per split,
    splits)."""
    n_rows, k = x.shape
    if n_rows > MAX_ROWS:
        raise ValueError(f"skinny_matmul takes at most {MAX_ROWS} rows, got {n_rows}")
    shape = weights[0].shape
    if any(w.shape != shape for w in weights) or len(weights) not in (1, 2):
        raise ValueError(f"expected one or two weights of one shape, got "
                         f"{[w.shape for w in weights]}")
    if shape[0] != k:
        raise ValueError(f"x [{n_rows}, {k}] does not match weight {shape}")
    n = shape[1]
    cfg = config or default_config(n, k, n_rows)
    rows = pow2(n_rows) if cfg.mode != "dot" else max(_MIN_ROWS, pow2(n_rows))
    cfg = dataclasses.replace(cfg, block_n=min(cfg.block_n, max(16, pow2(n))),
                              block_k=min(cfg.block_k, max(16, pow2(k))))
    cfg = _fit(cfg, rows, len(weights), x.dtype.itemsize, weights[0].dtype.itemsize)
    k_split, n_splits = plan(n, k, cfg)
    return cfg, rows, k_split, n_splits


def _call(x, weights, norm, cfg, rows, k_split, n_splits, *, interpret, epilogue=None,
          extra_in=(), extra_out=(), sync=None, eps=0.0, heads=None, launch_dependents=None,
          phase_stamps=False):
    n_rows, k = x.shape
    stamp = phase_stamps and epilogue is not None and not interpret
    n = weights[0].shape[1]
    n_blocks = pl.cdiv(n, cfg.block_n)
    normed = norm is not None
    kernel = functools.partial(
        _kernel, n_w=len(weights), rows=rows, n_rows=n_rows, k=k, n=n, bn=cfg.block_n,
        bk=cfg.block_k, k_split=k_split, n_splits=n_splits, normed=normed,
        precision=dot_precision(weights[0].dtype), mode=cfg.mode, epilogue=epilogue, eps=eps,
        heads=heads, interpret=interpret, signal=signals_dependents(launch_dependents, interpret),
        stamp=stamp)
    # with the epilogue each column block's partials and sums of squares are a region of
    # whole 128-byte lines of their own, so no cache line mixes two blocks' data
    out = [jax.ShapeDtypeStruct((n_splits, n_rows, n) if epilogue is None else
                                (n_blocks, n_splits, n_rows, cfg.block_n), jnp.float32)] * len(weights)
    if normed:
        out.append(jax.ShapeDtypeStruct((n_splits, n_rows) if epilogue is None else
                                        (n_blocks, max(32, pow2(n_splits)), n_rows),
                                        jnp.float32))
    args = [x, norm if normed else jnp.zeros((1,), x.dtype), *weights]
    aliases = {}
    if epilogue is not None:
        if n_blocks > SYNC_SIZE:
            raise ValueError(f"{n_blocks} column blocks exceed the {SYNC_SIZE} counters")
        if sync is None or sync.shape != (SYNC_SIZE,) or sync.dtype != jnp.int32:
            raise ValueError(f"sync must be int32 [{SYNC_SIZE}] zeros (new_sync()), got "
                             f"{None if sync is None else (sync.shape, sync.dtype)}")
        aliases = {len(args): len(out) + len(extra_out)}
        args += [sync, *extra_in]
        out += [*extra_out, jax.ShapeDtypeStruct(sync.shape, sync.dtype)]
        if stamp:
            out.append(jax.ShapeDtypeStruct((n_blocks * n_splits, 4, 16), jnp.int32))
    return pl.pallas_call(
        kernel, grid=(n_blocks, n_splits), out_shape=out, input_output_aliases=aliases,
        compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps,
                                                    num_stages=cfg.num_stages),
        interpret=interpret, name="sfi_skinny_matmul",
    )(*args)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def skinny_matmul_partials(x, weights, norm=None, *, interpret=False, config=None):
    """Float32 partial sums of x [R, K] times each weight [K, N] (one or two of one shape):
    a tuple of [splits, R, N], one per weight, whose sums over axis 0 are the products.

    With `norm` [K] the rows are multiplied by it before the product, and the tuple ends with
    the rows' float32 sums of squares per split [splits, R]: the RMSNorm's row scale
    rsqrt(sum / K + eps) applies to the summed product (`skinny_matmul.skinny_matmul`).
    config: a Config (None: `default_config` for the weight's shape)."""
    cfg, rows, k_split, n_splits = _setup(x, weights, config)
    return tuple(_call(x, weights, norm, cfg, rows, k_split, n_splits, interpret=interpret))


def new_sync():
    """Counters for `skinny_matmul_fused`: zeros, passed from call to call (each call leaves
    them zero again), so no call clears them with a launch of its own."""
    return jnp.zeros((SYNC_SIZE,), jnp.int32)


@functools.partial(jax.jit, static_argnames=("epilogue", "eps", "num_q_heads", "num_kv_heads",
                                             "interpret", "config", "programs_per_sm",
                                             "launch_dependents", "phase_stamps"))
def skinny_matmul_fused(x, weights, norm, sync, *, epilogue, residual=None, cos=None, sin=None,
                        q_norm=None, k_norm=None, num_q_heads=None, num_kv_heads=None, eps=1e-6,
                        interpret=False, config=None, programs_per_sm=None,
                        launch_dependents=None, phase_stamps=False):
    """x [R, K] (R <= FUSED_MAX_ROWS; RMS-normed by `norm` [K] first, when not None) times the
    weights, with the split sums added up by each column block's last program (a counter per
    block in `sync`), which then applies the epilogue, so no XLA fusion runs after the matmul:

    "residual": residual [R, N] + x @ w -> (out [R, N], sync)
    "silu": silu(x @ w_gate) * (x @ w_up) -> (h [R, N], sync)
    "heads": x @ wqkv split into heads, q and k heads RMS-normed by q_norm / k_norm (None: no
        per-head norms) and rotated by cos, sin float32 [R, D/2] (`heads_gpu`) ->
        (q [R, Hq, D], k [R, Hkv, D], v, sync)

    Each product is rounded to x's dtype before the epilogue, as the unfused path rounds it.
    sync: int32 [SYNC_SIZE] zeros (`new_sync`), returned zero again (updated in place).
    config: a `Config` (None: `default_config` for the weight's shape); programs_per_sm: a
    sweep point, the default config's grid aim in programs per SM instead of its tuned one;
    launch_dependents: see `triton_lowering.signals_dependents` (None: on Hopper or newer).
    phase_stamps (a diagnostic, on the GPU): the outputs end with every program's
    %globaltimer stamps int32 [programs, 4, 16] (the 16 copies alike): its first instruction,
    its K loop's end, its counter bump, and (the block's last program) its epilogue's stores
    made visible."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    n_rows = x.shape[0]
    if n_rows > FUSED_MAX_ROWS:
        raise ValueError(f"skinny_matmul_fused takes at most {FUSED_MAX_ROWS} rows, got {n_rows}")
    if len(weights) != (2 if epilogue == "silu" else 1):
        raise ValueError(f"epilogue {epilogue!r} takes {2 if epilogue == 'silu' else 1} "
                         f"weight(s), got {len(weights)}")
    if config is None and programs_per_sm is not None:
        config = dataclasses.replace(default_config(weights[0].shape[1], x.shape[1], n_rows),
                                     programs=programs_per_sm * _NUM_SMS)
    cfg, rows, k_split, n_splits = _setup(x, weights, config)
    n = weights[0].shape[1]
    heads = None
    if epilogue == "residual":
        if residual is None or residual.shape != (n_rows, n):
            raise ValueError(f"residual must be [{n_rows}, {n}], got "
                             f"{None if residual is None else residual.shape}")
        extra_in = (residual,)
        extra_out = (jax.ShapeDtypeStruct((n_rows, n), residual.dtype),)
    elif epilogue == "silu":
        extra_in, extra_out = (), (jax.ShapeDtypeStruct((n_rows, n), x.dtype),)
    else:
        hq, hkv = num_q_heads, num_kv_heads
        d = n // (hq + 2 * hkv)
        if d * (hq + 2 * hkv) != n or d < 16 or d & (d - 1):
            raise ValueError(f"q/k/v width {n} is not {hq + 2 * hkv} heads of a power-of-two "
                             "dim >= 16")
        if cos is None or cos.shape != (n_rows, d // 2) or sin is None or sin.shape != cos.shape:
            raise ValueError(f"cos and sin must be [{n_rows}, {d // 2}]")
        cfg = dataclasses.replace(cfg, block_n=max(cfg.block_n, d))  # whole heads per block
        cfg = _fit(cfg, rows, 1, x.dtype.itemsize, weights[0].dtype.itemsize)
        k_split, n_splits = plan(n, x.shape[1], cfg)
        qk_norm = q_norm is not None
        if not qk_norm:
            q_norm = k_norm = jnp.ones((d,), x.dtype)
        heads = dict(hq=hq, hkv=hkv, d=d, qk_norm=qk_norm)
        extra_in = (cos.astype(jnp.float32), sin.astype(jnp.float32), q_norm, k_norm)
        extra_out = tuple(jax.ShapeDtypeStruct((n_rows, h, d), x.dtype) for h in (hq, hkv, hkv))
    res = _call(x, weights, norm, cfg, rows, k_split, n_splits, interpret=interpret,
                epilogue=epilogue, extra_in=extra_in, extra_out=extra_out, sync=sync, eps=eps,
                heads=heads, launch_dependents=launch_dependents, phase_stamps=phase_stamps)
    return tuple(res[len(weights) + (norm is not None):])


@dataclasses.dataclass(frozen=True)
class KMajorConfig:
    """Tiles of the K-major kernel: block_n weight rows (output columns) per program, each
    read over the whole of K in block_k steps. The defaults are the H200 sweeps' best at every
    weight size measured, qwen3-0.6b's and qwen3-4b's (kmajor.md in docs/findings.md)."""

    block_n: int = 2
    block_k: int = 1024
    num_warps: int = 4
    num_stages: int = 1
    programs: int = 8 * _NUM_SMS  # the grid: at most that many programs, each walking its
    # column blocks in one loop (the loads run on across blocks); 0: one program per block
    prefetch: int = 1  # tiles each program loads ahead of the one it multiplies (its own
    # software pipeline, whatever Triton's pipeliner makes of the loop); 0: none



def _kmajor_kernel(x_ref, nw_ref, *refs, n_w, rows, n_rows, k, n, bn, bk, normed, epilogue,
                   eps, signal, n_prog, prefetch):
    """Program p: output columns [b * bn, (b + 1) * bn) for blocks b = p, p + n_prog, ... over
    the whole of K (weights [N, K]: each weight row one contiguous read), in one loop over
    (block, K step) so the loads run on across blocks; a block's last K step applies the
    epilogue to its own columns: no partial sums, no counters. With `prefetch` the loop
    carries the next steps' tiles, so each program keeps that many loads in flight while it
    multiplies."""
    w_refs, refs = refs[:n_w], refs[n_w:]
    res_ref = refs[0] if epilogue == "residual" else None
    out_ref = refs[-1]
    p = pl.program_id(0)
    f32 = jnp.float32
    dt = out_ref.dtype
    rmask = jnp.arange(rows) < n_rows
    idx = jnp.arange(bk)
    ks = pl.cdiv(k, bk)
    nb = pl.cdiv(n, bn)
    mine = lax.div(nb - p + n_prog - 1, jnp.int32(n_prog))  # (lax: jnp's // and % on signed
    # ints do not lower to Triton here)
    steps = mine * ks

    def where(t):  # step t's K step, column block, and their masks
        kk = lax.rem(t, jnp.int32(ks))
        blk = p + lax.div(t, jnp.int32(ks)) * n_prog
        kmask = kk * bk + idx < k
        cmask = (blk * bn + jnp.arange(bn) < n) & (t < steps)
        return kk, blk, kmask, cmask

    def tile(t):  # step t's loads: the rows' block, the norm's, the weights', the residual's
        kk, blk, kmask, cmask = where(t)
        k0 = kk * bk
        xb = plgpu_triton.load(x_ref.at[pl.ds(0, rows), pl.ds(k0, bk)],
                               mask=rmask[:, None] & kmask[None, :], other=0.0)
        nw = (plgpu_triton.load(nw_ref.at[pl.ds(k0, bk)], mask=kmask, other=0.0) if normed
              else None)
        wbs = tuple(plgpu_triton.load(w_ref.at[pl.ds(blk * bn, bn), pl.ds(k0, bk)],
                                      mask=cmask[:, None] & kmask[None, :], other=0.0)
                    for w_ref in w_refs)
        res = None
        if epilogue == "residual":  # loaded with the block's last step only
            res = plgpu_triton.load(res_ref.at[pl.ds(0, rows), pl.ds(blk * bn, bn)],
                                    mask=rmask[:, None] & (cmask & (kk == ks - 1))[None, :],
                                    other=0.0)
        return xb, nw, wbs, res

    queue = tuple(tile(jnp.int32(i)) for i in range(prefetch))  # first loads before the norm
    scale = 1.0
    if normed:  # the whole of each row in one load (the hidden size is small)
        kp = pow2(k)
        xr = plgpu_triton.load(x_ref.at[pl.ds(0, rows), pl.ds(0, kp)],
                               mask=rmask[:, None] & (jnp.arange(kp) < k)[None, :], other=0.0)
        xf = xr.astype(f32)
        scale = lax.rsqrt(jnp.sum(xf * xf, axis=1) / k + eps)[:, None]

    def body(t, carry):
        accs, queue = carry
        if prefetch:
            cur, queue = queue[0], queue[1:] + (tile(t + prefetch),)
        else:
            cur = tile(t)
        xb, nw, wbs, res = cur
        kk, blk, _, cmask = where(t)
        if normed:
            xb = (xb.astype(f32) * nw.astype(f32)[None, :]).astype(x_ref.dtype)
        xr = xb.astype(w_refs[0].dtype).astype(f32)[:, None, :]
        new = [acc + xr * wb.astype(f32)[None] for wb, acc in zip(wbs, accs)]
        last = kk == ks - 1

        @pl.when(last)
        def _():
            ys = [(jnp.sum(a, axis=2) * scale).astype(dt).astype(f32) for a in new]
            if epilogue == "residual":
                y = res.astype(f32) + ys[0]
            elif epilogue == "silu":
                g, u = ys
                y = g / (1.0 + jnp.exp(-g)) * u
            else:
                y = ys[0]
            sig = dependents_mask(bn, signal, jnp.sum(y, axis=0))
            plgpu_triton.store(out_ref.at[pl.ds(0, rows), pl.ds(blk * bn, bn)], y.astype(dt),
                               mask=rmask[:, None] & (cmask & sig)[None, :])

        return tuple(jnp.where(last, 0.0, a) for a in new), queue

    zeros = jnp.zeros((rows, bn, bk), f32)
    lax.fori_loop(0, steps, body, (tuple(zeros for _ in w_refs), queue))


@functools.partial(jax.jit, static_argnames=("epilogue", "eps", "interpret", "config",
                                             "launch_dependents"))
def skinny_matmul_kmajor(x, weights_t, norm=None, *, epilogue=None, residual=None, eps=1e-6,
                         interpret=False, config=None, launch_dependents=None):
    """x [R, K] (RMS-normed by `norm` first, when given) times the transposed weights
    `weights_t` (one or two [N, K]), the product rounded to x's dtype, then the epilogue:
    None (the product), "residual" (residual [R, N] + product) or "silu" (silu(gate) * up,
    two weights) -> [R, N] in x's dtype. config: a `KMajorConfig` (None: its defaults);
    launch_dependents as in `skinny_matmul_fused`."""
    if epilogue not in (None, "residual", "silu"):
        raise ValueError(f"epilogue must be None, 'residual' or 'silu', got {epilogue!r}")
    n_rows, k = x.shape
    n = weights_t[0].shape[0]
    if any(w.shape != (n, k) for w in weights_t):
        raise ValueError(f"weights_t must be [N, {k}], got {[w.shape for w in weights_t]}")
    if n_rows > FUSED_MAX_ROWS:
        raise ValueError(f"skinny_matmul_kmajor takes at most {FUSED_MAX_ROWS} rows, got {n_rows}")
    if len(weights_t) != (2 if epilogue == "silu" else 1):
        raise ValueError(f"epilogue {epilogue!r} takes {2 if epilogue == 'silu' else 1} weight(s)")
    cfg = config or KMajorConfig()
    rows = pow2(n_rows)
    bk = min(cfg.block_k, max(16, pow2(k)))
    normed = norm is not None
    args = [x, norm if normed else jnp.zeros((1,), x.dtype), *weights_t]
    if epilogue == "residual":
        if residual is None or residual.shape != (n_rows, n):
            raise ValueError(f"residual must be [{n_rows}, {n}]")
        args.append(residual)
    common = dict(n_w=len(weights_t), rows=rows, n_rows=n_rows, k=k, n=n, bn=cfg.block_n,
                  bk=bk, normed=normed, epilogue=epilogue, eps=eps,
                  signal=signals_dependents(launch_dependents, interpret),
                  prefetch=cfg.prefetch)
    n_blocks = pl.cdiv(n, cfg.block_n)
    n_prog = min(n_blocks, cfg.programs) if cfg.programs else n_blocks
    return pl.pallas_call(
        functools.partial(_kmajor_kernel, n_prog=n_prog, **common), grid=(n_prog,),
        out_shape=jax.ShapeDtypeStruct((n_rows, n), x.dtype),
        compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps,
                                                    num_stages=cfg.num_stages),
        interpret=interpret, name="sfi_kmajor_matmul",
    )(*args)
