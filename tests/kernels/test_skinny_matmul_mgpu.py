"""The Mosaic GPU weight-streaming matmul (`skinny_matmul_mgpu`; compiled on a GPU, the tests
marked `gpu`, Mosaic GPU's interpret mode elsewhere) against a float64 numpy reference on fresh
random inputs: several column blocks and K splits, a last split shorter than the others, one
and two weights, 1 to 64 rows; its plan for the Qwen3 decode shapes and their lowering for
CUDA from any machine; what it refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfi_jax.kernels import skinny_matmul_mgpu as mgpu
from sfi_jax.kernels.attention_mgpu import SMEM_BYTES

from conftest import gpu_interpret, host_rng, rel_err

# bf16 inputs, products exact in float32, float32 sums: against float64 sums of the same
# rounded inputs only the order of the additions differs (a dropped 64-wide K block of a few
# hundred is an error of 10% or more)
TOL = 1e-3

# rows, K, N, weights, config: small blocks and few programs so that a few hundred columns and
# K span several column blocks and splits
_CASES = {
    # K 256, N 384 (qwen3-0.6b's 1024 -> 4096 scaled down): 3 column blocks x 2 splits
    "1row": (1, 256, 384, 1, mgpu.Config(block_n=128, block_k=64, stages=2, programs=6)),
    "6rows-pair": (6, 256, 384, 2, mgpu.Config(block_n=128, block_k=64, stages=2, programs=6)),
    # 5 K blocks in splits of 3 and 2 (a last split shorter than `stages`); block_n 128 halved
    # to 64 to divide N = 192
    "16rows-ragged": (16, 320, 192, 1, mgpu.Config(block_n=128, block_k=64, stages=3,
                                                   programs=6)),
    # 64 rows (wgmma's whole tile), 128-wide K blocks, one K block per split
    "64rows-pair-bk128": (64, 384, 256, 2, mgpu.Config(block_n=128, block_k=128, stages=2,
                                                       programs=6)),
}

# (proj, K, N, weights) of the decode step
QWEN3_4B = [("qkv", 2560, 6144, 1), ("o", 4096, 2560, 1), ("gate_up", 2560, 9728, 2),
            ("down", 9728, 2560, 1)]
QWEN3_06B = [("qkv", 1024, 4096, 1), ("o", 2048, 1024, 1), ("gate_up", 1024, 3072, 2),
             ("down", 3072, 1024, 1)]
DECODE_SHAPES = [(f"4b-{p}", k, n, w) for p, k, n, w in QWEN3_4B] + \
    [(f"0.6b-{p}", k, n, w) for p, k, n, w in QWEN3_06B]


def _inputs(seed, rows, k, n, n_w):
    rng = host_rng(seed)
    x = jnp.asarray(3 * rng.standard_normal((rows, k), dtype=np.float32), jnp.bfloat16)
    ws = tuple(jnp.asarray(rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(k),
                           jnp.bfloat16) for _ in range(n_w))
    return x, ws


def _reference(x, ws):
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    return [x64 @ np.asarray(w.astype(jnp.float32), np.float64) for w in ws]


@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.gpu
@pytest.mark.usefixtures("xla_fast_compile")
def test_partials_match_numpy(case):
    rows, k, n, n_w, cfg = _CASES[case]
    x, ws = _inputs(sum(map(ord, case)), rows, k, n, n_w)
    parts = mgpu.skinny_matmul_partials(x, ws, interpret=gpu_interpret(), config=cfg)
    p = mgpu.plan(rows, k, n, n_w, cfg)
    assert p.n_splits > 1 and len(parts) == n_w
    for part, ref in zip(parts, _reference(x, ws)):
        assert part.shape == (p.n_splits, rows, n) and part.dtype == jnp.float32
        assert rel_err(np.asarray(part).sum(axis=0), ref) <= TOL


@pytest.mark.parametrize("case", ["1row", "6rows-pair", "16rows-ragged"])
@pytest.mark.gpu
@pytest.mark.usefixtures("xla_fast_compile")
def test_weights_first_under_dependent_launch(case):
    """With programmatic dependent launch the first weight blocks are asked for before the rows
    (and, compiled, before `griddepcontrol.wait`): the same products, including a last split
    shorter than the stages and two weights."""
    rows, k, n, n_w, cfg = _CASES[case]
    x, ws = _inputs(7 + sum(map(ord, case)), rows, k, n, n_w)
    parts = mgpu.skinny_matmul_partials(x, ws, interpret=gpu_interpret(), config=cfg,
                                        launch_dependents=True)
    for part, ref in zip(parts, _reference(x, ws)):
        assert rel_err(np.asarray(part).sum(axis=0), ref) <= TOL


@pytest.mark.gpu
@pytest.mark.usefixtures("xla_fast_compile")
def test_default_config_on_a_decode_shape():
    """The default config (its many programs: one K block per split here) on qwen3-0.6b's
    down projection with K cut to 512 (interpret mode's time)."""
    x, ws = _inputs(3, 6, 512, 1024, 1)
    parts = mgpu.skinny_matmul_partials(x, ws, interpret=gpu_interpret())
    assert rel_err(np.asarray(parts[0]).sum(axis=0), _reference(x, ws)[0]) <= TOL


@pytest.mark.parametrize("rows", [1, 6, 16, 64])
@pytest.mark.parametrize("name, k, n, n_w", DECODE_SHAPES)
def test_plan_covers_decode_shapes(name, k, n, n_w, rows):
    """The decode shapes are supported with the default config: every K block in exactly one
    split; at most the programs asked for, each in its share of an SM's shared memory (so they
    run in one wave), unless a longer split's rows would not fit that share."""
    x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    assert mgpu.supported(x, w)
    p = mgpu.plan(rows, k, n, n_w)
    n_kb = k // p.bk
    assert n % p.bn == 0 and k % p.bk == 0 and p.n_blocks == n // p.bn
    assert (p.n_splits - 1) * p.steps < n_kb <= p.n_splits * p.steps
    assert 1 <= p.stages <= p.steps
    r8, programs = mgpu.rows8_of(rows), mgpu.DEFAULT.programs
    budget = mgpu.smem_budget(programs)
    assert budget <= SMEM_BYTES
    assert mgpu.smem_bytes(r8, p.steps, p.bn, p.bk, p.stages, n_w) <= budget
    assert (p.n_blocks * p.n_splits <= programs
            or mgpu.smem_bytes(r8, p.steps + 1, p.bn, p.bk, 2, n_w) > budget)


@pytest.mark.parametrize("name, k, n, n_w", DECODE_SHAPES)
def test_kernel_lowers_for_cuda(name, k, n, n_w):
    """Interpret mode does not prove the kernel compiles: its Mosaic GPU lowering (TMA
    slices of the swizzled tiles, wgmma operands, barriers) runs here, for CUDA, at the decode
    shapes with 1 and 16 rows."""
    for rows in (1, 16):
        x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
        ws = tuple(jax.ShapeDtypeStruct((k, n), jnp.bfloat16) for _ in range(n_w))
        text = jax.jit(lambda x, ws: mgpu.skinny_matmul_partials(x, ws)).trace(x, ws).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
    # with programmatic dependent launch (the wait and the signal lower too), rows unpadded
    text = jax.jit(lambda x, ws: mgpu.skinny_matmul_partials(
        x, ws, launch_dependents=True, zero_fill=True)).trace(x, ws).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "griddepcontrol.wait" in text and "griddepcontrol.launch_dependents" in text


# rows, K, N, config of the fused epilogues: a block's splits meet in its last split
_FUSED_CASES = {
    "1row-2splits": (1, 256, 384, mgpu.Config(block_n=128, block_k=64, stages=2, programs=6)),
    # 7 K blocks in 4 splits (the last one shorter), block_n halved to 64
    "3rows-4splits": (3, 448, 192, mgpu.Config(block_n=128, block_k=64, stages=2, programs=12)),
    "4rows-1split": (4, 128, 256, mgpu.Config(block_n=128, block_k=128, stages=2, programs=2)),
}


def _rounded_products(x, ws):
    """float64 products of the bf16 inputs, rounded to bf16 as the unfused path rounds them."""
    return [np.asarray(jnp.asarray(r, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32),
                       np.float64) for r in _reference(x, ws)]


@pytest.mark.parametrize("epilogue", ["residual", "silu"])
@pytest.mark.parametrize("case", list(_FUSED_CASES))
@pytest.mark.gpu
@pytest.mark.usefixtures("xla_fast_compile")
def test_fused_epilogue_matches_numpy(case, epilogue):
    """`skinny_matmul_fused`: residual + x @ w, or silu(x @ w_gate) * (x @ w_up), each product
    rounded to bf16 first, against float64 on fresh inputs; one to four K splits meeting in
    the last (on the GPU through the block's semaphore, which must come back to 0: a second
    call gives the same result)."""
    rows, k, n, cfg = _FUSED_CASES[case]
    n_w = 2 if epilogue == "silu" else 1
    x, ws = _inputs(40 + sum(map(ord, case + epilogue)), rows, k, n, n_w)
    res = jnp.asarray(host_rng(5).standard_normal((rows, n), dtype=np.float32), jnp.bfloat16)
    p = mgpu.fused_plan(rows, k, n, n_w, cfg)
    assert p is not None and p.n_splits == {"1row-2splits": 2, "3rows-4splits": 4,
                                            "4rows-1split": 1}[case]
    prods = _rounded_products(x, ws)
    if epilogue == "residual":
        want = np.asarray(res.astype(jnp.float32), np.float64) + prods[0]
    else:
        g, u = prods
        want = g / (1 + np.exp(-g)) * u
    for _ in range(2):
        out = mgpu.skinny_matmul_fused(x, ws, epilogue=epilogue, residual=res,
                                       interpret=gpu_interpret(), config=cfg)
        assert out.shape == (rows, n) and out.dtype == jnp.bfloat16
        assert rel_err(out, want) <= 4e-3  # the output's bf16 rounding


@pytest.mark.parametrize("name, k, n, n_w", DECODE_SHAPES)
def test_fused_kernel_plans_and_lowers_for_cuda(name, k, n, n_w):
    """The fused epilogues at the decode shapes: a grid resident at once (its last splits wait
    for the others) and the Mosaic GPU lowering, semaphores and dependent launch included."""
    epilogue = "heads" if name.endswith("qkv") else "silu" if n_w == 2 else "residual"
    cfg = mgpu.Config(block_n=128) if epilogue == "heads" else None  # (one head of 128)
    p = mgpu.fused_plan(4, k, n, n_w, cfg, epilogue=epilogue)
    assert p is not None
    per_cta = max(mgpu.smem_bytes(8, p.steps, p.bn, p.bk, p.stages, n_w),
                  mgpu.epilogue_smem_bytes(8, p.bn, n_w, epilogue=epilogue)) + 2048
    assert p.n_blocks * p.n_splits <= 132 * (mgpu.SM_SMEM_BYTES // per_cta)
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    x, r = sds((4, k), bf), sds((4, n), bf)
    ws = tuple(sds((k, n), bf) for _ in range(n_w))
    if epilogue == "heads":
        hq = n // 128 * 2 // 3 if name.startswith("4b") else n // 128 // 2  # 32/8, 16/8
        cs, nw = sds((4, 64), jnp.float32), sds((128,), bf)
        fn = jax.jit(lambda x, ws, cs, nw: mgpu.skinny_matmul_heads(
            x, ws[0], cs, cs, nw, nw, num_q_heads=hq, num_kv_heads=(n // 128 - hq) // 2,
            launch_dependents=True, zero_fill=True))
        text = fn.trace(x, ws, cs, nw).lower(lowering_platforms=("cuda",)).as_text()
    else:
        text = jax.jit(lambda x, ws, r: mgpu.skinny_matmul_fused(
            x, ws, epilogue=epilogue, residual=r if epilogue == "residual" else None,
            launch_dependents=True, zero_fill=True)).trace(x, ws, r).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def _bf(a):
    """float64 rounded to bf16 and back."""
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32),
                      np.float64)


@pytest.mark.parametrize("rows, qk_norm", [(1, True), (3, True), (2, False)])
@pytest.mark.gpu
@pytest.mark.usefixtures("xla_fast_compile")
def test_heads_epilogue_matches_numpy(rows, qk_norm):
    """`skinny_matmul_heads`: the fused q/k/v product (rounded to bf16), q and k heads
    RMS-normed by their norms (rounded), rotated (rotate-half, rounded), v heads as they are,
    against float64 on fresh inputs: 2 q heads and 1 KV head of 64, K in two splits."""
    hq, hkv, d, k = 2, 1, 64, 256
    n = (hq + 2 * hkv) * d
    x, (w,) = _inputs(60 + rows + qk_norm, rows, k, n, 1)
    rng = host_rng(61 + rows)
    ang = rng.uniform(0, 100, (rows, 1)) * (1e4 ** (-np.arange(d // 2) / (d // 2)))[None]
    cos, sin = (jnp.asarray(f(ang), jnp.float32) for f in (np.cos, np.sin))
    qn, kn = (jnp.asarray(1 + 0.2 * rng.standard_normal(d, dtype=np.float32), jnp.bfloat16)
              for _ in range(2))
    cfg = mgpu.Config(block_k=64, stages=2, programs=8)
    assert mgpu.fused_plan(rows, k, n, 1, mgpu.Config(block_n=d, block_k=64, stages=2,
                                                      programs=8), epilogue="heads").n_splits == 2
    q, kk, v = mgpu.skinny_matmul_heads(x, w, cos, sin, qn if qk_norm else None,
                                        kn if qk_norm else None, num_q_heads=hq,
                                        num_kv_heads=hkv, eps=1e-6, interpret=gpu_interpret(),
                                        config=cfg)
    qkv = _rounded_products(x, (w,))[0].reshape(rows, hq + 2 * hkv, d)
    c64, s64 = (np.asarray(a, np.float64)[:, None] for a in (cos, sin))

    def norm_rope(h, weight):
        if qk_norm:
            h = _bf(h / np.sqrt((h ** 2).mean(-1, keepdims=True) + 1e-6)
                    * np.asarray(weight.astype(jnp.float32), np.float64))
        h1, h2 = h[..., :d // 2], h[..., d // 2:]
        return np.concatenate([h1 * c64 - h2 * s64, h2 * c64 + h1 * s64], -1)

    want = (norm_rope(qkv[:, :hq], qn), norm_rope(qkv[:, hq:hq + hkv], kn), qkv[:, hq + hkv:])
    for got, ref, shape in zip((q, kk, v), want, ((rows, hq, d), (rows, hkv, d), (rows, hkv, d))):
        assert got.shape == shape and got.dtype == jnp.bfloat16
        assert rel_err(got, ref) <= 8e-3  # (the norm's and the output's bf16 roundings)


@pytest.mark.gpu
@pytest.mark.usefixtures("xla_fast_compile")
def test_zero_fill_reads_the_same():
    """`zero_fill=True` (KernelTuning.zero_fill): the rows are read unpadded, TMA filling the
    rows past the array's end with zeros (interpret mode: Mosaic GPU's out-of-bounds reads as
    zeros), and every kernel gives the padded read's result: the partials (6 rows of 8), the
    residual epilogue (3 rows: x and the residual unpadded) and the heads' (3 rows: x, cos and
    sin unpadded)."""
    rows, k, n, n_w, cfg = _CASES["6rows-pair"]
    x, ws = _inputs(71, rows, k, n, n_w)
    parts = mgpu.skinny_matmul_partials(x, ws, interpret=gpu_interpret(), config=cfg,
                                        zero_fill=True)
    for part, ref in zip(parts, _reference(x, ws)):
        assert rel_err(np.asarray(part).sum(axis=0), ref) <= TOL
    rows, k, n, cfg = _FUSED_CASES["3rows-4splits"]
    x, ws = _inputs(72, rows, k, n, 1)
    res = jnp.asarray(host_rng(73).standard_normal((rows, n), dtype=np.float32), jnp.bfloat16)
    kw = dict(epilogue="residual", residual=res, interpret=gpu_interpret(), config=cfg)
    want = mgpu.skinny_matmul_fused(x, ws, **kw)
    assert rel_err(want, np.asarray(res.astype(jnp.float32), np.float64)
                   + _rounded_products(x, ws)[0]) <= 4e-3
    np.testing.assert_array_equal(np.asarray(mgpu.skinny_matmul_fused(x, ws, zero_fill=True,
                                                                      **kw)), np.asarray(want))
    hq, hkv, d = 2, 1, 64
    x, (w,) = _inputs(74, 3, 256, (hq + 2 * hkv) * d, 1)
    cos, sin = (jnp.asarray(host_rng(75 + i).uniform(-1, 1, (3, d // 2)), jnp.float32)
                for i in range(2))
    nw = jnp.ones((d,), jnp.bfloat16)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, interpret=gpu_interpret(),
              config=mgpu.Config(block_k=64, stages=2, programs=8))
    for a, b in zip(mgpu.skinny_matmul_heads(x, w, cos, sin, nw, nw, **kw),
                    mgpu.skinny_matmul_heads(x, w, cos, sin, nw, nw, zero_fill=True, **kw)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_fused_refuses_bad_arguments():
    bf = jnp.bfloat16
    x, w = jnp.zeros((2, 256), bf), jnp.zeros((256, 128), bf)
    with pytest.raises(ValueError, match="epilogue must be one of"):
        mgpu.skinny_matmul_fused(x, (w,), epilogue="heads", interpret=True)
    with pytest.raises(ValueError, match="takes 2 weight"):
        mgpu.skinny_matmul_fused(x, (w,), epilogue="silu", interpret=True)
    with pytest.raises(ValueError, match="residual \\[2, 128\\]"):
        mgpu.skinny_matmul_fused(x, (w,), epilogue="residual", residual=jnp.zeros((2, 64), bf),
                                 interpret=True)


def test_refuses_what_it_cannot_tile():
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    assert not mgpu.supported(sds((65, 256), bf), sds((256, 128), bf))  # > 64 rows
    assert not mgpu.supported(sds((4, 200), bf), sds((200, 128), bf))  # K % 64
    assert not mgpu.supported(sds((4, 256), bf), sds((256, 100), bf))  # N % 64
    assert not mgpu.supported(sds((4, 256), bf), sds((256, 128), jnp.float32))  # TF32
    x = jnp.zeros((4, 256), bf)
    with pytest.raises(ValueError, match="multiples of 64"):
        mgpu.skinny_matmul_partials(x, (jnp.zeros((256, 100), bf),), interpret=True)
    with pytest.raises(ValueError, match="one or two weights"):
        mgpu.skinny_matmul_partials(x, (jnp.zeros((256, 128), bf),) * 3, interpret=True)
    with pytest.raises(ValueError, match="multiples of 64"):
        mgpu.plan(4, 256, 128, 1, mgpu.Config(block_n=96))


def test_dispatch_norms_the_rows_then_runs_the_kernel(monkeypatch):
    """`skinny_matmul(impl="mosaic_gpu")` (the engine's matmul option): the rows RMS-normed by
    the norm's weight (a float64 reference here), then the kernel for weights it takes; XLA for
    others (N not a multiple of 64), the kernel not called."""
    from sfi_jax.kernels import skinny_matmul

    calls = []
    kernel = mgpu.skinny_matmul_partials
    monkeypatch.setattr(mgpu, "skinny_matmul_partials",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))
    x, ws = _inputs(21, 3, 256, 192, 2)
    x = x.reshape(3, 1, 256)
    rng = host_rng(22)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(256, dtype=np.float32), jnp.bfloat16)
    got = skinny_matmul.skinny_matmul(x, ws, norm, eps=1e-6, impl="mosaic_gpu")
    assert len(calls) == 1
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    h = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * np.asarray(
        norm.astype(jnp.float32), np.float64)
    for g, w in zip(got, ws):
        assert g.shape == (3, 1, 192) and g.dtype == jnp.float32
        assert rel_err(g, h @ np.asarray(w.astype(jnp.float32), np.float64)) < 1e-2  # bf16 h
    odd = jnp.asarray(rng.standard_normal((256, 100), dtype=np.float32), jnp.bfloat16)
    out, = skinny_matmul.skinny_matmul(x, (odd,), impl="mosaic_gpu")
    assert len(calls) == 1
    assert rel_err(out, x64 @ np.asarray(odd.astype(jnp.float32), np.float64)) < 1e-2


@pytest.mark.parametrize("epilogue", ["residual", "silu"])
def test_matmul_epilogue_fuses_for_the_twin_only(monkeypatch, epilogue):
    """`skinny_matmul.matmul_epilogue` (the decode step's output projection and MLP): with
    fuse and a Mosaic impl, the rows RMS-normed (silu) and the fused kernel, once; without
    fuse, or with more rows than "mosaic_by_shape" takes, the products then XLA's epilogue,
    the fused kernel not called. All against float64."""
    from sfi_jax.kernels import skinny_matmul

    calls = []
    kernel = mgpu.skinny_matmul_fused
    monkeypatch.setattr(mgpu, "skinny_matmul_fused",
                        lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    n_w = 2 if epilogue == "silu" else 1
    rng = host_rng(50)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(256, dtype=np.float32), jnp.bfloat16)
    for rows, impl, fuse in ((3, "mosaic_by_shape", True), (3, "mosaic_by_shape", False),
                             (5, "mosaic_by_shape", True), (5, "xla", True)):
        x, ws = _inputs(51 + rows, rows, 256, 192, n_w)
        res = jnp.asarray(rng.standard_normal((rows, 1, 192), dtype=np.float32), jnp.bfloat16)
        x = x.reshape(rows, 1, 256)
        got = skinny_matmul.matmul_epilogue(
            x, ws, norm if epilogue == "silu" else None, epilogue=epilogue, residual=res,
            eps=1e-6, impl=impl, fuse=fuse)
        x64 = np.asarray(x.astype(jnp.float32), np.float64)
        if epilogue == "silu":
            x64 = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * np.asarray(
                norm.astype(jnp.float32), np.float64)
        prods = [x64 @ np.asarray(w.astype(jnp.float32), np.float64) for w in ws]
        want = (np.asarray(res.astype(jnp.float32), np.float64) + prods[0]
                if epilogue == "residual" else prods[0] / (1 + np.exp(-prods[0])) * prods[1])
        assert got.shape == (rows, 1, 192) and got.dtype == jnp.bfloat16
        assert rel_err(got, want) < 1e-2, (rows, impl, fuse)  # (bf16 rows, products, output)
    assert calls == [3]


@pytest.mark.gpu
@pytest.mark.usefixtures("xla_fast_compile")
def test_fused_layer_equals_the_unfused_one():
    """A decode step's layer through `modeling.attention_inputs` and
    `attention_output_and_mlp` with the Mosaic twin's epilogues in its kernel
    (matmul="mosaic_gpu", epilogue="fused": the heads' norms and rope, the residual adds, the
    SiLU product) gives XLA's q, k, v and residual stream up to bf16 rounding: random Qwen3
    weights (4 q and 2 KV heads of 64, fused q/k/v), 3 rows at their own positions."""
    from sfi_jax.models.config import ModelConfig
    from sfi_jax.models.modeling import (attention_inputs, attention_output_and_mlp,
                                         split_layers, WeightLayout)
    from sfi_jax.models.params import random_params

    cfg = ModelConfig(name="t", num_layers=1, hidden_size=256, intermediate_size=512,
                      num_q_heads=4, num_kv_heads=2, head_dim=64, vocab_size=128,
                      max_position_embeddings=4096, qk_norm=True)
    params = random_params(cfg, "bfloat16", 3)
    w = split_layers(params["layers"], fuse_qkv=True)[0]
    layout = WeightLayout(split=True, fused_qkv=True)
    rng = host_rng(70)
    x = jnp.asarray(rng.standard_normal((3, 1, 256), dtype=np.float32), jnp.bfloat16)
    pos = jnp.asarray([[5], [700], [3000]], jnp.int32)
    out = {}
    for matmul, epilogue in (("xla", "xla"), ("mosaic_gpu", "fused")):
        q, k, v = attention_inputs(w, cfg, x, pos, matmul=matmul, layout=layout,
                                   epilogue=epilogue)
        y = attention_output_and_mlp(w, cfg, x, q,
                                     matmul=matmul, layout=layout, epilogue=epilogue)
        out[epilogue] = (q, k, v, y)
    for got, want, name in zip(out["fused"], out["xla"], "qkvx"):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert rel_err(got, np.asarray(want.astype(jnp.float32))) < 1e-2, name


def test_by_shape_takes_the_kernel_for_a_few_rows_only(monkeypatch):
    """`impl="mosaic_by_shape"` (the choice without the Triton lowering): the kernel for up to
    BY_SHAPE_ROWS rows, XLA's gemm beyond (the kernel not called); both against float64."""
    from sfi_jax.kernels import skinny_matmul

    calls = []
    kernel = mgpu.skinny_matmul_partials
    monkeypatch.setattr(mgpu, "skinny_matmul_partials",
                        lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    for rows in (skinny_matmul.BY_SHAPE_ROWS, skinny_matmul.BY_SHAPE_ROWS + 1):
        x, ws = _inputs(30 + rows, rows, 256, 128, 1)
        out, = skinny_matmul.skinny_matmul(x, ws, impl="mosaic_by_shape")
        want = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(
            ws[0].astype(jnp.float32), np.float64)
        assert out.shape == (rows, 128) and rel_err(out, want) < 1e-2
    assert calls == [skinny_matmul.BY_SHAPE_ROWS]
