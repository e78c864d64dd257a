"""The weight-streaming matmul (compiled on a GPU, the tests marked `gpu`; interpret mode
elsewhere) against a float64 numpy reference on fresh random
inputs: several column blocks and K splits with ragged edges, one and two weights, with and
without the folded RMSNorm; the dispatcher's choice of kernel or XLA; its errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfi_jax.kernels import skinny_matmul as dispatch
from sfi_jax.kernels import skinny_matmul_gpu as gpu

from conftest import gpu_interpret, rel_err

# compiling the kernel (interpret mode here) for each shape is most of this file's time
# (conftest.py)
pytestmark = pytest.mark.usefixtures("xla_fast_compile")

EPS = 1e-6
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _numpy_reference(x, weights, norm):
    """float64: RMSNorm (when given) then the products, from the same rounded inputs."""
    x = np.asarray(x.astype(jnp.float32), np.float64)
    if norm is not None:
        n = np.asarray(norm.astype(jnp.float32), np.float64)
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * n
    return [x @ np.asarray(w.astype(jnp.float32), np.float64) for w in weights]


def _inputs(seed, rows, k, n, n_w, dtype, normed):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = (3 * jax.random.normal(ks[0], (rows, k), jnp.float32)).astype(dtype)
    ws = tuple((jax.random.normal(jax.random.fold_in(ks[1], i), (k, n), jnp.float32)
                / np.sqrt(k)).astype(dtype) for i in range(n_w))
    norm = (1 + 0.5 * jax.random.normal(ks[2], (k,), jnp.float32)).astype(dtype) \
        if normed else None
    return x, ws, norm


SMALL = gpu.Config(block_n=32, block_k=32, num_warps=4, num_stages=2, programs=12)


_CASES = {  # rows, K, N, weights, normed, dtype
    "1row-bf16-norm": (1, 200, 72, 1, True, jnp.bfloat16),    # one row, ragged K and N
    "5rows-pair-norm": (5, 96, 130, 2, True, jnp.float32),    # gate + up with the norm
    "16rows-f32": (16, 64, 48, 1, False, jnp.float32),        # a full 16-row tile
    "33rows-pair-bf16": (33, 80, 40, 2, False, jnp.bfloat16),  # rows padded to 64
}
# tl.dot for every case; the register modes (for a few rows) on the few-row cases
_MODE_CASES = [(mode, name) for name in _CASES for mode in gpu.MODES
               if mode == "dot" or _CASES[name][0] <= 8]


@pytest.mark.parametrize("mode, case", _MODE_CASES, ids=[f"{m}-{c}" for m, c in _MODE_CASES])
@pytest.mark.gpu
def test_kernel_matches_numpy(mode, case):
    rows, k, n, n_w, normed, dtype = _CASES[case]
    x, ws, norm = _inputs(rows * k + n, rows, k, n, n_w, dtype, normed)
    want = _numpy_reference(x, ws, norm)
    config = dataclasses.replace(SMALL, mode=mode)
    parts = gpu.skinny_matmul_partials(x, ws, norm, interpret=gpu_interpret(), config=config)
    assert len(parts) == n_w + normed
    assert parts[0].shape[0] > 1  # several K splits, each a partial sum
    got = dispatch.skinny_matmul(x, ws, norm, eps=EPS, impl="kernel", config=config)
    xla = dispatch.skinny_matmul(x, ws, norm, eps=EPS, impl="xla")
    for g, r, w in zip(got, xla, want):
        assert g.shape == (rows, n) and g.dtype == jnp.float32
        assert rel_err(g, w) < TOL[dtype], rel_err(g, w)
        assert rel_err(r, w) < TOL[dtype]
    if normed:  # the same product without the norm is far off: the test sees a missing norm
        plain = _numpy_reference(x, ws, None)
        assert rel_err(got[0], plain[0]) > 10 * TOL[dtype]


@pytest.mark.gpu
def test_dispatcher_keeps_leading_dims_and_default_config():
    x, ws, norm = _inputs(7, 6, 64, 96, 1, jnp.float32, True)
    x3 = x.reshape(2, 3, 64)
    got, = dispatch.skinny_matmul(x3, ws, norm, eps=EPS, impl="kernel")
    assert got.shape == (2, 3, 96)
    assert rel_err(got.reshape(6, 96), _numpy_reference(x, ws, norm)[0]) < TOL[jnp.float32]
    # one row takes the register-product tiles by default
    assert gpu.default_config(96, 64, 1).mode == "fma"
    got, = dispatch.skinny_matmul(x[:1], ws, norm, eps=EPS, impl="kernel")
    assert rel_err(got, _numpy_reference(x[:1], ws, norm)[0]) < TOL[jnp.float32]


def test_which_rows_take_the_kernel():
    assert dispatch.uses_kernel("kernel", 64) and not dispatch.uses_kernel("kernel", 65)
    assert dispatch.uses_kernel("by_shape", 1) and dispatch.uses_kernel("by_shape", 4)
    assert not dispatch.uses_kernel("by_shape", 6)
    assert not dispatch.uses_kernel("xla", 1)
    with pytest.raises(ValueError, match="matmul impl must be one of"):
        dispatch.uses_kernel("triton", 1)
    # more rows than the kernel takes fall back to XLA's gemm
    x, ws, _ = _inputs(3, 70, 32, 16, 1, jnp.float32, False)
    jaxpr = str(jax.make_jaxpr(lambda x: dispatch.skinny_matmul(x, ws, impl="kernel"))(x))
    assert "sfi_skinny_matmul" not in jaxpr
    jaxpr = str(jax.make_jaxpr(lambda x: dispatch.skinny_matmul(x[:8], ws, impl="kernel"))(x))
    assert "sfi_skinny_matmul" in jaxpr


def test_bad_shapes_name_the_problem():
    x, ws, _ = _inputs(1, 2, 32, 16, 1, jnp.float32, False)
    with pytest.raises(ValueError, match="at most 64 rows"):
        gpu.skinny_matmul_partials(jnp.zeros((65, 32)), ws, interpret=True)
    with pytest.raises(ValueError, match="does not match weight"):
        gpu.skinny_matmul_partials(jnp.zeros((2, 33)), ws, interpret=True)
    with pytest.raises(ValueError, match="mode must be one of"):
        gpu.Config(mode="wgmma")
    with pytest.raises(ValueError, match="one or two weights of one shape"):
        gpu.skinny_matmul_partials(x, (ws[0], ws[0][:, :8]), interpret=True)


def test_shared_memory_fit():
    """Pipelined tiles that would not fit in shared memory get fewer stages, then smaller K
    blocks (float32 gate + up at the default tiles)."""
    fit = gpu._fit(gpu.Config(), rows=16, n_w=2, x_bytes=4, w_bytes=4)
    stage = fit.block_k * (16 * 4 + 2 * fit.block_n * 4)
    assert stage * fit.num_stages <= gpu._SMEM_BYTES and fit.num_stages >= 2
    assert gpu._fit(gpu.Config(), rows=16, n_w=1, x_bytes=2, w_bytes=2) == gpu.Config()


# ------------------------------------------------------------------- fused epilogues

def _numpy_heads(qkv, cos, sin, qn, kn, hq, hkv):
    """float64: q/k heads RMS-normed per head and rotated (rotate-half), v as it is."""
    b, width = qkv.shape
    d = width // (hq + 2 * hkv)
    heads = qkv.reshape(b, hq + 2 * hkv, d)
    out = []
    for lo, hi, w in ((0, hq, qn), (hq, hq + hkv, kn)):
        h = heads[:, lo:hi]
        h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * w
        x1, x2 = h[..., :d // 2], h[..., d // 2:]
        c, s = cos[:, None], sin[:, None]
        out.append(np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1))
    return out + [heads[:, hq + hkv:]]


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


@pytest.mark.parametrize("epilogue, dtype, hq, hkv", [
    ("residual", jnp.float32, 0, 0), ("silu", jnp.bfloat16, 0, 0), ("heads", jnp.float32, 4, 2),
    ("heads", jnp.bfloat16, 5, 1)])  # 7 heads: the last column block passes the last head
@pytest.mark.gpu
def test_fused_epilogues_match_numpy(epilogue, dtype, hq, hkv):
    """Each epilogue on several column blocks and K splits (ragged N for the elementwise ones),
    three rows, against float64 numpy; the counters come back zero, ready for the next call."""
    rows, k, d = 3, 200, 16
    n = (hq + 2 * hkv) * d if epilogue == "heads" else 72
    n_w, normed = (2 if epilogue == "silu" else 1), epilogue != "residual"
    x, ws, norm = _inputs(11 + n, rows, k, n, n_w, dtype, normed)
    ks = jax.random.split(jax.random.key(5), 4)
    res = jax.random.normal(ks[0], (rows, n)).astype(dtype)
    cos = jax.random.uniform(ks[1], (rows, d // 2), minval=-1, maxval=1)
    sin = jax.random.uniform(ks[2], (rows, d // 2), minval=-1, maxval=1)
    qn = (1 + 0.3 * jax.random.normal(ks[3], (d,))).astype(dtype)
    kn = (1 - 0.3 * jax.random.normal(ks[3], (d,))).astype(dtype)
    kw = {"residual": dict(residual=res), "silu": {},
          "heads": dict(cos=cos, sin=sin, q_norm=qn, k_norm=kn, num_q_heads=hq,
                        num_kv_heads=hkv)}[epilogue]
    sync = gpu.new_sync()
    *got, sync = gpu.skinny_matmul_fused(x, ws, norm, sync, epilogue=epilogue, eps=EPS,
                                         interpret=gpu_interpret(), config=SMALL, **kw)
    assert np.all(np.asarray(sync) == 0)
    assert gpu.plan(n, k, SMALL)[1] > 1 and -(-n // SMALL.block_n) > 1  # splits and blocks
    prods = _numpy_reference(x, ws, norm)
    if epilogue == "residual":
        want = [_f64(res) + prods[0]]
    elif epilogue == "silu":
        g, u = prods
        want = [g / (1 + np.exp(-g)) * u]
    else:
        want = _numpy_heads(prods[0], _f64(cos), _f64(sin), _f64(qn), _f64(kn), hq, hkv)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == dtype
        assert rel_err(_f64(g), w) < 2 * TOL[dtype], rel_err(_f64(g), w)
    if epilogue == "heads":  # without the per-head norm the q heads are far off
        plain = _numpy_heads(prods[0], _f64(cos), _f64(sin), np.ones(d), np.ones(d), hq, hkv)
        assert rel_err(_f64(got[0]), plain[0]) > 10 * TOL[dtype]


def test_fused_epilogues_name_bad_arguments():
    x, ws, norm = _inputs(2, 2, 32, 16, 1, jnp.float32, True)
    sync = gpu.new_sync()
    with pytest.raises(ValueError, match="epilogue must be one of"):
        gpu.skinny_matmul_fused(x, ws, norm, sync, epilogue="gelu", interpret=True)
    with pytest.raises(ValueError, match="at most 4 rows"):
        gpu.skinny_matmul_fused(jnp.zeros((5, 32)), ws, None, sync, epilogue="silu",
                                interpret=True)
    with pytest.raises(ValueError, match="takes 2 weight"):
        gpu.skinny_matmul_fused(x, ws, norm, sync, epilogue="silu", interpret=True)
    with pytest.raises(ValueError, match="residual must be"):
        gpu.skinny_matmul_fused(x, ws, None, sync, epilogue="residual",
                                residual=jnp.zeros((2, 15)), interpret=True)
    with pytest.raises(ValueError, match="sync must be int32"):
        gpu.skinny_matmul_fused(x, ws, None, sync[:8], epilogue="residual",
                                residual=jnp.zeros((2, 16)), interpret=True)
    with pytest.raises(ValueError, match="not 3 heads"):
        gpu.skinny_matmul_fused(x, ws, norm, sync, epilogue="heads", num_q_heads=1,
                                num_kv_heads=1, cos=jnp.zeros((2, 8)), sin=jnp.zeros((2, 8)),
                                interpret=True)
    assert dispatch.uses_fused("by_shape", 4) and not dispatch.uses_fused("kernel", 5)
    assert not dispatch.uses_fused("xla", 1)


@pytest.mark.parametrize("epilogue, dtype, programs, prefetch", [
    ("residual", jnp.float32, 0, 0), ("silu", jnp.bfloat16, 0, 1), (None, jnp.float32, 2, 2),
    ("silu", jnp.bfloat16, 3, 0), ("residual", jnp.bfloat16, 3, 2)])
# 2 / 3 programs walking 5 column blocks (ragged last one)
@pytest.mark.gpu
def test_kmajor_matches_numpy(epilogue, dtype, programs, prefetch, xla_fast_compile):
    """The K-major kernel (weights [N, K]) with each epilogue, three rows, ragged K and N,
    one program per column block or a few walking several, tiles loaded ahead or not,
    against float64 numpy."""
    rows, k, n = 3, 200, 72
    n_w, normed = (2 if epilogue == "silu" else 1), epilogue != "residual"
    x, ws, norm = _inputs(23 + programs, rows, k, n, n_w, dtype, normed)
    res = jax.random.normal(jax.random.key(9), (rows, n)).astype(dtype)
    cfg = gpu.KMajorConfig(block_n=16, block_k=64, num_warps=4, num_stages=2, programs=programs,
                           prefetch=prefetch)
    got = gpu.skinny_matmul_kmajor(x, tuple(w.T for w in ws), norm, epilogue=epilogue,
                                   residual=res if epilogue == "residual" else None, eps=EPS,
                                   interpret=gpu_interpret(), config=cfg)
    prods = _numpy_reference(x, ws, norm)
    want = {"residual": lambda: _f64(res) + prods[0], None: lambda: prods[0],
            "silu": lambda: prods[0] / (1 + np.exp(-prods[0])) * prods[1]}[epilogue]()
    assert got.shape == want.shape and got.dtype == dtype
    assert rel_err(_f64(got), want) < 2 * TOL[dtype], rel_err(_f64(got), want)


def test_kmajor_names_bad_arguments():
    x, ws, norm = _inputs(2, 2, 32, 16, 1, jnp.float32, True)
    wt = (ws[0].T,)
    with pytest.raises(ValueError, match="epilogue must be"):
        gpu.skinny_matmul_kmajor(x, wt, norm, epilogue="heads", interpret=True)
    with pytest.raises(ValueError, match=r"weights_t must be \[N, 32\]"):
        gpu.skinny_matmul_kmajor(x, ws, norm, interpret=True)  # [K, N] in place of [N, K]
    with pytest.raises(ValueError, match="at most 4 rows"):
        gpu.skinny_matmul_kmajor(jnp.zeros((5, 32)), wt, None, interpret=True)
    with pytest.raises(ValueError, match="takes 2 weight"):
        gpu.skinny_matmul_kmajor(x, wt, norm, epilogue="silu", interpret=True)
    with pytest.raises(ValueError, match="residual must be"):
        gpu.skinny_matmul_kmajor(x, wt, None, epilogue="residual", residual=jnp.zeros((2, 15)),
                                 interpret=True)
