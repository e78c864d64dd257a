"""The routed experts of a decode step on NVIDIA Hopper GPUs: Pallas with the Mosaic GPU
lowering (the twin of moe_gpu's per-expert "tokens" layout, Triton).

A decode step's T tokens each pick k experts, so at most L = min(E, T k) experts are touched.
Both kernels run one program per (touched expert, column block): the gate and up kernel
multiplies all T tokens (their rows copied once into shared memory, as in
skinny_matmul_mgpu) by the expert's two weights streamed by TMA through shared-memory slots
into wgmma, then writes SiLU(gate) * up rounded as `models.modeling.moe_mlp` rounds it; the
down kernel multiplies that expert's hidden rows by its down weight. A slot no expert fills
loads and stores nothing, and its rows are never read. The routing weights then sum the L
products per token in one small XLA fusion, so no sort, gather or row-block plan runs
between the router and the kernels.

`supported`: half-precision weights, expert dims multiples of 64, at most 64 tokens (wgmma's
rows) whose rows fit shared memory beside one weight slot. Off a GPU the kernels run in
Mosaic GPU's interpret mode (`attention_mgpu.interpret_params`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sfi_jax.kernels.attention_mgpu import HALF, SMEM_BYTES, compiler_params, interpret_params
from sfi_jax.kernels.common import swiglu_rounded
from sfi_jax.kernels.skinny_matmul_mgpu import (_GRAIN, MAX_ROWS, _divisor_block, rows8_of,
                                                smem_bytes, stream_product)


@dataclasses.dataclass(frozen=True)
class Config:
    """block_n: columns per program (a multiple of 64, halved until it divides the output
    dim); block_k: K per pipeline step (likewise for the inner dim); stages: weight blocks in
    flight (fewer when shared memory is short)."""

    block_n: int = 128
    block_k: int = 64
    stages: int = 4


DEFAULT = Config()


def _plan(rows8, k, n, n_w, config=None):
    """(block_n, block_k, stages) for rows8 rows of K = k times n_w weights [k, n]: the
    config's blocks (halved until they divide) and stages (fewer until one program's shared
    memory fits: skinny_matmul_mgpu.smem_bytes, whose output term, float32 partials, bounds
    this kernel's rounded tile); None where even one stage does not fit (too many rows for
    this K)."""
    cfg = config or DEFAULT
    bn, bk = _divisor_block(cfg.block_n, n), _divisor_block(cfg.block_k, k)
    n_kb = k // bk
    for stages in range(max(1, min(cfg.stages, n_kb)), 0, -1):
        if smem_bytes(rows8, n_kb, bn, bk, stages, n_w) <= SMEM_BYTES:
            return bn, bk, stages
    return None


def supported(x, w_gate, config=None) -> bool:
    """x [T, H] with T <= 64 and expert weights [E, H, I] in half precision, H and I
    multiples of 64, and each kernel's rows and a weight slot within shared memory (all of
    K's rows are held: at H = 2048 up to 40 tokens, on fewer weight slots from 17)."""
    if x.ndim != 2 or w_gate.ndim != 3 or x.shape[1] != w_gate.shape[1]:
        return False
    _, hidden, inter = w_gate.shape
    if not (jnp.dtype(w_gate.dtype) in HALF and 1 <= x.shape[0] <= MAX_ROWS
            and hidden % _GRAIN == 0 and inter % _GRAIN == 0):
        return False
    rows8 = rows8_of(x.shape[0])
    return (_plan(rows8, hidden, inter, 2, config) is not None
            and _plan(rows8, inter, hidden, 1, config) is not None)


def _kernel(ids_ref, x_ref, *refs, n_w, n_experts, rows8, n_kb, bk, bn, stages, x_per_slot):
    """Program (l, j): slot l's expert e = ids[l] (n_experts: none), columns [j * bn, +bn):
    the rows (x [1, rows8, K], or x [L, rows8, K] at l) times the expert's n_w weights
    [E, K, N], SwiGLU-ed when there are two, rounded, to out [L, rows8, N] at l."""
    w_refs, o_ref = refs[:n_w], refs[n_w]
    l, j = lax.axis_index("l"), lax.axis_index("j")
    e = ids_ref[l]
    col = pl.multiple_of(j * bn, bn)
    rows = x_ref.at[l] if x_per_slot else x_ref.at[0]
    dtype = w_refs[0].dtype

    def k0(i):  # a static block index stays a Python int: Mosaic GPU's multiple_of takes values
        return i * bk if isinstance(i, int) else pl.multiple_of(i * bk, bk)

    @pl.when(e < n_experts)
    def _expert():
        accs = stream_product(
            lambda i: rows.at[:, pl.ds(k0(i), bk)],
            [lambda i, w=w: w.at[e, pl.ds(k0(i), bk), pl.ds(col, bn)] for w in w_refs],
            n_kb, steps=n_kb, stages=stages, rows8=rows8, bk=bk, bn=bn, dtype=dtype)
        out = swiglu_rounded(*accs, dtype) if n_w == 2 else accs[0].astype(dtype)

        def store(o_smem):
            o_smem[...] = out
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows8)], o_ref.at[l, :, pl.ds(col, bn)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(store, plgpu.SMEM((64, bn), dtype))


def _expert_matmul(ids, x, weights, n_experts, config, interpret):
    """[L, rows8, N] = per slot, x (shared [1, ...] or per slot [L, ...]) times the slot
    expert's weights [E, K, N] (SwiGLU of two)."""
    _, rows8, k = x.shape
    n = weights[0].shape[2]
    plan = _plan(rows8, k, n, len(weights), config)
    if plan is None:
        raise ValueError(f"mosaic_gpu moe: {rows8} rows of {k} do not fit {SMEM_BYTES} B of "
                         f"shared memory")
    bn, bk, stages = plan
    n_kb = k // bk
    n_slots = ids.shape[0]
    kernel = functools.partial(_kernel, n_w=len(weights), n_experts=n_experts, rows8=rows8,
                               n_kb=n_kb, bk=bk, bn=bn, stages=stages,
                               x_per_slot=x.shape[0] > 1)
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((n_slots, rows8, n), weights[0].dtype),
        grid=(n_slots, n // bn), grid_names=("l", "j"),
        compiler_params=compiler_params(),
        interpret=interpret_params() if interpret else False,
    )(ids, x, *weights)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def token_moe(x, w_gate, w_up, w_down, top_p, top_e, *, interpret=False, config=None):
    """The routed experts of at most 64 tokens: x [T, H]; top_p, top_e [T, k] (routing
    weights and experts); expert weights [E, H, I] (gate, up) and [E, I, H] (down), half
    precision. Returns float32 [T, H] = sum_j top_p[:, j] * expert_{top_e[:, j]}(x), each
    expert's output rounded to the weights' dtype (as `models.modeling.moe_mlp` does)."""
    n_tokens, hidden = x.shape
    n_experts = w_gate.shape[0]
    if not supported(x, w_gate, config) or w_up.shape != w_gate.shape or w_down.shape != (
            n_experts, w_gate.shape[2], hidden):
        raise ValueError(f"mosaic_gpu token_moe takes x [T <= {MAX_ROWS}, H] (all of H's rows "
                         f"in shared memory) and bf16/f16 experts [E, H, I], [E, I, H] with H, "
                         f"I multiples of {_GRAIN}; got x "
                         f"{x.shape}, gate {w_gate.shape} {w_gate.dtype}, up {w_up.shape}, "
                         f"down {w_down.shape}")
    n_slots = min(n_experts, top_e.size)
    used = jnp.zeros((n_experts,), bool).at[top_e.reshape(-1)].set(True)
    ids = jnp.nonzero(used, size=n_slots, fill_value=n_experts)[0].astype(jnp.int32)
    rows8 = rows8_of(n_tokens)
    dtype = w_gate.dtype
    x8 = jnp.zeros((1, rows8, hidden), dtype).at[0, :n_tokens].set(x.astype(dtype))
    h = _expert_matmul(ids, x8, (w_gate, w_up), n_experts, config, interpret)
    y = _expert_matmul(ids, h, (w_down,), n_experts, config, interpret)
    # slot l's weight for token t; slots without an expert are masked, not multiplied
    # (their rows were never written)
    wts = jnp.sum(jnp.where(top_e[None] == ids[:, None, None], top_p[None].astype(jnp.float32),
                            0.0), axis=-1)
    live = (ids < n_experts)[:, None, None]
    return jnp.sum(jnp.where(live, wts[..., None] * y[:, :n_tokens].astype(jnp.float32), 0.0),
                   axis=0)
