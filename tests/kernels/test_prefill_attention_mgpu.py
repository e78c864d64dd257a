"""The Mosaic GPU prefill attention kernel (`prefill_attention_mgpu`, impl="mosaic_gpu";
compiled on a GPU, the tests marked `gpu`, Mosaic GPU's interpret mode elsewhere) against the
dense jnp reference on fresh random bfloat16 inputs: ragged rows and offsets, T not a multiple
of the query block, GQA groups 1, 4 and 8, a stacked cache read at a traced layer and row; its
lowering for CUDA from any machine; what it refuses; where "auto" takes it. Both layouts: two
compute warpgroups beside a TMA producer (the default, `Config(warpgroups=2)`) and one
warpgroup per CTA (`Config(warpgroups=1)`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfi_jax.kernels import common
from sfi_jax.kernels import prefill_attention_mgpu as mgpu
from sfi_jax.kernels.prefill_attention import prefill_attention, resolve_impl
from sfi_jax.kernels.prefill_attention_reference import prefill_attention as reference

from conftest import gpu_interpret
from test_prefill_attention import _assert_close, _inputs

pytestmark = pytest.mark.usefixtures("xla_fast_compile", "interpret_threads_once")
BF16 = jnp.bfloat16


@pytest.mark.gpu
def test_offsets_and_ragged_rows():
    """Rows: q_start 0, a long filled prefix, a chunk whose tail is padding (kv_len inside the
    chunk) and an empty cache; T = 37 is not a multiple of the query block (32 with two
    warpgroups, 64 // G = 16 with one) and S = 296 not one of the 64-key blocks (the last one
    reads past the cache's end)."""
    t, s = 37, 296
    q, k, v = _inputs(101, 4, t, 8, 2, s, 64, BF16)
    q_start = jnp.array([0, 250, 60, 0], jnp.int32)
    kv_len = jnp.array([t, 250 + t, 60 + t - 9, 0], jnp.int32)
    want = reference(q, k, v, q_start, kv_len)
    out = prefill_attention(q, k, v, q_start, kv_len, impl="mosaic_gpu", block_k=64)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, want, q_start, kv_len, BF16, "mosaic_gpu")
    one = mgpu.prefill_attention(q, k, v, q_start, kv_len, interpret=gpu_interpret(),
                                 config=mgpu.Config(block_k=64, stages=2, warpgroups=1))
    _assert_close(one, want, q_start, kv_len, BF16, "mosaic_gpu, one warpgroup")


HEADS = {"g1-d64": (8, 8, 64), "g4-d128": (8, 2, 128), "g8-d64": (16, 2, 64),
         "g4-d256": (8, 2, 256)}


@pytest.mark.gpu
@pytest.mark.parametrize("heads, warpgroups", [
    pytest.param(HEADS[name], wg, id=f"{name}-{wg}") for name in HEADS for wg in (1, 2)])
def test_gqa_groups_and_head_dims(heads, warpgroups):
    """G = 1 (a 64-query block, longer than the chunk), 4 and 8 (8-query blocks), the default
    config through the dispatcher (two warpgroups, 128-key blocks, fewer stages at d 256,
    where two do not fit shared memory); one warpgroup, the same config fitted, through the
    kernel."""
    hq, hkv, d = heads
    t, s = 20, 152
    q, k, v = _inputs(hq * 7 + d, 2, t, hq, hkv, s, d, BF16)
    q_start = jnp.array([130, 3], jnp.int32)
    kv_len = jnp.array([150, 3 + t], jnp.int32)
    if warpgroups == 2:
        assert mgpu.DEFAULT.warpgroups == 2
        out = prefill_attention(q, k, v, q_start, kv_len, impl="mosaic_gpu")
    else:
        cfg = mgpu.fit(mgpu.Config(warpgroups=1), d)
        out = mgpu.prefill_attention(q, k, v, q_start, kv_len, interpret=gpu_interpret(),
                                     config=cfg)
    _assert_close(out, reference(q, k, v, q_start, kv_len), q_start, kv_len, BF16,
                  f"mosaic_gpu {heads}, {warpgroups} warpgroups")


@pytest.mark.gpu
def test_stacked_cache_traced_layer_and_row():
    """layer= and row= (both traced): query row b reads cache row row + b of a stacked cache
    with more rows than q; the other rows (different random values) are never read. Through
    the dispatcher, and the kernel directly with three stages in flight."""
    t, s = 24, 200
    q, k, v = _inputs(13, 2, t, 8, 2, s, 64, BF16, layers=3)
    q_start = jnp.array([150, 0], jnp.int32)
    kv_len = jnp.array([150 + t, t - 5], jnp.int32)
    rows = jnp.asarray(np.random.default_rng(14).standard_normal((3, 5, 2, s, 64)), BF16)
    fn = jax.jit(lambda q, k, v, qs, kl, layer, row: prefill_attention(
        q, k, v, qs, kl, impl="mosaic_gpu", block_k=64, layer=layer, row=row))
    direct = jax.jit(lambda q, k, v, qs, kl, layer, row: mgpu.prefill_attention(
        q, k, v, qs, kl, layer, row, interpret=gpu_interpret(),
        config=mgpu.Config(block_k=64, stages=3)))
    for layer, row in ((1, 3), (2, 0)):
        kc = rows.at[:, row:row + 2].set(k)
        vc = rows.at[:, row:row + 2].set(v)
        want = reference(q, k[layer], v[layer], q_start, kv_len)
        args = (q, kc, vc, q_start, kv_len, jnp.int32(layer), jnp.int32(row))
        _assert_close(fn(*args), want, q_start, kv_len, BF16, f"layer {layer} row {row}")
        if row:
            _assert_close(direct(*args), want, q_start, kv_len, BF16, "direct, 3 stages")


# (Hq, Hkv, D, T, S): Qwen3-4B's heads, a small odd chunk, head dim 256 (64-key blocks)
LOWER = [(32, 8, 128, 1000, 4096), (16, 2, 64, 37, 296), (8, 8, 256, 100, 512)]


@pytest.mark.parametrize("warpgroups", [1, 2])
@pytest.mark.parametrize("shape", LOWER, ids=["qwen3-4b", "g8-d64", "g1-d256"])
def test_kernel_lowers_for_cuda(shape, warpgroups):
    """Interpret mode does not prove the kernel compiles: its Mosaic GPU lowering (TMA slices
    of the swizzled tiles, wgmma operands, register layouts, barriers, and with two
    warpgroups the register-operand wgmma and the per-warpgroup register budgets) runs here,
    for CUDA, with the layer and row traced."""
    hq, hkv, d, t, s = shape
    cfg = mgpu.fit(mgpu.Config(warpgroups=warpgroups), d)
    sds = jax.ShapeDtypeStruct
    kv = sds((3, 2, hkv, s, d), BF16)
    i32 = sds((2,), jnp.int32)
    args = (sds((2, t, hq, d), BF16), kv, kv, i32, i32, sds((), jnp.int32), sds((), jnp.int32))
    fn = jax.jit(lambda q, k, v, qs, kl, layer, row: mgpu.prefill_attention(
        q, k, v, qs, kl, layer, row, config=cfg))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_refuses_what_it_cannot_tile():
    """float32 caches (wgmma would take TF32), a group not dividing 64, head dims other than
    64/128/256, S not a multiple of 8: `supported` is false and impl="mosaic_gpu" a clear
    error; block_q and block_k off its tiles are refused; "auto" off a GPU never picks it."""
    sds = jax.ShapeDtypeStruct
    ok_q, ok_k = sds((2, 16, 8, 64), BF16), sds((2, 2, 64, 64), BF16)
    assert mgpu.supported(ok_q, ok_k)
    bad = [(ok_q, sds((2, 2, 64, 64), jnp.float32)),  # f32 cache
           (sds((2, 16, 6, 64), BF16), ok_k),  # G = 3
           (sds((2, 16, 96, 64), BF16), sds((2, 1, 64, 64), BF16)),  # G = 96 > 64
           (sds((2, 16, 8, 96), BF16), sds((2, 2, 64, 96), BF16)),  # D = 96
           (ok_q, sds((2, 2, 60, 64), BF16))]  # S % 8
    for q, k in bad:
        assert not mgpu.supported(q, k), (q, k)
    assert resolve_impl("auto", jnp.zeros(ok_q.shape, BF16), jnp.zeros(ok_k.shape, BF16)) \
        != "mosaic_gpu"
    q, k, v = _inputs(0, 2, 8, 6, 2, 64, 64, BF16)
    qs, kl = jnp.zeros((2,), jnp.int32), jnp.full((2,), 8, jnp.int32)
    with pytest.raises(ValueError, match="impl='mosaic_gpu' takes .* G=3"):
        prefill_attention(q, k, v, qs, kl, impl="mosaic_gpu")
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    with pytest.raises(ValueError, match="impl='mosaic_gpu' takes .* float32"):
        prefill_attention(q[:, :, :4], k32, v32, qs, kl, impl="mosaic_gpu")
    with pytest.raises(ValueError, match="not supported|takes bf16/f16"):
        mgpu.prefill_attention(q, k, v, qs, kl, interpret=True)
    with pytest.raises(ValueError, match="block_k=96"):
        prefill_attention(q[:, :, :4], k, v, qs, kl, impl="mosaic_gpu", block_k=96)
    with pytest.raises(ValueError, match="block_q=16"):
        prefill_attention(q[:, :, :4], k, v, qs, kl, impl="mosaic_gpu", block_q=16)


@pytest.mark.parametrize("hopper", [False, True])
def test_auto_takes_it_on_a_hopper_gpu(hopper, monkeypatch):
    """On a GPU, "auto" is this kernel on a Hopper where it takes the inputs (it beats the cuDNN
    path there: benchmarks/prefill_kernel.md), then cuDNN, then the Triton kernel."""
    import sys

    module = sys.modules["sfi_jax.kernels.prefill_attention"]
    monkeypatch.setattr(module, "platform", lambda: "gpu")
    monkeypatch.setattr(common, "platform", lambda: "gpu")
    monkeypatch.setattr(common, "hopper", lambda: hopper)
    sds = jax.ShapeDtypeStruct
    q, k = sds((2, 16, 8, 64), BF16), sds((2, 2, 64, 64), BF16)
    assert resolve_impl("auto", q, k) == ("mosaic_gpu" if hopper else "cudnn")
    g3 = sds((2, 16, 6, 64), BF16)  # a group of 3 does not divide 64: cuDNN's
    assert resolve_impl("auto", g3, k) == "cudnn"
    f32 = (sds((2, 16, 8, 64), jnp.float32), sds((2, 2, 64, 64), jnp.float32))
    assert resolve_impl("auto", *f32) == "pallas_gpu"
