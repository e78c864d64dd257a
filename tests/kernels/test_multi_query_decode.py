"""Multi-query (verify) decode attention: the jnp reference against a float64 loop, every
implementation against the reference (the GPU kernel compiled on a GPU, the tests marked `gpu`;
Pallas in interpret mode elsewhere), T = 1 against the
dense decode kernel, and the kernels lowered for TPU and exported for CUDA.

Shapes are tiny but lengths land on block and split edges, caches are not block multiples,
rows hold padding queries or none valid at all, and GQA groups 1, 2, 4, 5, 8, 16 appear.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from sfi_jax.kernels import attention_mgpu
from sfi_jax.kernels import multi_query_decode_gpu as mq_gpu
from sfi_jax.kernels import multi_query_decode_mgpu as mq_mgpu
from sfi_jax.kernels import multi_query_decode_reference as mq_ref
from sfi_jax.kernels import multi_query_decode_tpu as mq_tpu
from sfi_jax.kernels.multi_query_decode import multi_query_decode

from conftest import GPU_IMPL, MGPU_IMPL, with_impls, assert_close_logits, gpu_interpret, normal, rel_err

# compiling many briefly-run programs is most of this file's time (conftest.py)
pytestmark = pytest.mark.usefixtures("xla_fast_compile")

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# Small blocks so that a few hundred keys span several blocks and splits.
GPU_CFG = mq_gpu.Config(block_k=32, num_warps=4, num_stages=2, programs=16)
TPU_BLOCK = 128
MGPU_CFG = attention_mgpu.Config(block_k=64, stages=2, programs=8)
IMPLS = ["xla", GPU_IMPL, MGPU_IMPL, "pallas_tpu"]


def _run(impl, q, k, v, qs, kl, **kw):
    """An implementation with test-sized blocks (several blocks and splits per row)."""
    layer = kw.pop("layer", None)
    if impl == "pallas_gpu":
        return mq_gpu.multi_query_decode(q, k, v, qs, kl, layer, config=GPU_CFG,
                                         interpret=gpu_interpret(), **kw)
    if impl == "mosaic_gpu":
        return mq_mgpu.multi_query_decode(q, k, v, qs, kl, layer, config=MGPU_CFG,
                                          interpret=gpu_interpret(), **kw)
    if impl == "pallas_tpu":
        return mq_tpu.multi_query_decode(q, k, v, qs, kl, layer, block_k=TPU_BLOCK,
                                         interpret=pltpu.InterpretParams(), **kw)
    return multi_query_decode(q, k, v, qs, kl, layer=layer, impl=impl, **kw)


def _oracle(q, k, v, qs, kl):
    """float64 loops: (out [B, T, Hq, D], logits [B, Hq, T, S], lse [B, Hq, T])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    out = np.zeros(q.shape)
    logits = np.full((b, hq, t, s), -np.inf)
    lse = np.full((b, hq, t), -np.inf)
    for r in range(b):
        for i in range(t):
            p = int(qs[r]) + i
            if p >= int(kl[r]):
                continue  # a padding query
            n = max(min(p + 1, int(kl[r])), 0)
            for h in range(hq):
                kh = h // (hq // hkv)
                sc = k[r, kh, :n] @ q[r, i, h] / math.sqrt(d)
                logits[r, h, i, :n] = sc
                if n:
                    w = np.exp(sc - sc.max())
                    out[r, i, h] = w @ v[r, kh, :n] / w.sum()
                    lse[r, h, i] = sc.max() + np.log(w.sum())
    return out, logits, lse


def _case(seed, b, t, hq, hkv, d, s, dtype, layers=None):
    cache = (b, hkv, s, d) if layers is None else (layers, b, hkv, s, d)
    return (normal([seed, 0], (b, t, hq, d), dtype), normal([seed, 1], cache, dtype),
            normal([seed, 2], cache, dtype))


def test_reference_matches_float64_loops():
    """Causal edges, a padding query (row 1), a row without valid queries (row 2), a query
    before any key (row 3: q_start -1), GQA group 5."""
    q, k, v = _case(0, 4, 3, 10, 2, 16, 37, jnp.float32)
    qs, kl = np.array([0, 33, 20, -1]), np.array([3, 35, 20, 1])
    out, lg, lse = mq_ref.multi_query_decode(q, k, v, jnp.asarray(qs), jnp.asarray(kl),
                                             return_logits=True)
    o_out, o_lg, o_lse = _oracle(q, k, v, qs, kl)
    assert rel_err(out, o_out) <= 1e-6
    assert_close_logits(lg, o_lg, 1e-6)
    assert_close_logits(lse, o_lse, 1e-6)
    assert np.isneginf(o_lse[1, :, 2]).all() and np.isneginf(o_lse[2]).all()
    assert np.isneginf(o_lse[3, :, 0]).all() and np.isfinite(o_lse[3, :, 1]).all()


# (T, Hq, Hkv, D, S, dtype, q_start, kv_len): every T of the contract and GQA group once;
# rows cover block/split edges, S, padding queries (kv_len < q_start + T) and empty rows.
CASES = [
    (1, 2, 2, 64, 130, jnp.float32, [0, 129, -1], [1, 130, 0]),
    (2, 4, 2, 128, 300, jnp.bfloat16, [126, 254, 95], [128, 256, 96]),
    (3, 8, 2, 64, 257, jnp.float32, [0, 254, 30], [3, 257, 31]),
    (4, 10, 2, 64, 200, jnp.bfloat16, [195, 60, 10], [199, 64, 10]),
    (5, 8, 1, 64, 160, jnp.float32, [0, 155, 100], [5, 158, 160]),
    (8, 16, 1, 128, 96, jnp.bfloat16, [88, 40], [96, 45]),
    # the second case with S a multiple of 8 (the Mosaic GPU kernel's)
    (2, 4, 2, 128, 304, jnp.bfloat16, [126, 254, 95], [128, 256, 96]),
]


@pytest.mark.parametrize("t,hq,hkv,d,s,dtype,q_start,kv_len,impl",
                         with_impls(CASES, IMPLS, slow=(3,)))
def test_matches_reference(impl, t, hq, hkv, d, s, dtype, q_start, kv_len):
    if impl == "mosaic_gpu" and (dtype == jnp.float32 or t * hq // hkv > 64 or s % 8):
        pytest.skip("float32 caches, G * T > 64 and S % 8 take the Triton kernel")
    if impl != "mosaic_gpu" and s == 304:
        pytest.skip("the Mosaic GPU twin of the second case")
    b = len(kv_len)
    q, k, v = _case(t * 100 + hq, b, t, hq, hkv, d, s, dtype)
    qs, kl = jnp.asarray(q_start, jnp.int32), jnp.asarray(kv_len, jnp.int32)
    out, lg, lse = _run(impl, q, k, v, qs, kl, return_logits=True)
    if impl == "xla":  # the reference itself: against float64 loops
        r_out, r_lg, r_lse = _oracle(q, k, v, q_start, kv_len)
    else:
        r_out, r_lg, r_lse = mq_ref.multi_query_decode(q, k, v, qs, kl, return_logits=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lg.shape == (b, hq, t, s) and lg.dtype == jnp.float32
    assert lse.shape == (b, hq, t) and lse.dtype == jnp.float32
    assert rel_err(out, r_out) <= TOL[dtype]
    assert_close_logits(lg, r_lg, 1e-5)
    assert_close_logits(lse, r_lse, 1e-5)
    # padding queries, rows without a valid query, a query before any key: zeros and -inf
    pos = np.asarray(qs)[:, None] + np.arange(t)[None, :]
    pad = (pos >= np.asarray(kl)[:, None]) | (pos < 0)
    assert pad.any()
    assert not np.asarray(out, np.float32)[pad].any()
    assert np.isneginf(np.asarray(lse).transpose(0, 2, 1)[pad]).all()
    if t in (2, 5) or impl == "mosaic_gpu" and t == 4:  # the no-logits variant (slow compiles)
        assert rel_err(_run(impl, q, k, v, qs, kl), r_out) <= TOL[dtype]


@pytest.mark.parametrize("impl", IMPLS)
def test_stacked_cache_read_at_traced_layer(impl):
    dtype = jnp.bfloat16 if impl == "mosaic_gpu" else jnp.float32
    q, k, v = _case(7, 3, 4, 8, 2, 64, 200, dtype, layers=3)
    qs, kl = jnp.asarray([196, 60, 0], jnp.int32), jnp.asarray([200, 63, 4], jnp.int32)
    f = jax.jit(lambda layer: _run(impl, q, k, v, qs, kl, layer=layer, return_logits=True))
    for layer in (1, 2):
        out, lg, lse = f(jnp.int32(layer))
        r_out, r_lg, r_lse = mq_ref.multi_query_decode(q, k[layer], v[layer], qs, kl,
                                                       return_logits=True)
        assert rel_err(out, r_out) <= TOL[dtype]
        assert_close_logits(lg, r_lg, 1e-5)
        assert_close_logits(lse, r_lse, 1e-5)


@pytest.mark.parametrize("impl", [i if i != MGPU_IMPL else pytest.param(
    "mosaic_gpu", marks=[pytest.mark.gpu, pytest.mark.slow]) for i in IMPLS])
def test_one_query_equals_dense_decode(impl):
    """T = 1 at the last position is a decode step: the same outputs, logits and lse as the
    dense decode kernel (default tuning of both), empty row included."""
    from sfi_jax.kernels import dense_decode

    b, hq, hkv, d, s = 3, 8, 2, 64, 296 if impl == "mosaic_gpu" else 300
    dtype = jnp.bfloat16 if impl == "mosaic_gpu" else jnp.float32
    q, k, v = _case(11, b, 1, hq, hkv, d, s, dtype)
    kl = jnp.asarray([s, 0, 129], jnp.int32)
    out, lg, lse = multi_query_decode(q, k, v, kl - 1, kl, return_logits=True, impl=impl)
    d_out, d_lg, d_lse = dense_decode(q[:, 0], k, v, kl, return_logits=True, impl=impl)
    assert rel_err(out[:, 0], d_out) <= (1e-5 if dtype == jnp.float32 else TOL[dtype])
    assert_close_logits(lg[:, :, 0], d_lg, 1e-5)
    assert_close_logits(lse[:, :, 0], d_lse, 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_one_query_logits(impl):
    """logits_query: each row's logits at its chosen query alone, [B, Hq, S], equal to that
    query's slice of the float64 oracle; the outputs as without it. Rows: a query inside the
    causal span, the first and last query, a padding query (its logits all -inf), and rows
    with no logits query, which the GPU kernel leaves unwritten (not compared)."""
    t, hq, hkv, d, s = 4, 8, 2, 64, 200
    dtype = jnp.bfloat16 if impl == "mosaic_gpu" else jnp.float32
    q, k, v = _case(21, 6, t, hq, hkv, d, s, dtype, layers=2)
    qs = jnp.asarray([100, 196, 30, 60, 0, 150], jnp.int32)
    kl = jnp.asarray([104, 200, 34, 62, 4, 154], jnp.int32)
    lq = jnp.asarray([2, 3, 0, 3, -1, 4], jnp.int32)  # row 3's query 3 is padding
    if impl == "pallas_gpu":  # test-sized blocks and splits
        out, lg, lse = _run(impl, q, k, v, qs, kl, layer=jnp.int32(1), return_logits=True,
                            logits_query=lq)
    else:  # the others gather from all queries' logits in the entry point
        out, lg, lse = multi_query_decode(q, k, v, qs, kl, layer=1, return_logits=True,
                                          logits_query=lq, impl=impl)
    o_out, o_lg, o_lse = _oracle(q, k[1], v[1], np.asarray(qs), np.asarray(kl))
    assert lg.shape == (6, hq, s) and lg.dtype == jnp.float32
    assert rel_err(out, o_out) <= TOL[dtype]
    assert_close_logits(lse, o_lse, 1e-5)
    for r, i in enumerate(np.asarray(lq)):
        if 0 <= i < t:
            assert_close_logits(lg[r], o_lg[r, :, i], 1e-5)
    assert np.isneginf(np.asarray(lg[3])).all()


def test_logits_query_needs_logits_and_a_row_each():
    q, k = jnp.zeros((2, 3, 4, 8)), jnp.zeros((2, 2, 16, 8))
    n = jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="needs return_logits"):
        multi_query_decode(q, k, k, n, n, logits_query=n)
    with pytest.raises(ValueError, match=r"logits_query is int32\[3\]"):
        multi_query_decode(q, k, k, n, n, return_logits=True,
                           logits_query=jnp.zeros((3,), jnp.int32))


@pytest.mark.parametrize("impl", [GPU_IMPL, MGPU_IMPL, "pallas_tpu"])
def test_dispatcher_runs_kernel_on_cpu(impl):
    """The public entry point with the kernel's own default tuning."""
    s = 136 if impl == "mosaic_gpu" else 130  # Mosaic: S a multiple of 8
    q, k, v = _case(3, 2, 4, 8, 2, 64, s, jnp.bfloat16)
    qs, kl = jnp.asarray([126, 20], jnp.int32), jnp.asarray([130, 22], jnp.int32)
    r_out = mq_ref.multi_query_decode(q, k, v, qs, kl)
    assert rel_err(multi_query_decode(q, k, v, qs, kl, impl=impl), r_out) <= TOL[jnp.bfloat16]


def _bad(**kw):
    q, k = jnp.zeros((2, 3, 4, 8)), jnp.zeros((2, 2, 16, 8))
    args = dict(q=q, k=k, v=k, q_start=jnp.zeros((2,), jnp.int32),
                kv_len=jnp.ones((2,), jnp.int32))
    args.update(kw)
    opts = {n: args.pop(n) for n in ("layer", "impl") if n in args}
    return lambda: multi_query_decode(**args, **opts)


@pytest.mark.parametrize("kw,match", [
    (dict(q=jnp.zeros((2, 4, 8))), "expected \\[B, T, Hq, D\\]"),
    (dict(q=jnp.zeros((2, 0, 4, 8))), "T=0"),
    (dict(q=jnp.zeros((2, 17, 4, 8))), "T=17"),
    (dict(q=jnp.zeros((2, 3, 4, 8)), k=jnp.zeros((2, 2, 2, 8)), v=jnp.zeros((2, 2, 2, 8))),
     "do not fit"),
    (dict(v=jnp.zeros((2, 2, 15, 8))), "differ"),
    (dict(k=jnp.zeros((2, 3, 16, 8)), v=jnp.zeros((2, 3, 16, 8))), "not a multiple"),
    (dict(k=jnp.zeros((2, 2, 16, 4)), v=jnp.zeros((2, 2, 16, 4))), "head dim"),
    (dict(k=jnp.zeros((3, 2, 16, 8)), v=jnp.zeros((3, 2, 16, 8))), "3 rows"),
    (dict(k=jnp.zeros((1, 2, 2, 16, 8)), v=jnp.zeros((1, 2, 2, 16, 8))), "k has shape"),
    (dict(layer=0), "layer given"),
    (dict(q_start=jnp.zeros((3,), jnp.int32)), "q_start"),
    (dict(kv_len=jnp.ones((2,), jnp.float32)), "kv_len"),
    (dict(impl="cuda"), "impl='cuda'"),
])
def test_bad_input_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        _bad(**kw)()


def test_gpu_kernel_rejects_too_many_rows():
    q, k = jnp.zeros((1, 16, 32, 16)), jnp.zeros((1, 1, 32, 16))
    n = jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="512 rows"):
        mq_gpu.multi_query_decode(q, k, k, n, n, interpret=True)


# --- compiles for the real platforms (interpret mode does not prove it) --------------------

# (T, Hq, Hkv, D, S, dtype): Qwen3-4B's heads in bf16 (16 and 32 rows), an odd f32 one
# (group 5: 20 -> 32 rows) and the largest row count (group 16 x 16 queries).
EXPORT_SHAPES = [(4, 32, 8, 128, 1000, jnp.bfloat16), (8, 32, 8, 128, 1000, jnp.bfloat16),
                 (4, 5, 1, 64, 4096, jnp.float32), (16, 16, 1, 64, 300, jnp.bfloat16)]


def _specs(t, hq, hkv, d, s, dtype):
    sds = jax.ShapeDtypeStruct
    vec = sds((2,), jnp.int32)
    return (sds((2, t, hq, d), dtype), sds((3, 2, hkv, s, d), dtype),
            sds((3, 2, hkv, s, d), dtype), vec, vec, sds((), jnp.int32))


@pytest.mark.parametrize("shape", EXPORT_SHAPES)
def test_gpu_kernel_exports_for_cuda(shape, verify_triton):
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for logits in (False, True, "one"):
        def f(q, k, v, qs, kl, layer, logits=logits):
            return mq_gpu.multi_query_decode(q, k, v, qs, kl, layer, return_logits=bool(logits),
                                             logits_query=qs if logits == "one" else None)

        exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(
            *_specs(*shape))
        assert exp.mlir_module().count("__gpu$xla.gpu.triton") >= 2  # attention + combine


@pytest.mark.parametrize("shape", EXPORT_SHAPES[::2])
def test_tpu_kernel_lowers_for_tpu(shape):
    for logits in (False, True):
        def f(q, k, v, qs, kl, layer, logits=logits):
            return mq_tpu.multi_query_decode(q, k, v, qs, kl, layer, return_logits=logits)

        text = jax.jit(f).trace(*_specs(*shape)).lower(lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text


def test_bench_script_smoke(tmp_path):
    """scripts/bench/bench_multi_query_kernel.py --smoke: tiny shapes on the CPU, checked against
    the reference by the script itself (it exits non-zero when a case is off)."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "scripts" / "bench" / "bench_multi_query_kernel.py"
    spec = importlib.util.spec_from_file_location("bench_multi_query_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "mq.json"
    mod.main(["--smoke", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["rel_err"]["out"] <= TOL[jnp.bfloat16] for r in rows)
    assert all(r["ours_s"] > 0 and r["bytes_logits"] > r["bytes"] for r in rows)
