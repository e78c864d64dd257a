"""Interpret mode does not prove a kernel compiles: lower the TPU kernels for TPU and
export the GPU kernels for CUDA, from a CPU-only machine."""

import jax
import jax.numpy as jnp
import pytest

from sfi_jax.kernels import attention_gpu as gpu
from sfi_jax.kernels import attention_tpu as tpu

# every Triton module these exports build is verified (conftest.py)
pytestmark = pytest.mark.usefixtures("verify_triton")

# (Hq, Hkv, D, S, C, dtype): the Qwen3-4B shape in bf16 and an odd small one in f32.
SHAPES = [(32, 8, 128, 1000, 300, jnp.bfloat16), (5, 1, 64, 4096, 2052, jnp.float32)]
B, L = 2, 3


def _specs(hq, hkv, d, s, c, dtype):
    sds = jax.ShapeDtypeStruct
    return dict(q=sds((B, hq, d), dtype), kv=sds((L, B, hkv, s, d), dtype),
                ckv=sds((L, B, hkv, c, d), dtype), clen=sds((B, hkv), jnp.int32),
                vec=sds((B,), jnp.int32), layer=sds((), jnp.int32))


def _dense_fn(mod, logits):
    def f(q, k, v, lens, layer, rows):
        return mod.dense_decode(q, k, v, lens, layer, rows, return_logits=logits)
    return f


def _sparse_fn(mod, window, **kw):
    def f(q, ck, cv, c_len, k, v, rs, lens, layer):
        return mod.sparse_decode(q, ck, cv, c_len, k, v, rs, lens, layer, window=window, **kw)
    return f


def _cases(shape):
    sp = _specs(*shape)
    dense_args = (sp["q"], sp["kv"], sp["kv"], sp["vec"], sp["layer"], sp["vec"])
    sparse_args = (sp["q"], sp["ckv"], sp["ckv"], sp["clen"], sp["kv"], sp["kv"], sp["vec"],
                   sp["vec"], sp["layer"])
    return dense_args, sparse_args


@pytest.mark.parametrize("shape", SHAPES)
def test_tpu_kernels_lower_for_tpu(shape):
    dense_args, sparse_args = _cases(shape)
    for logits in (False, True):
        text = jax.jit(_dense_fn(tpu, logits)).trace(*dense_args).lower(
            lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text
    for window in (None, 257):
        text = jax.jit(_sparse_fn(tpu, window)).trace(*sparse_args).lower(
            lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text


@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_kernels_export_for_cuda(shape):
    dense_args, sparse_args = _cases(shape)
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    dense_arm = (lambda q, k, v, lens, layer: gpu.dense_decode(q, k, v, lens, layer),
                 dense_args[:5])  # no rows: program r reads cache row r
    for fn, args in [(_dense_fn(gpu, False), dense_args), (_dense_fn(gpu, True), dense_args),
                     dense_arm, (_sparse_fn(gpu, 257), sparse_args)]:
        exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
        assert "__gpu$xla.gpu.triton" in exp.mlir_module()


@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_in_place_variants_export_for_cuda(shape):
    """The engine's GPU path: the sparse kernel storing the new key/value/norm into aliased
    caches, and the dense kernel writing logits and outputs into aliased buffers."""
    hq, hkv, d, s, c, dtype = shape
    sp = _specs(*shape)
    sds = jax.ShapeDtypeStruct
    new = sds((B, hkv, d), dtype)
    norms = sds((L, B, hkv, s), jnp.float32)
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]

    def sparse(q, ck, cv, c_len, k, v, rs, lens, layer, kn, vn, n):
        return gpu.sparse_decode(q, ck, cv, c_len, k, v, rs, lens, layer, window=257,
                                 new_kv=(kn, vn), key_norms=n)

    def dense(q, k, v, lens, layer, rows, buf, out):
        return gpu.dense_decode(q, k, v, lens, layer, rows, logits_into=buf, out_into=out,
                                out_rows=rows)

    cases = [(sparse, (sp["q"], sp["ckv"], sp["ckv"], sp["clen"], sp["kv"], sp["kv"],
                       sp["vec"], sp["vec"], sp["layer"], new, new, norms)),
             (dense, (sp["q"], sp["kv"], sp["kv"], sp["vec"], sp["layer"], sp["vec"],
                      sds((L, B, hq, s), jnp.float32), sds((B + 3, hq, d), dtype))),
             (gpu.repack, (sp["ckv"], sp["ckv"], sp["kv"], sp["kv"],
                           sds((L, 3, hkv, c), jnp.int32), sds((3,), jnp.int32)))]
    for fn, args in cases:
        exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
        assert "__gpu$xla.gpu.triton" in exp.mlir_module()


@pytest.mark.parametrize("r", [4, 3, 64])
def test_selector_scores_kernel_exports_for_cuda(r):
    """The selector's kernels compile for CUDA: the scores (SFI_METHOD.md §4 steps 1-4) from
    the engine's scratch-buffer layout, with and without the prior term, and steps 5-6. The
    query rows per KV head (4, 3: not a power of two, 64) shape the scores kernel only: steps
    5-6 and every pad radius are exported once (r = 4), one padded scores kernel per r."""
    from sfi_jax.config import SFIConfig
    from sfi_jax.kernels import selector_gpu
    from sfi_jax.selector.select import score_params

    sds = jax.ShapeDtypeStruct
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    args = (sds((L, 2, 8, r, 4096), jnp.float32), sds((L, B, 8, 4096), jnp.float32),
            sds((L,), jnp.int32), sds((L,), jnp.int32), sds((), jnp.int32), sds((), jnp.int32))
    for cfg in (score_params(SFIConfig()), score_params(SFIConfig(lam_clip=0.0))):
        fn = jax.jit(lambda *a, c=cfg: selector_gpu.base_scores(*a, params=c))
        exp = jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args)
        assert "__gpu$xla.gpu.triton" in exp.mlir_module()
    # steps 5-6; radii 3 and 5: pads that are not a power of two (stored by masked
    # power-of-two stores: Triton's arrays have power-of-two sizes)
    radii = tuple(map(score_params, (SFIConfig(), SFIConfig(alpha_soft=0.0),
                                     SFIConfig(nms_radius=1), SFIConfig(nms_radius=3),
                                     SFIConfig(nms_radius=5, lam_clip=0.0))))
    for cfg in radii if r == 4 else radii[3:4]:
        pad = selector_gpu.adjust_pad(cfg)
        fn = jax.jit(lambda *a, c=cfg, p=pad: selector_gpu.base_scores(*a, params=c, pad=p))
        exp = jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args)
        assert "__gpu$xla.gpu.triton" in exp.mlir_module()
        if r != 4:
            continue
        fn = jax.jit(lambda z, lo, hi, c=cfg: selector_gpu.adjust_scores(z, lo, hi, params=c))
        exp = jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(
            sds((L, 8, 4096 + 2 * pad), jnp.float32), args[2], args[3])
        assert "__gpu$xla.gpu.triton" in exp.mlir_module()


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_kth_largest_key_kernel_exports_for_cuda(bits):
    """The top-k's radix search compiles for CUDA: a whole row (0.6b at 32K: 28 x 8 rows) and
    a sample shorter than its block."""
    from sfi_jax.kernels import selector_gpu

    sds = jax.ShapeDtypeStruct
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for rows, size, k in ((224, 32768, 2048), (288, 100, 7)):
        fn = jax.jit(lambda x, k=k: selector_gpu.kth_largest_key(x, k, radix_bits=bits))
        exp = jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(
            sds((rows, size), jnp.float32))
        assert "__gpu$xla.gpu.triton" in exp.mlir_module()


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_kth_largest_key_mosaic_kernel_lowers_for_cuda(bits):
    """The radix search's Mosaic GPU twin lowers for CUDA (its layouts, and its TMA boxes of at
    most 256 a dimension): a whole row (0.6b at 32K: 28 x 8 rows), a 128K row with no block
    but 128 dividing it (the least-blocks path), and a padded sample."""
    from sfi_jax.kernels import selector_mgpu

    for rows, size, k in ((224, 32768, 2048), (36, 131072 + 128, 2048), (288, 100, 7)):
        fn = jax.jit(lambda x, k=k: selector_mgpu.kth_largest_key(x, k, radix_bits=bits))
        text = fn.trace(jax.ShapeDtypeStruct((rows, size), jnp.float32)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.parametrize("lam_clip", [0.0, 1.0])
def test_scores_mosaic_kernels_lower_for_cuda(lam_clip):
    """The scores' Mosaic GPU twin lowers for CUDA (its three passes; with and without the
    prior): qwen3-0.6b's refresh at 32K (6 rows, 8 KV heads, groups of 2) and qwen3-4b's at
    128K (groups of 4)."""
    import dataclasses

    from sfi_jax.config import SFIConfig
    from sfi_jax.kernels import selector_mgpu
    from sfi_jax.selector.select import score_params

    params = score_params(dataclasses.replace(SFIConfig(), lam_clip=lam_clip))
    sds = jax.ShapeDtypeStruct
    for n, r, s in ((6, 2, 32768), (1, 4, 131072)):
        fn = jax.jit(lambda *a: selector_mgpu.base_scores(*a, params=params))
        text = fn.trace(sds((n, 28, 8, r, s), jnp.float32), sds((n, n, 8, s), jnp.float32),
                        sds((n,), jnp.int32), sds((n,), jnp.int32), sds((), jnp.int32),
                        sds((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("mosaic_gpu") >= 3


@pytest.mark.parametrize("qk_norm", [True, False])
def test_norm_rope_heads_kernel_exports_for_cuda(qk_norm):
    """The decode step's q/k norm + rope + v split compiles for CUDA (Qwen3-4B's heads)."""
    from sfi_jax.kernels import heads_gpu

    sds = jax.ShapeDtypeStruct
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    w = sds((128,), jnp.bfloat16) if qk_norm else None

    def fn(qkv, cos, sin, qn, kn):
        return heads_gpu.norm_rope_heads(qkv, cos, sin, qn, kn, num_q_heads=32, num_kv_heads=8,
                                         eps=1e-6)

    exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
        sds((6, 48 * 128), jnp.bfloat16), sds((6, 64), jnp.float32), sds((6, 64), jnp.float32),
        w, w)
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()


@pytest.mark.parametrize("qk_norm", [True, False])
def test_norm_rope_heads_mosaic_lowers_for_cuda(qk_norm):
    """The heads' Mosaic GPU twin lowers for CUDA (Qwen3-4B's heads; 6 rows padded, or read
    unpadded)."""
    from sfi_jax.kernels import heads_mgpu

    sds = jax.ShapeDtypeStruct
    w = sds((128,), jnp.bfloat16) if qk_norm else None
    for zero_fill in (False, True):
        def fn(qkv, cos, sin, qn, kn, zero_fill=zero_fill):
            return heads_mgpu.norm_rope_heads(qkv, cos, sin, qn, kn, num_q_heads=32,
                                              num_kv_heads=8, eps=1e-6, zero_fill=zero_fill)

        text = jax.jit(fn).trace(sds((6, 48 * 128), jnp.bfloat16), sds((6, 64), jnp.float32),
                                 sds((6, 64), jnp.float32), w, w).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def test_moe_kernels_export_for_cuda():
    """The grouped expert matmuls compile for CUDA at Qwen3-30B-A3B's expert shapes (16 tokens
    x top-8 of 128 experts): gate + up with the SiLU product, and down."""
    from sfi_jax.kernels import moe_gpu

    sds = jax.ShapeDtypeStruct
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    m, e, h, inter = 128, 128, 2048, 768
    bf = jnp.bfloat16
    cases = [(lambda x, w, g, w2: moe_gpu.grouped_matmul(x, w, g, w2),
              (sds((m, h), bf), sds((e, h, inter), bf), sds((e,), jnp.int32), sds((e, h, inter), bf))),
             (lambda x, w, g: moe_gpu.grouped_matmul(x, w, g),
              (sds((m + 16, inter), bf), sds((e, inter, h), bf), sds((e,), jnp.int32))),
             (lambda x, w, g: moe_gpu.grouped_matmul(x, w, g, block_n=128, block_k=32,
                                                      num_warps=8, num_stages=2),
              (sds((m + 16, inter), bf), sds((e, inter, h), bf), sds((e,), jnp.int32))),
             # per-expert tiles of a 16-token step (grouping "tokens")
             (lambda x, g, u, d, wts: moe_gpu.token_moe(x, g, u, d, wts),
              (sds((16, h), bf), sds((e, h, inter), bf), sds((e, h, inter), bf),
               sds((e, inter, h), bf), sds((16, e), jnp.float32))),
             # ... with the tile the model uses at these shapes
             (lambda x, g, u, d, wts: moe_gpu.token_moe(x, g, u, d, wts, block_n=128, block_k=64),
              (sds((16, h), bf), sds((e, h, inter), bf), sds((e, h, inter), bf),
               sds((e, inter, h), bf), sds((16, e), jnp.float32)))]
    for fn, args in cases:
        exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
        assert "__gpu$xla.gpu.triton" in exp.mlir_module()


@pytest.mark.parametrize("rows, n_w, normed, dtype, k, n", [
    (1, 2, True, jnp.bfloat16, 2560, 9728),   # gate + up, the norm folded in
    (4, 1, False, jnp.bfloat16, 9728, 2560),  # down: the N < K tiles
    (16, 2, True, jnp.float32, 2560, 6144)])  # float32: the shared-memory fit's smaller tiles
def test_skinny_matmul_kernel_exports_for_cuda(rows, n_w, normed, dtype, k, n):
    """The weight-streaming matmul compiles for CUDA at Qwen3-4B's shapes."""
    from sfi_jax.kernels import skinny_matmul_gpu

    sds = jax.ShapeDtypeStruct
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]

    def fn(x, w, norm):
        return skinny_matmul_gpu.skinny_matmul_partials(x, (w,) * n_w, norm if normed else None)

    exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
        sds((rows, k), dtype), sds((k, n), dtype), sds((k,), dtype))
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()


@pytest.mark.parametrize("epilogue, rows, k, n, stamps", [
    ("heads", 1, 2560, 6144, False),     # q/k/v, normed and rotated per head
    ("silu", 1, 2560, 9728, False),      # gate + up, the SiLU product
    ("residual", 4, 9728, 2560, False),  # down (the N < K tiles), the residual add
    ("heads", 1, 2560, 6144, True),      # with the phase stamps
    ("silu", 1, 2560, 9728, True)])
def test_skinny_matmul_epilogues_export_for_cuda(epilogue, rows, k, n, stamps):
    """The fused epilogues (a counter per column block, its last program adds the splits)
    compile for CUDA at Qwen3-4B's shapes; with phase_stamps=True each call also returns its
    programs' four timer stamps."""
    from sfi_jax.kernels import skinny_matmul_gpu as sm

    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    normed = epilogue != "residual"

    def fn(x, w, norm, sync, res, cos, qn):
        kw = dict(residual=res) if epilogue == "residual" else dict(
            cos=cos, sin=cos, q_norm=qn, k_norm=qn, num_q_heads=32, num_kv_heads=8) \
            if epilogue == "heads" else {}
        return sm.skinny_matmul_fused(x, (w,) * (2 if epilogue == "silu" else 1),
                                      norm if normed else None, sync, epilogue=epilogue,
                                      phase_stamps=stamps, **kw)

    exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
        sds((rows, k), bf), sds((k, n), bf), sds((k,), bf), sds((sm.SYNC_SIZE,), jnp.int32),
        sds((rows, n), bf), sds((rows, 64), jnp.float32), sds((128,), bf))
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()
    last = exp.out_avals[-1]
    if stamps:
        assert last.dtype == jnp.int32 and last.shape[1:] == (4, 16) and last.shape[0] > 1
    else:
        assert last.shape == (sm.SYNC_SIZE,)  # the counters come last


def test_decode_kernels_signal_dependents_after_their_main_loop(monkeypatch):
    """With programmatic dependent launch on (launch_dependents=True, and None on a GPU of
    compute capability 9.0 or more: the H100/H200) the sparse decode kernel, its merge, the
    fused matmul and the K-major one each signal `griddepcontrol.launch_dependents`, after an
    operand from the main loop; off (False, and None on a CPU or an older GPU) none does."""
    from sfi_jax.kernels import skinny_matmul_gpu as sm

    _triton_lowering = pytest.importorskip("jax._src.pallas.triton.lowering")
    device = jax.devices()[0]
    hopper = device.platform in ("gpu", "cuda") and float(device.compute_capability) >= 9.0
    modules = []
    lower = _triton_lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(str(result.module))
        return result

    monkeypatch.setattr(_triton_lowering, "lower_jaxpr_to_triton_module", capture)
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    _, sparse_args = _cases(SHAPES[0])

    for setting, signals in ((True, True), (False, False), (None, hopper)):
        def fused(x, w, sync, res):
            return sm.skinny_matmul_fused(x, (w,), None, sync, epilogue="residual", residual=res,
                                          launch_dependents=setting)

        def kmajor(x, g, u, norm):
            return sm.skinny_matmul_kmajor(x, (g, u), norm, epilogue="silu",
                                           launch_dependents=setting)

        modules.clear()
        for fn, args in [(_sparse_fn(gpu, 257, launch_dependents=setting), sparse_args),
                         (fused, (sds((1, 4096), bf), sds((4096, 2560), bf),
                                  sds((sm.SYNC_SIZE,), jnp.int32), sds((1, 2560), bf))),
                         (kmajor, (sds((3, 2560), bf), sds((9728, 2560), bf),
                                   sds((9728, 2560), bf), sds((2560,), bf)))]:
            jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
        assert len(modules) == 4  # sparse decode, its merge, the two matmuls
        assert ["griddepcontrol.launch_dependents" in m for m in modules] == [signals] * 4
