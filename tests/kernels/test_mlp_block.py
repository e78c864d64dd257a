"""The persistent attention-output + MLP kernel (interpret mode) against a float64 numpy
reference on fresh random inputs: several column blocks and K splits per phase with ragged
edges, one and three rows, float32 and bfloat16; its counters left zero; its errors. (Its
CUDA export: test_kernel_lowering.py.)"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from sfi_jax.kernels import mlp_block_gpu as mb
from sfi_jax.kernels import skinny_matmul_gpu as sm

EPS = 1e-6
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# 32 x 32 tiles and 16 programs: every phase has several blocks and splits (ragged N and K)
SMALL = mb.BlockConfig(block_n=32, block_k=32, programs=16)


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _numpy_block(attn, wo, res, nw, wg, wu, wd):
    h1 = _f64(res) + _f64(attn) @ _f64(wo)
    n = h1 / np.sqrt(np.mean(h1 * h1, axis=-1, keepdims=True) + EPS) * _f64(nw)
    g, u = n @ _f64(wg), n @ _f64(wu)
    return h1 + (g / (1 + np.exp(-g)) * u) @ _f64(wd)


def _inputs(seed, rows, ko, h, inter, dtype):
    rng = np.random.default_rng(seed)

    def mk(*shape, scale=1.0, shift=0.0):
        return jnp.asarray(shift + scale * rng.standard_normal(shape), jnp.float32).astype(dtype)

    return (mk(rows, ko), mk(ko, h, scale=ko ** -0.5), mk(rows, h),
            mk(h, scale=0.3, shift=1.0), mk(h, inter, scale=h ** -0.5),
            mk(h, inter, scale=h ** -0.5), mk(inter, h, scale=inter ** -0.5))


@pytest.mark.parametrize("rows, ko, h, inter, dtype, config", [
    (1, 96, 80, 200, jnp.float32, SMALL),
    (3, 64, 72, 130, jnp.bfloat16, SMALL),
    # one K split per block: each program's epilogue takes its own accumulators
    (2, 96, 80, 200, jnp.float32, dataclasses.replace(SMALL, block_n=16, max_splits=1)),
], ids=["1row-f32", "3rows-bf16", "2rows-one-split"])
def test_block_matches_numpy(rows, ko, h, inter, dtype, config):
    args = _inputs(rows, rows, ko, h, inter, dtype)
    sync = sm.new_sync()
    out, sync = mb.mlp_block(*args, sync, eps=EPS, interpret=True, config=config)
    assert out.shape == (rows, h) and out.dtype == dtype
    want = _numpy_block(*args)
    got = _f64(out)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL[dtype]
    assert not np.asarray(sync).any()  # every counter back at zero for the next call


def test_block_phases_have_several_blocks_and_splits():
    """The small config really exercises the counters: every phase has more than one column
    block and more than one K split."""
    phases = [mb._phase(n, k, 1, w, SMALL.programs, 4, 4, SMALL)
              for n, k, w in ((80, 96, 1), (200, 80, 2), (80, 200, 1))]
    assert all(p.blocks > 1 and p.splits > 1 for p in phases)
    assert all(p.tasks <= SMALL.programs for p in phases)
    one = dataclasses.replace(SMALL, block_n=16, max_splits=1)
    assert all(mb._phase(80, 96, 1, 1, one.programs, 4, 4, one).splits == 1 for _ in (0,))


def test_block_names_bad_arguments():
    args = list(_inputs(0, 1, 64, 32, 48, jnp.float32))
    with pytest.raises(ValueError, match="at most 4 rows"):
        mb.mlp_block(jnp.zeros((5, 64)), *args[1:], sm.new_sync(), interpret=True)
    bad = list(args)
    bad[6] = jnp.zeros((40, 32))
    with pytest.raises(ValueError, match=r"w_down must be \(48, 32\)"):
        mb.mlp_block(*bad, sm.new_sync(), interpret=True)
    with pytest.raises(ValueError, match="sync must be"):
        mb.mlp_block(*args, jnp.zeros((8,), jnp.int32), interpret=True)
