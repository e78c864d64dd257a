"""Prefill attention: every implementation against the dense jnp reference on fresh random
inputs (the GPU kernel compiled on a GPU, the tests marked `gpu`; Pallas kernels in interpret
mode elsewhere), the TPU kernel lowered for TPU and the GPU kernel
exported for CUDA, and the shape checks."""

import argparse
import importlib
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfi_jax.kernels import prefill_attention_gpu, prefill_attention_tpu
from sfi_jax.kernels.prefill_attention import prefill_attention
from sfi_jax.kernels.prefill_attention_reference import prefill_attention as reference
from sfi_jax.options import platform

from conftest import GPU_IMPL

# compiling many briefly-run programs is most of this file's time (conftest.py)
pytestmark = pytest.mark.usefixtures("xla_fast_compile")

IMPLS = ["xla", "pallas_gpu", "pallas_tpu"]
IMPL_PARAMS = ["xla", GPU_IMPL, "pallas_tpu"]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
# small blocks, so a few query and key blocks (whole ones and masked ones) are exercised
BLOCKS = {"xla": (16, 32), "pallas_gpu": (8, 32), "pallas_tpu": (16, 128)}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(seed, b, t, hq, hkv, s, d, dtype, layers=None):
    rng = np.random.default_rng(seed)
    cache = (b, hkv, s, d) if layers is None else (layers, b, hkv, s, d)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal(cache), dtype)
    v = jnp.asarray(rng.standard_normal(cache), dtype)
    return q, k, v


def _assert_close(out, want, q_start, kv_len, dtype, what):
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    t = out.shape[1]
    valid = (np.asarray(q_start)[:, None] + np.arange(t)[None, :]) < np.asarray(kv_len)[:, None]
    got, ref = out[valid], np.asarray(want.astype(jnp.float32), np.float64)[valid]
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < TOL[dtype], f"{what}: relative error {err:.2e} >= {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_offsets_and_ragged_rows(impl, dtype):
    """Rows: an empty prefix (q_start 0), a long filled prefix, a chunk whose tail is padding
    (kv_len inside the chunk) and an empty cache (all padding); T and S not block multiples."""
    t, s = 37, 300
    q, k, v = _inputs(IMPLS.index(impl) * 2 + (dtype == jnp.bfloat16), 4, t, 8, 2, s, 64, dtype)
    q_start = jnp.array([0, 250, 60, 0], jnp.int32)
    kv_len = jnp.array([t, 250 + t, 60 + t - 9, 0], jnp.int32)
    bq, bk = BLOCKS[impl]
    out = prefill_attention(q, k, v, q_start, kv_len, impl=impl, block_q=bq, block_k=bk)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, reference(q, k, v, q_start, kv_len), q_start, kv_len, dtype, impl)


@pytest.mark.parametrize("heads", [(4, 4, 128), (4, 2, 64), (5, 1, 64), (16, 2, 128)],
                         ids=["g1-d128", "g2-d64", "g5-d64", "g8-d128"])
@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_gqa_groups_and_head_dims(impl, heads):
    hq, hkv, d = heads
    t, s = 20, 150
    dtype = jnp.bfloat16 if d == 128 else jnp.float32
    q, k, v = _inputs(hq * 7 + d, 2, t, hq, hkv, s, d, dtype)
    q_start = jnp.array([130, 3], jnp.int32)
    kv_len = jnp.array([150, 3 + t], jnp.int32)
    bq, bk = BLOCKS[impl]
    out = prefill_attention(q, k, v, q_start, kv_len, impl=impl, block_q=bq, block_k=bk)
    _assert_close(out, reference(q, k, v, q_start, kv_len), q_start, kv_len, dtype,
                  f"{impl} {heads}")


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_stacked_cache_traced_layer(impl):
    """layer= reads one layer of a stacked cache in place, with the layer traced."""
    t, s = 24, 200
    q, k, v = _inputs(11, 2, t, 4, 2, s, 64, jnp.float32, layers=3)
    q_start = jnp.array([170, 0], jnp.int32)
    kv_len = jnp.array([170 + t, t - 5], jnp.int32)
    fn = jax.jit(lambda q, k, v, qs, kl, layer: prefill_attention(q, k, v, qs, kl, impl=impl,
                                                                   layer=layer))
    for layer in (2, 0):
        out = fn(q, k, v, q_start, kv_len, jnp.int32(layer))
        want = reference(q, k[layer], v[layer], q_start, kv_len)
        _assert_close(out, want, q_start, kv_len, jnp.float32, f"{impl} layer {layer}")


@pytest.mark.parametrize("impl", IMPL_PARAMS + [pytest.param("cudnn", marks=pytest.mark.gpu)])
def test_row_offset_reads_the_given_cache_rows(impl):
    """row= (traced): query row b reads cache row row + b of a cache with more rows than q (an
    Engine's slot), in a stacked cache at a traced layer; the other rows are never read.
    cuDNN (a GPU only) in bfloat16, the dtype it takes."""
    if impl == "cudnn" and platform() != "gpu":
        pytest.skip("cuDNN runs on a GPU only")
    dtype = jnp.bfloat16 if impl == "cudnn" else jnp.float32
    t, s = 24, 200
    q, k, v = _inputs(13, 2, t, 4, 2, s, 64, dtype, layers=3)
    q_start = jnp.array([150, 0], jnp.int32)
    kv_len = jnp.array([150 + t, t - 5], jnp.int32)
    rows = jnp.asarray(np.random.default_rng(14).standard_normal((3, 5, 2, s, 64)), dtype)
    fn = jax.jit(lambda q, k, v, qs, kl, layer, row: prefill_attention(
        q, k, v, qs, kl, impl=impl, layer=layer, row=row))
    for layer, row in ((1, 3), (2, 0)):
        kc = rows.at[:, row:row + 2].set(k)
        vc = rows.at[:, row:row + 2].set(v)
        out = fn(q, kc, vc, q_start, kv_len, jnp.int32(layer), jnp.int32(row))
        want = reference(q, k[layer], v[layer], q_start, kv_len)
        _assert_close(out, want, q_start, kv_len, dtype, f"{impl} layer {layer} row {row}")
    with pytest.raises(ValueError, match="only 1 rows"):
        prefill_attention(q, rows[:, :1], rows[:, :1], q_start, kv_len, impl=impl, layer=0,
                          row=0)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_default_blocks_single_query(impl):
    """Default block sizes, and a chunk of one query at the end of a filled prefix."""
    q, k, v = _inputs(5, 2, 1, 8, 2, 300, 64, jnp.bfloat16)
    q_start = jnp.array([299, 17], jnp.int32)
    kv_len = q_start + 1
    out = prefill_attention(q, k, v, q_start, kv_len, impl=impl)
    _assert_close(out, reference(q, k, v, q_start, kv_len), q_start, kv_len, jnp.bfloat16, impl)


def test_bad_inputs_name_the_value():
    q, k, v = _inputs(0, 2, 8, 4, 2, 64, 16, jnp.float32)
    qs, kl = jnp.zeros((2,), jnp.int32), jnp.full((2,), 8, jnp.int32)
    cases = [
        (dict(q=q[0]), r"q has shape \(8, 4, 16\)"),
        (dict(k=k[0]), r"k has shape \(2, 64, 16\)"),
        (dict(v=v[:, :, :32]), "differ"),
        (dict(q=q[..., :8]), r"head dim of q \(8\) and k \(16\)"),
        (dict(q=jnp.zeros((2, 8, 3, 16))), "3 query heads are not a multiple of 2"),
        (dict(q=q[:1]), "batch 1"),
        (dict(q_start=jnp.zeros((3,), jnp.int32)), r"q_start is int32\[3\]"),
        (dict(kv_len=jnp.zeros((2,), jnp.float32)), r"kv_len is float32\[2\]"),
        (dict(impl="cuda"), "impl='cuda'"),
        (dict(impl="pallas_gpu", block_k=48), "block_k=48"),
        (dict(impl="pallas_tpu", block_k=64), "block_k=64"),
        (dict(impl="pallas_tpu", block_q=12), "block_q=12"),
        (dict(block_q=0), "block_q=0"),
        (dict(layer=0), r"k has shape \(2, 2, 64, 16\)"),
        (dict(q=q.astype(jnp.int32)), "q has dtype int32"),
    ]
    for bad, match in cases:
        kw = dict(q=q, k=k, v=v, q_start=qs, kv_len=kl)
        kw.update(bad)
        args = [kw.pop(n) for n in ("q", "k", "v", "q_start", "kv_len")]
        with pytest.raises(ValueError, match=match):
            prefill_attention(*args, **kw)


# (Hq, Hkv, D, T, S, dtype): the Qwen3-4B shape in bf16 and an odd small one in f32.
LOWER = [(32, 8, 128, 1000, 4096, jnp.bfloat16), (5, 1, 64, 37, 300, jnp.float32)]


def _specs(hq, hkv, d, t, s, dtype):
    sds = jax.ShapeDtypeStruct
    kv = sds((3, 2, hkv, s, d), dtype)
    return (sds((2, t, hq, d), dtype), kv, kv, sds((2,), jnp.int32), sds((2,), jnp.int32),
            sds((), jnp.int32))


@pytest.mark.parametrize("shape", LOWER)
def test_tpu_kernel_lowers_for_tpu(shape):
    fn = jax.jit(lambda q, k, v, qs, kl, layer: prefill_attention_tpu.prefill_attention(
        q, k, v, qs, kl, layer))
    text = fn.trace(*_specs(*shape)).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("shape", LOWER)
def test_gpu_kernel_exports_for_cuda(shape, verify_triton):
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for cfg in (None, prefill_attention_gpu.Config(rows=64, block_k=128, num_warps=4)):
        fn = jax.jit(lambda q, k, v, qs, kl, layer, c=cfg: prefill_attention_gpu.prefill_attention(
            q, k, v, qs, kl, layer, config=c))
        exp = jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*_specs(*shape))
        assert "__gpu$xla.gpu.triton" in exp.mlir_module()


def test_bench_script_smoke(tmp_path):
    """scripts/bench/bench_prefill_kernel.py --smoke runs tiny shapes on the xla path, checks them
    against the reference and writes its JSON."""
    path = os.path.join(ROOT, "scripts", "bench", "bench_prefill_kernel.py")
    spec = importlib.util.spec_from_file_location("bench_prefill_kernel", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "prefill_kernel.json"
    bench.main(["--smoke", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["rows"] and all(r["max_rel_err"] < 2e-2 for r in res["rows"])
    assert bench.parse_heads("16:8:128") == (16, 8, 128)  # --heads: the GPU shapes' heads
    for bad in ("16:3:128", "16:8", "a:b:c"):
        with pytest.raises(argparse.ArgumentTypeError, match="--heads"):
            bench.parse_heads(bad)


def test_cudnn_impl_needs_a_gpu():
    """The cuDNN path is GPU-only (timed on the GPU by scripts/bench/bench_prefill_kernel.py):
    asking for it elsewhere, or for inputs cuDNN does not take (float32), is a clear error;
    "auto" picks it on a GPU for the inputs it takes and never off a GPU; on a GPU its output
    is the reference's."""
    mod = importlib.import_module("sfi_jax.kernels.prefill_attention")
    t = 20
    q, k, v = _inputs(11, 2, t, 4, 2, 64, 64, jnp.bfloat16)
    q_start = jnp.array([0, 30], jnp.int32)
    kv_len = jnp.array([t, 30 + t], jnp.int32)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    backend = platform()
    assert mod.resolve_impl("auto", q, k) == {"gpu": "cudnn", "tpu": "pallas_tpu"}.get(backend,
                                                                                       "xla")
    assert mod.resolve_impl("auto", q32, k32) != "cudnn"
    with pytest.raises(ValueError, match="cudnn"):
        mod.prefill_attention(q32, k32, v32, q_start, kv_len, impl="cudnn")
    if backend != "gpu":
        with pytest.raises(ValueError, match="cudnn"):
            mod.prefill_attention(q, k, v, q_start, kv_len, impl="cudnn")
        return
    out = mod.prefill_attention(q, k, v, q_start, kv_len, impl="cudnn")
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, reference(q, k, v, q_start, kv_len), q_start, kv_len, jnp.bfloat16,
                  "cudnn")


@pytest.mark.parametrize("prefix", ["slab", "pieces"])
def test_cudnn_path_prefix_forms(prefix, monkeypatch):
    """The cuDNN path's split-and-merge logic, each form of its prefix call (off a GPU with
    XLA's attention in cuDNN's place; the gpu-marked twin below runs cuDNN): prefixes of
    0, 1, 3, 5 and 7 whole chunks shared by every row (the "pieces" form: runs of 4, 2 and 1
    chunks), a ragged batch and one off the chunk grid (both take the masked slab), at a
    traced layer and cache row."""
    from sfi_jax.kernels import prefill_attention_cudnn as cudnn_path

    if platform() != "gpu":
        monkeypatch.setattr(cudnn_path, "IMPLEMENTATION", "xla")
    dtype = jnp.bfloat16 if platform() == "gpu" else jnp.float32
    t, s = 16, 8 * 16
    q, k, v = _inputs(21, 2, t, 4, 2, s, 64, dtype, layers=2)
    rows = jnp.asarray(np.random.default_rng(22).standard_normal((2, 4, 2, s, 64)), dtype)
    kc, vc = rows.at[:, 1:3].set(k), rows.at[:, 1:3].set(v)
    fn = jax.jit(lambda q, k, v, qs, kl: cudnn_path.prefill_attention(
        q, k, v, qs, kl, layer=jnp.int32(1), row=jnp.int32(1), prefix=prefix))
    for starts in ([0, 0], [16, 16], [48, 48], [80, 80], [112, 112], [48, 96], [40, 40]):
        q_start = jnp.array(starts, jnp.int32)
        kv_len = q_start + t - jnp.array([0, 3], jnp.int32)
        out = fn(q, kc, vc, q_start, kv_len)
        want = reference(q, k[1], v[1], q_start, kv_len)
        _assert_close(out, want, q_start, kv_len, dtype, f"cudnn path, {prefix}, {starts}")


@pytest.mark.gpu
def test_cudnn_prefix_pieces_on_the_gpu():
    """The "pieces" form on cuDNN itself, at the benchmark's head shape."""
    from sfi_jax.kernels import prefill_attention_cudnn as cudnn_path

    if platform() != "gpu":
        pytest.skip("cuDNN runs on a GPU only")
    t, s = 256, 8 * 256
    q, k, v = _inputs(23, 1, t, 32, 8, s, 128, jnp.bfloat16)
    for start in (0, 256, 768, 1792):
        q_start = jnp.array([start], jnp.int32)
        kv_len = q_start + t
        out = cudnn_path.prefill_attention(q, k, v, q_start, kv_len, prefix="pieces")
        want = reference(q, k, v, q_start, kv_len)
        _assert_close(out, want, q_start, kv_len, jnp.bfloat16, f"cudnn pieces at {start}")
