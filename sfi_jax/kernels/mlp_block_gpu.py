"""A decode step's attention output and MLP in one persistent kernel (Pallas with the Triton
lowering), for a few rows: x + o(attn), its RMSNorm, the gate/up product with the SiLU
product, x + down(h).

At one row each of these matmuls streams its weight in a few microseconds, and the boundaries
between three kernels (a launch, the grid filling the memory pipe, its drain) cost as much as
a good part of the bytes. Here one grid of programs that stay resident runs the three
matmuls as phases. Inside a phase a program takes (column block, K split) tasks; each block's
last split (a counter per block, as in `skinny_matmul_gpu.skinny_matmul_fused`) adds the
splits up, applies the phase's epilogue and bumps the phase's counter; a program starts the
next phase once that counter says every block is done, polling it. Before it polls, a program
loads the first weight tile of its next task, so the memory pipe does not drain at the
phase boundary. Every counter is left zero at the end (the last program to leave resets the
phase counters).

The programs must all be resident at once (a program waits for all the others): the grid is
at most `programs_per_sm` per SM, and the poll gives up after SPIN_LIMIT reads rather than
hang (the diagnostics compare every output). In interpret mode the programs run one after
another, so there the phases are the grid's first axis and every poll finds its phase done.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sfi_jax.kernels import skinny_matmul_gpu as sm
from sfi_jax.kernels.triton_lowering import NUM_SMS, plgpu_triton

MAX_ROWS = sm.FUSED_MAX_ROWS
SPIN_LIMIT = 1 << 22
_N_PHASE_COUNTERS = 4  # the o and gate/up phases done, the down phase done, programs left


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """programs_per_sm: the grid (they must all fit on an SM at once with these warps and
    stages); prefetch_tiles: weight tiles of its next task a program loads (into L2) before it
    waits for a phase; block_n, block_k: every phase's tile in place of the tuned ones (small
    shapes in tests); programs: the grid in place of programs_per_sm's; max_splits: at most
    this many K splits per phase (1: a program owns its columns, no partial sums to add up)."""

    programs_per_sm: int = 2
    num_warps: int = 4
    num_stages: int = 3
    prefetch_tiles: int = 2
    block_n: int | None = None
    block_k: int | None = None
    programs: int | None = None
    max_splits: int | None = None


def parse_config(text: str) -> BlockConfig:
    """"programs_per_sm:num_warps:num_stages:prefetch_tiles[:block_n[:max_splits]]" (block_n
    0: the tuned tiles) -> BlockConfig: the sweeps' notation."""
    try:
        vals = [int(v) for v in text.split(":")]
        if len(vals) not in (4, 5, 6):
            raise ValueError
    except ValueError:
        raise ValueError(f"block config {text!r}: expected programs_per_sm:warps:stages:"
                         "prefetch_tiles[:block_n[:max_splits]]") from None
    pps, warps, stages, tiles, bn, splits = vals + [0] * (6 - len(vals))
    return BlockConfig(programs_per_sm=pps, num_warps=warps, num_stages=stages,
                       prefetch_tiles=tiles, block_n=bn or None, max_splits=splits or None)


# The config a call without one takes; a sweep point that bench_e2e's --block-config sets
# before anything is traced
DEFAULT_CONFIG = BlockConfig()


@dataclasses.dataclass(frozen=True)
class _Phase:
    """One matmul of the block: [k, n] weights in tiles bn x bk, `splits` K splits of k_split."""

    n: int
    k: int
    bn: int
    bk: int
    mode: str
    k_split: int
    splits: int
    n_w: int

    @property
    def blocks(self):
        return -(-self.n // self.bn)

    @property
    def tasks(self):
        return self.blocks * self.splits


def _phase(n, k, rows, n_w, programs, x_bytes, w_bytes, block: BlockConfig) -> _Phase:
    """The tuned skinny-matmul tile for this shape, with at most one task per program (a second
    round of tasks would double the phase's time)."""
    stages = block.num_stages
    cfg = sm.default_config(n, k, rows)
    if block.block_n:
        cfg = dataclasses.replace(cfg, block_n=block.block_n)
    if block.block_k:
        cfg = dataclasses.replace(cfg, block_k=block.block_k)
    pad = sm._pow2(rows) if cfg.mode != "dot" else max(sm._MIN_ROWS, sm._pow2(rows))
    cfg = dataclasses.replace(cfg, block_n=min(cfg.block_n, max(16, sm._pow2(n))),
                              block_k=min(cfg.block_k, max(16, sm._pow2(k))), num_stages=stages)
    cfg = sm._fit(cfg, pad, n_w, x_bytes, w_bytes)
    blocks = -(-n // cfg.block_n)
    want = max(1, min(programs // blocks, -(-k // cfg.block_k), block.max_splits or k))
    k_split = -(-(-(-k // want)) // cfg.block_k) * cfg.block_k
    return _Phase(n=n, k=k, bn=cfg.block_n, bk=cfg.block_k, mode=cfg.mode, k_split=k_split,
                  splits=-(-k // k_split), n_w=n_w)


def _wait(sync_ref, at, target, interpret):
    """Poll counter `at` (acquiring atomic reads) until it reaches target, then a barrier, so
    the blocks' stores are visible to every thread's loads after it."""
    def cond(c):
        return (c[0] < target) & (c[1] < SPIN_LIMIT)

    def read():  # (an atomic: a plain or volatile load may be hoisted out of the loop)
        return plgpu_triton.atomic_add(sync_ref, (at,), at * 0)

    lax.while_loop(cond, lambda c: (read(), c[1] + 1), (read(), at * 0))
    if not interpret:  # every thread's loads after the one thread's acquire
        plgpu_triton.debug_barrier()


def _kernel(attn_ref, wo_ref, res_ref, nw_ref, wg_ref, wu_ref, wd_ref, _sync_in, part_o, part_g,
            part_u, part_d, ss_ref, h1_ref, h2_ref, out_ref, sync_ref, *, phases, rows, n_rows,
            programs, eps, prefetch_tiles, interpret):
    f32 = jnp.float32
    dt = out_ref.dtype
    po, pgu, pd = phases
    base = (0, po.blocks, po.blocks + pgu.blocks)  # each phase's block counters
    ph_at = sm.SYNC_SIZE - _N_PHASE_COUNTERS  # the phases' counters, then programs left
    pid = pl.program_id(1)
    zero = pid * 0  # indices as traced values (interpret mode's loops take no constants)
    pow_o = max(2, sm._pow2(po.blocks))

    def product(w, ph, j, row, accs, scale=1.0):
        """Weight w's product for row `row` of column block j: its splits' partials added up,
        or (one split) the task's own accumulator."""
        cm = j * ph.bn + jnp.arange(ph.bn) < ph.n
        if accs is None:
            sp = max(2, sm._pow2(ph.splits))
            p = plgpu_triton.load(specs[phases.index(ph)][4][w].at[
                j, pl.ds(0, sp), zero + row, pl.ds(0, ph.bn)],
                mask=(jnp.arange(sp) < ph.splits)[:, None] & cm[None, :], other=0.0)
            y = jnp.sum(p, axis=0)
        else:
            acc = accs[w]
            y = jnp.sum(jnp.where(jnp.arange(acc.shape[0])[:, None] == row, acc, 0.0), axis=0)
        return (y * scale).astype(dt).astype(f32), cm

    def epilogue_o(j, accs):  # h1 = x + o(attn), and its sums of squares per block for the norm
        for row in range(n_rows):
            r = zero + row
            y, cm = product(0, po, j, row, accs)
            at = (r, pl.ds(j * po.bn, po.bn))
            res = plgpu_triton.load(res_ref.at[at], mask=cm, other=0.0)
            h1 = (res.astype(f32) + y).astype(dt)
            plgpu_triton.store(h1_ref.at[at], h1, mask=cm)
            h1f = jnp.where(cm, h1.astype(f32), 0.0)
            plgpu_triton.store(ss_ref.at[j, r], jnp.sum(h1f * h1f))

    def epilogue_gu(j, accs):  # silu(gate) * up of the normed h1
        for row in range(n_rows):
            r = zero + row
            ss = plgpu_triton.load(ss_ref.at[pl.ds(0, pow_o), r],
                                   mask=jnp.arange(pow_o) < po.blocks, other=0.0)
            scale = lax.rsqrt(jnp.sum(ss) / po.n + eps)
            g, cm = product(0, pgu, j, row, accs, scale)
            u, _ = product(1, pgu, j, row, accs, scale)
            plgpu_triton.store(h2_ref.at[r, pl.ds(j * pgu.bn, pgu.bn)],
                               (g / (1.0 + jnp.exp(-g)) * u).astype(dt), mask=cm)

    def epilogue_d(j, accs):  # h1 + down(h2)
        for row in range(n_rows):
            r = zero + row
            y, cm = product(0, pd, j, row, accs)
            at = (r, pl.ds(j * pd.bn, pd.bn))
            h1 = plgpu_triton.load(h1_ref.at[at], mask=cm, other=0.0)
            plgpu_triton.store(out_ref.at[at], (h1.astype(f32) + y).astype(dt), mask=cm)

    specs = ((po, attn_ref, None, (wo_ref,), (part_o,), epilogue_o),
             (pgu, h1_ref, nw_ref, (wg_ref, wu_ref), (part_g, part_u), epilogue_gu),
             (pd, h2_ref, None, (wd_ref,), (part_d,), epilogue_d))

    def run_phase(i):
        ph, x_ref, nw, w_refs, part_refs, epilogue = specs[i]
        pad = sm._pow2(rows) if ph.mode != "dot" else max(sm._MIN_ROWS, sm._pow2(rows))
        first = []
        if i > 0 and not interpret:  # the first tiles of this program's task, into L2
            j0, s0 = jnp.minimum(pid, ph.tasks - 1) // ph.splits, pid % ph.splits
            cc = j0 * ph.bn + jnp.arange(ph.bn)
            for t in range(prefetch_tiles):
                k0 = s0 * ph.k_split + t * ph.bk
                kk = k0 + jnp.arange(ph.bk)
                m = (kk < jnp.minimum(ph.k, (s0 + 1) * ph.k_split))[:, None] & (cc < ph.n)[None, :]
                first += [plgpu_triton.load(w.at[pl.ds(k0, ph.bk), pl.ds(j0 * ph.bn, ph.bn)],
                                            mask=m, other=0.0) for w in w_refs]
        if i > 0:
            _wait(sync_ref, zero + ph_at + i - 1, specs[i - 1][0].blocks, interpret)
        if first:  # a use after the wait, so the loads are not dropped (it never stores)
            keep = sum(jnp.sum(t.astype(f32)) for t in first)
            plgpu_triton.store(ss_ref.at[zero + pow_o, zero], keep, mask=pid < 0)

        def task(t, carry):
            j, s = t // ph.splits, t % ph.splits
            accs, _ = sm.block_product(x_ref, nw, w_refs, j, s, rows=pad, n_rows=n_rows,
                                       k=ph.k, n=ph.n, bn=ph.bn, bk=ph.bk, k_split=ph.k_split,
                                       normed=nw is not None,
                                       precision=sm._precision(w_refs[0].dtype), mode=ph.mode)
            def finish(accs):  # the block's epilogue, then the phase's counter
                epilogue(j, accs)
                if not interpret:
                    plgpu_triton.debug_barrier()
                plgpu_triton.atomic_add(sync_ref, (zero + ph_at + i,), zero + 1)

            if ph.splits == 1:  # the whole K: this program finishes its block
                finish(accs)
                return carry
            cm = j * ph.bn + jnp.arange(ph.bn) < ph.n
            rm = jnp.arange(pad) < n_rows
            for part, acc in zip(part_refs, accs):
                plgpu_triton.store(part.at[j, s, pl.ds(0, pad), pl.ds(0, ph.bn)], acc,
                                   mask=rm[:, None] & cm[None, :])
            if not interpret:
                plgpu_triton.debug_barrier()
            done = plgpu_triton.atomic_add(sync_ref, (base[i] + j,), zero + 1)

            @pl.when(done == ph.splits - 1)
            def _():
                plgpu_triton.atomic_add(sync_ref, (base[i] + j,), zero + -ph.splits)
                finish(None)
            return carry

        mine = jnp.maximum(ph.tasks - pid + programs - 1, 0) // programs
        lax.fori_loop(0, mine, lambda it, c: task(pid + it * programs, c), 0)

    def leave():  # the last program out puts the phase counters back to zero
        left = plgpu_triton.atomic_add(sync_ref, (zero + ph_at + 3,), zero + 1)

        @pl.when(left == programs - 1)
        def _():
            for i, ph in enumerate(phases):
                plgpu_triton.atomic_add(sync_ref, (zero + ph_at + i,), zero + -ph.blocks)
            plgpu_triton.atomic_add(sync_ref, (zero + ph_at + 3,), zero + -programs)

    if interpret:  # one phase per grid row, in order
        for i in range(3):
            pl.when(pl.program_id(0) == i)(functools.partial(run_phase, i))
        pl.when(pl.program_id(0) == 2)(leave)
    else:
        for i in range(3):
            run_phase(i)
        leave()


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "config"))
def mlp_block(attn, wo, residual, mlp_norm, w_gate, w_up, w_down, sync, *, eps=1e-6,
              interpret=False, config=None):
    """residual [R, H] + o(attn [R, Ko]) -> h1; h1 + down(silu(gate(n)) * up(n)) with n the
    RMSNorm of h1 by mlp_norm [H] -> (out [R, H], sync), R <= MAX_ROWS.

    Each product is rounded to the activation dtype as the unfused path rounds it; the norm's
    weight multiplies h1 on its way into gate/up and its row scale the summed products
    (`skinny_matmul_gpu`). sync: int32 [SYNC_SIZE] zeros (`skinny_matmul_gpu.new_sync`),
    returned zero again. config: a BlockConfig (None: its defaults)."""
    cfg = config or DEFAULT_CONFIG
    n_rows, ko = attn.shape
    h = residual.shape[1]
    inter = w_gate.shape[1]
    if n_rows > MAX_ROWS:
        raise ValueError(f"mlp_block takes at most {MAX_ROWS} rows, got {n_rows}")
    for name, arr, shape in (("wo", wo, (ko, h)), ("residual", residual, (n_rows, h)),
                             ("mlp_norm", mlp_norm, (h,)), ("w_gate", w_gate, (h, inter)),
                             ("w_up", w_up, (h, inter)), ("w_down", w_down, (inter, h))):
        if arr.shape != shape:
            raise ValueError(f"{name} must be {shape} for attn {attn.shape} and residual "
                             f"[{n_rows}, {h}], got {arr.shape}")
    if sync.shape != (sm.SYNC_SIZE,) or sync.dtype != jnp.int32:
        raise ValueError(f"sync must be int32 [{sm.SYNC_SIZE}] zeros (new_sync()), got "
                         f"{(sync.shape, sync.dtype)}")
    programs = cfg.programs or cfg.programs_per_sm * NUM_SMS
    xb, wb = residual.dtype.itemsize, wo.dtype.itemsize
    phases = (_phase(h, ko, n_rows, 1, programs, xb, wb, cfg),
              _phase(inter, h, n_rows, 2, programs, xb, wb, cfg),
              _phase(h, inter, n_rows, 1, programs, xb, wb, cfg))
    programs = max(p.tasks for p in phases)  # (no program without a task)
    if sum(p.blocks for p in phases) > sm.SYNC_SIZE - _N_PHASE_COUNTERS:
        raise ValueError(f"{[p.blocks for p in phases]} column blocks exceed the counters")
    rows_pad = max(sm._MIN_ROWS, sm._pow2(n_rows))
    dt = residual.dtype
    sds = jax.ShapeDtypeStruct
    parts = [sds((p.blocks, max(2, sm._pow2(p.splits)), rows_pad, p.bn), jnp.float32)
             for p in (phases[0], phases[1], phases[1], phases[2])]
    out_shape = [*parts, sds((max(2, sm._pow2(phases[0].blocks)) + 1, n_rows), jnp.float32),
                 sds((n_rows, h), dt), sds((n_rows, inter), dt), sds((n_rows, h), dt),
                 sds(sync.shape, sync.dtype)]
    kernel = functools.partial(_kernel, phases=phases, rows=n_rows, n_rows=n_rows,
                               programs=programs, eps=eps, prefetch_tiles=cfg.prefetch_tiles,
                               interpret=interpret)
    res = pl.pallas_call(
        kernel, grid=(3 if interpret else 1, programs), out_shape=out_shape,
        input_output_aliases={7: len(out_shape) - 1},
        compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps,
                                                    num_stages=cfg.num_stages),
        interpret=interpret, name="sfi_mlp_block",
    )(attn.astype(dt), wo, residual, mlp_norm, w_gate, w_up, w_down, sync)
    return res[-2], res[-1]
