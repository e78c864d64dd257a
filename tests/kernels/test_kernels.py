"""Decode kernels against the jnp reference: the GPU kernels compiled on a GPU (the tests
marked `gpu`) and in interpret mode elsewhere, the TPU kernels in interpret mode.

Shapes are small but chosen so that lengths land on block and split edges, caches are
not multiples of the block, and every GQA group size the models use appears once.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

# compiling many briefly-run programs is most of this file's time (conftest.py)
pytestmark = pytest.mark.usefixtures("xla_fast_compile")

from sfi_jax.kernels import attention as api
from sfi_jax.kernels import attention_gpu as gpu
from sfi_jax.kernels import attention_mgpu as mgpu
from sfi_jax.kernels import attention_reference as reference
from sfi_jax.kernels import attention_tpu as tpu
from sfi_jax.kernels import dense_decode, sparse_decode
from sfi_jax.options import platform

from conftest import GPU_IMPL, MGPU_IMPL, with_impls, assert_close_logits, gpu_interpret, host_rng, normal, rel_err

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# Small blocks so that a few hundred keys span several blocks and splits.
GPU_CFG = gpu.Config(block_k=32, num_warps=4, num_stages=2, programs=16)
TPU_BLOCK = 128
# Mosaic GPU: 64-key blocks (its smallest) and few programs, so splits end mid-cache.
# two score blocks (a block's logits written while the last block's store reads its own);
# test_multi_query_decode.py's Mosaic config keeps the default one
MGPU_CFG = mgpu.Config(block_k=64, stages=2, programs=8, score_buffers=2)
IMPLS = ["pallas_gpu", "mosaic_gpu", "pallas_tpu"]
IMPL_PARAMS = [GPU_IMPL, MGPU_IMPL, "pallas_tpu"]  # the GPU kernels' tests marked `gpu`


def _dense(impl, q, k, v, lens, **kw):
    if impl == "pallas_gpu":
        return gpu.dense_decode(q, k, v, lens, kw.pop("layer", None), kw.pop("rows", None),
                                config=GPU_CFG, interpret=gpu_interpret(), **kw)
    if impl == "mosaic_gpu":
        return mgpu.dense_decode(q, k, v, lens, kw.pop("layer", None), kw.pop("rows", None),
                                 config=MGPU_CFG, interpret=gpu_interpret(), **kw)
    return tpu.dense_decode(q, k, v, lens, kw.pop("layer", None), kw.pop("rows", None),
                            interpret=pltpu.InterpretParams(), block_k=TPU_BLOCK, **kw)


def _sparse(impl, *args, **kw):
    if impl == "pallas_gpu":
        return gpu.sparse_decode(*args, kw.pop("layer", None), config=GPU_CFG,
                                 interpret=gpu_interpret(), **kw)
    if impl == "mosaic_gpu":
        return mgpu.sparse_decode(*args, kw.pop("layer", None), config=MGPU_CFG,
                                  interpret=gpu_interpret(), **kw)
    return tpu.sparse_decode(*args, kw.pop("layer", None), interpret=pltpu.InterpretParams(),
                             block_k=TPU_BLOCK, **kw)


# (Hq, Hkv, D, S, dtype, lengths): lengths cover 0, 1, odd, block/split edges and S.
DENSE_CASES = [
    (2, 2, 64, 130, jnp.float32, [0, 1, 129, 130]),
    (4, 2, 128, 300, jnp.bfloat16, [128, 256, 97]),
    (8, 2, 64, 257, jnp.float32, [32, 257, 96]),
    (10, 2, 64, 200, jnp.bfloat16, [199, 64]),
    (16, 2, 128, 96, jnp.bfloat16, [95, 33]),
    (16, 1, 128, 160, jnp.float32, [160, 1, 127]),
]


@pytest.mark.parametrize("hq,hkv,d,s,dtype,lengths,impl",
                         with_impls(DENSE_CASES, IMPL_PARAMS, slow=(4,)))
def test_dense_matches_reference(impl, hq, hkv, d, s, dtype, lengths):
    if impl == "mosaic_gpu" and (dtype == jnp.float32 or s % 8):
        pytest.skip("float32 caches and S % 8 take the Triton kernel (test_mosaic_dispatch)")
    b = len(lengths)
    ks = jax.random.split(jax.random.PRNGKey(hq * 1000 + s), 3)
    q = normal(ks[0], (b, hq, d), dtype)
    k, v = normal(ks[1], (b, hkv, s, d), dtype), normal(ks[2], (b, hkv, s, d), dtype)
    lens = jnp.asarray(lengths, jnp.int32)
    out, lg, lse = _dense(impl, q, k, v, lens, return_logits=True)
    r_out, r_lg, r_lse = reference.dense_decode(q, k, v, lens, return_logits=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lg.shape == (b, hq, s) and lg.dtype == jnp.float32
    assert rel_err(out, r_out) <= TOL[dtype]
    assert_close_logits(lg, r_lg, 1e-5)
    assert_close_logits(lse, r_lse, 1e-5)
    if s == 130 or (impl == "mosaic_gpu" and s == 96):  # the no-logits variant once per impl
        assert rel_err(_dense(impl, q, k, v, lens), r_out) <= TOL[dtype]
    for i, n in enumerate(lengths):
        if n == 0:
            assert not np.asarray(out[i]).any() and np.isneginf(np.asarray(lse[i])).all()


@pytest.mark.gpu
def test_sweep_points_change_how_not_what():
    """The GPU kernels' sweep points are arguments: the splits merged with jnp
    (pallas_combine=False) and another config give the reference's output, lengths 0 included."""
    hq, hkv, d, s, dtype, lengths = DENSE_CASES[0]
    ks = jax.random.split(jax.random.PRNGKey(7), 3)
    q = normal(ks[0], (len(lengths), hq, d), dtype)
    shape = (len(lengths), hkv, s, d)
    k, v = normal(ks[1], shape, dtype), normal(ks[2], shape, dtype)
    lens = jnp.asarray(lengths, jnp.int32)
    ref = reference.dense_decode(q, k, v, lens)
    other = gpu.Config(block_k=64, num_warps=4, num_stages=2, programs=4)
    for config, combine in ((GPU_CFG, False), (other, True)):
        out = gpu.dense_decode(q, k, v, lens, config=config, pallas_combine=combine,
                               interpret=gpu_interpret())
        assert rel_err(out, ref) <= TOL[dtype], (config, combine)
        assert not np.asarray(out[0]).any()  # the row of length 0
    hq, hkv, d, s, c, dtype, c_len, rs, lengths = SPARSE_CASES[0]
    q, ck, cv, k, v = _sparse_inputs(jax.random.PRNGKey(8), b=len(lengths), hq=hq, hkv=hkv,
                                     s=s, c=c, d=d, dtype=dtype)
    c_len, rs, lens = (jnp.asarray(x, jnp.int32) for x in (c_len, rs, lengths))
    out = gpu.sparse_decode(q, ck, cv, c_len, k, v, rs, lens, config=other,
                            pallas_combine=False, interpret=gpu_interpret())
    assert rel_err(out, reference.sparse_decode(q, ck, cv, c_len, k, v, rs, lens)) <= TOL[dtype]


def test_split_plans_cover_every_key():
    """decode_splits covers `total` keys in whole blocks, no split left empty; with
    fixed_keys (programs = the SM count) the plan is the one whose busiest SM finishes first:
    8 KV heads on 132 SMs take 16 splits (17 leave 4 SMs a second program, 32 double every
    SM's fixed cost), 128 heads take 1, and 80 take 8 (1 split leaves 52 SMs idle)."""
    from sfi_jax.kernels.common import decode_splits

    for total in (1, 64, 1000, 32768, 131072):
        for pairs in (1, 8, 80, 128, 300):
            for fixed in (None, 128):
                split, n = decode_splits(total, pairs, 64, 132, fixed)
                assert split % 64 == 0 and n >= 1 and split * n >= total
                assert split * (n - 1) < total, (total, pairs, fixed)
    assert decode_splits(131072, 8, 128, 132) == (7808, 17)
    for total in (16384, 32768, 131072):
        assert decode_splits(total, 8, 64, 132, 128) == (total // 16, 16)
        assert decode_splits(total, 128, 64, 132, 128) == (total, 1)
        assert decode_splits(total, 80, 64, 132, 128)[1] == 8


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["zero_fill", "p_regs", "one_split"])
def test_mosaic_variants_match_reference(variant):
    """The Mosaic kernels' variants, dense with logits (groups of 2) and sparse (groups of 2)
    against the reference: `zero_fill` (KernelTuning.zero_fill: each query group read
    unpadded, its rows past the group as TMA's zeros; interpret mode reads out of bounds as
    zeros), `p_regs` (Config.p_regs: P·V's operand from registers) and `one_split` (a grid
    of one split a row and head: the kernel writes the output, no merge after it)."""
    cfg = dataclasses.replace(MGPU_CFG, p_regs=variant == "p_regs",
                              programs=1 if variant == "one_split" else MGPU_CFG.programs)
    kw = dict(config=cfg, interpret=gpu_interpret(), zero_fill=variant == "zero_fill")
    hq, hkv, d, s, dtype, lengths = 4, 2, 64, 192, jnp.bfloat16, [192, 65, 1]
    ks = jax.random.split(jax.random.PRNGKey(77), 3)
    q = normal(ks[0], (len(lengths), hq, d), dtype)
    k, v = (normal(x, (len(lengths), hkv, s, d), dtype) for x in ks[1:])
    lens = jnp.asarray(lengths, jnp.int32)
    out, lg, lse = mgpu.dense_decode(q, k, v, lens, return_logits=True, **kw)
    r_out, r_lg, r_lse = reference.dense_decode(q, k, v, lens, return_logits=True)
    assert rel_err(out, r_out) <= TOL[dtype]
    assert_close_logits(lg, r_lg, 1e-5)
    assert_close_logits(lse, r_lse, 1e-5)
    assert rel_err(mgpu.dense_decode(q, k, v, lens, **kw), r_out) <= TOL[dtype]
    hq, hkv, d, s, c, dtype, c_len, rs, lengths = SPARSE_CASES[-1]
    q, ck, cv, k, v = _sparse_inputs(jax.random.PRNGKey(78), b=len(lengths), hq=hq, hkv=hkv,
                                     s=s, c=c, d=d, dtype=dtype)
    c_len, rs, lens = (jnp.asarray(x, jnp.int32) for x in (c_len, rs, lengths))
    out = mgpu.sparse_decode(q, ck, cv, c_len, k, v, rs, lens, **kw)
    assert rel_err(out, reference.sparse_decode(q, ck, cv, c_len, k, v, rs, lens)) <= TOL[dtype]


def _stacked_case(seed, n_keys, dtype):
    """Three query rows [3, 8, 64] and a stacked cache k, v [3 layers, 4, 2, 200, 64], and the
    split keys (the first three made them)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), n_keys)
    shape = (3, 4, 2, 200, 64)
    return normal(ks[0], (3, 8, 64), dtype), normal(ks[1], shape, dtype), \
        normal(ks[2], shape, dtype), ks


@pytest.mark.parametrize("impl", [GPU_IMPL, pytest.param("mosaic_gpu", marks=[
    pytest.mark.gpu, pytest.mark.slow]), "pallas_tpu"])  # mosaic: layer also in the api test
def test_dense_layer_and_rows_read_in_place(impl):
    dtype = jnp.bfloat16 if impl == "mosaic_gpu" else jnp.float32
    q, k, v, _ = _stacked_case(5, 3, dtype)
    rows = jnp.asarray([3, 0, 3], jnp.int32)
    lens = jnp.asarray([200, 65, 7], jnp.int32)
    layer = jnp.int32(1)
    out, lg, lse = _dense(impl, q, k, v, lens, return_logits=True, layer=layer, rows=rows)
    r_out, r_lg, r_lse = reference.dense_decode(q, k[1][rows], v[1][rows], lens,
                                                return_logits=True)
    assert rel_err(out, r_out) <= TOL[dtype]
    assert_close_logits(lg, r_lg, 1e-5)
    assert_close_logits(lse, r_lse, 1e-5)
    # The layer index may be traced (as inside a scan over layers).
    f = jax.jit(lambda l: _dense(impl, q, k, v, lens, layer=l, rows=rows))
    want = reference.dense_decode(q, k[2][rows], v[2][rows], lens)
    assert rel_err(f(jnp.int32(2)), want) <= TOL[dtype]


@pytest.mark.parametrize("impl", [GPU_IMPL, "xla"])
def test_dense_logits_into_buffer(impl):
    """Logits written into layer l of a stacked buffer: the valid positions equal the
    reference, other layers stay as they were; the GPU kernel also leaves positions past a
    row's length (all of an empty row) untouched and skips empty rows' splits."""
    q, k, v, ks = _stacked_case(9, 4, jnp.bfloat16)
    rows = jnp.asarray([2, 0, 3], jnp.int32)
    lens = jnp.asarray([200, 0, 71], jnp.int32)
    buf = normal(ks[3], (3, 3, 8, 200), jnp.float32)  # [L, rows, Hq, S]
    before = np.asarray(buf)
    kw = dict(config=GPU_CFG, interpret=gpu_interpret()) if impl == "pallas_gpu" else {}
    fn = gpu.dense_decode if impl == "pallas_gpu" else (
        lambda *a, **k_: api.dense_decode(*a[:4], layer=a[4], rows=a[5], impl="xla", **k_))
    out, new, lse = fn(q, k, v, lens, jnp.int32(1), rows, logits_into=buf, **kw)
    r_out, r_lg, r_lse = reference.dense_decode(q, k[1][rows], v[1][rows], lens,
                                                return_logits=True)
    assert rel_err(out, r_out) <= TOL[jnp.bfloat16]
    assert_close_logits(lse, r_lse, 1e-5)
    new = np.asarray(new)
    np.testing.assert_array_equal(new[[0, 2]], before[[0, 2]])
    for i, n in enumerate(np.asarray(lens)):
        assert rel_err(new[1, i, :, :n], r_lg[i, :, :n]) <= 1e-5 if n else True
        if impl == "pallas_gpu":
            np.testing.assert_array_equal(new[1, i, :, n:], before[1, i, :, n:])
    assert not np.asarray(out[1]).any() and np.isneginf(np.asarray(lse[1])).all()
    with pytest.raises(ValueError, match="logits_into"):
        api.dense_decode(q, k, v, lens, layer=1, rows=rows, logits_into=buf[:, :2])


def _sparse_inputs(key, *, b, hq, hkv, s, c, d, dtype, layers=None):
    ks = jax.random.split(key, 5)
    pre = (layers,) if layers else ()
    q = normal(ks[0], (b, hq, d), dtype)
    k, v = normal(ks[1], pre + (b, hkv, s, d), dtype), normal(ks[2], pre + (b, hkv, s, d), dtype)
    ck = normal(ks[3], pre + (b, hkv, c, d), dtype)
    cv = normal(ks[4], pre + (b, hkv, c, d), dtype)
    return q, ck, cv, k, v


# (Hq, Hkv, D, S, C, dtype, c_len rows, recent_start, lengths)
SPARSE_CASES = [
    # c_len 0..C, an empty window (rs == len), a full window (rs == 0), a 1-key window.
    (4, 2, 64, 300, 150, jnp.float32, [[0, 150], [77, 1], [129, 128]], [300, 0, 256],
     [300, 257, 257]),
    (2, 2, 128, 200, 37, jnp.bfloat16, [[37, 0], [5, 36]], [10, 199], [139, 200]),
    (10, 2, 64, 100, 60, jnp.float32, [[0, 0], [60, 33]], [50, 0], [50, 100]),
    (16, 1, 128, 130, 20, jnp.bfloat16, [[20], [0]], [64, 0], [129, 0]),
    # half precision, S and Hkv * C multiples of 8 (the Mosaic kernel's; C itself is not), the
    # first case's edges
    (4, 2, 64, 304, 148, jnp.bfloat16, [[0, 148], [77, 1], [129, 128]], [304, 0, 256],
     [304, 257, 257]),
]


@pytest.mark.parametrize("hq,hkv,d,s,c,dtype,c_len,rs,lengths,impl",
                         with_impls(SPARSE_CASES, IMPL_PARAMS))
def test_sparse_matches_reference(impl, hq, hkv, d, s, c, dtype, c_len, rs, lengths):
    if impl == "mosaic_gpu" and (dtype == jnp.float32 or s % 8 or hkv * c % 8):
        pytest.skip("float32 caches, S or Hkv * C % 8 take the Triton kernel (test_mosaic_dispatch)")
    if impl != "mosaic_gpu" and dtype == jnp.bfloat16 and d == 64:
        pytest.skip("the half-precision twin of the first case, for the Mosaic kernel")
    b = len(lengths)
    q, ck, cv, k, v = _sparse_inputs(jax.random.PRNGKey(s + c), b=b, hq=hq, hkv=hkv, s=s, c=c,
                                     d=d, dtype=dtype)
    c_len, rs, lens = (jnp.asarray(x, jnp.int32) for x in (c_len, rs, lengths))
    out = _sparse(impl, q, ck, cv, c_len, k, v, rs, lens)
    ref = reference.sparse_decode(q, ck, cv, c_len, k, v, rs, lens)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, ref) <= TOL[dtype]
    empty = (np.asarray(c_len).sum(1) == 0) & (np.asarray(rs) >= np.asarray(lens))
    assert not np.asarray(out)[empty].any()
    if s in (300, 304):  # a static bound on the window (what the runtime passes) changes nothing
        window = int(np.max(np.asarray(lens) - np.asarray(rs)))
        out = _sparse(impl, q, ck, cv, c_len, k, v, rs, lens, window=window)
        assert rel_err(out, ref) <= TOL[dtype]


def f_stacked(impl, *args):
    return _sparse(impl, *args, layer=jnp.int32(2), window=130)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_sparse_layer_read_in_place(impl):
    dtype = jnp.bfloat16 if impl == "mosaic_gpu" else jnp.float32
    s, c = (264, 140) if impl == "mosaic_gpu" else (260, 140)  # Mosaic: S a multiple of 8
    q, ck, cv, k, v = _sparse_inputs(jax.random.PRNGKey(9), b=2, hq=8, hkv=2, s=s, c=c,
                                     d=64, dtype=dtype, layers=3)
    c_len = jnp.asarray([[140, 3], [0, 129]], jnp.int32)
    rs, lens = jnp.asarray([200, 1], jnp.int32), jnp.asarray([260, 130], jnp.int32)
    f = jax.jit(lambda l: _sparse(impl, q, ck, cv, c_len, k, v, rs, lens, layer=l, window=130))
    out = f(jnp.int32(2))
    ref = reference.sparse_decode(q, ck[2], cv[2], c_len, k[2], v[2], rs, lens)
    assert rel_err(out, ref) <= TOL[dtype]
    if impl != "pallas_tpu":  # c_len stacked like the caches: layer 2's counts are read
        stacked = jnp.stack([c_len[::-1], c_len[::-1], c_len])
        assert rel_err(f_stacked(impl, q, ck, cv, stacked, k, v, rs, lens), ref) <= TOL[dtype]


def _new_token_case(seed, n_layers, b, hq, hkv, s, c, d, dtype):
    """Stacked caches and compact buffers, the step's key/value [B, Hkv, D] and key norms."""
    q, ck, cv, k, v = _sparse_inputs(jax.random.PRNGKey(seed), b=b, hq=hq, hkv=hkv, s=s, c=c,
                                     d=d, dtype=dtype, layers=n_layers)
    ks = jax.random.split(jax.random.PRNGKey(seed + 1), 3)
    kn, vn = normal(ks[0], (b, hkv, d), dtype), normal(ks[1], (b, hkv, d), dtype)
    norms = jnp.asarray(host_rng(ks[2]).random((n_layers, b, hkv, s), dtype=np.float32))
    return q, ck, cv, k, v, kn, vn, norms


def _check_new_token_stored(k, v, norms, kn, vn, lens, k2, v2, n2, layer=1):
    """k2, v2, n2 are k, v, norms with the step's key/value (and the key's norm) at position
    lens[i] - 1 of layer `layer`, nothing else changed; returns the expected k, v."""
    want_k, want_v, want_n = (np.array(x) for x in (k, v, norms))
    for i, n in enumerate(np.asarray(lens)):
        want_k[layer, i, :, n - 1] = np.asarray(kn[i])
        want_v[layer, i, :, n - 1] = np.asarray(vn[i])
        want_n[layer, i, :, n - 1] = np.linalg.norm(np.asarray(kn[i], np.float32), axis=-1)
    np.testing.assert_array_equal(np.asarray(k2), want_k)
    np.testing.assert_array_equal(np.asarray(v2), want_v)
    np.testing.assert_allclose(np.asarray(n2), want_n, rtol=1e-6)
    return want_k, want_v


@pytest.mark.parametrize("impl", [GPU_IMPL, MGPU_IMPL, "xla"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sparse_writes_the_new_token(impl, dtype):
    if impl == "mosaic_gpu" and dtype == jnp.float32:
        pytest.skip("float32 caches take the Triton kernel (test_mosaic_dispatch)")
    """new_kv: the step's key/value land at position lengths - 1 of layer l (norm too), nothing
    else changes, and the output equals the reference over the updated cache (the GPU kernel
    attends to the new token from registers, so it never reads the position it writes)."""
    n_layers, b, hq, hkv, s, c, d = 3, 3, 10, 2, 200, 68 if impl == "mosaic_gpu" else 70, 64
    q, ck, cv, k, v, kn, vn, norms = _new_token_case(21, n_layers, b, hq, hkv, s, c, d, dtype)
    c_len = jnp.asarray([[70, 3], [0, 0], [33, 64]], jnp.int32)
    lens = jnp.asarray([200, 1, 97], jnp.int32)  # row 1: the new token alone
    rs = jnp.asarray([150, 0, 96], jnp.int32)  # row 2: an empty cached window
    layer = jnp.int32(1)
    if impl == "pallas_gpu":
        runs = {"": jax.jit(lambda k, v, n: gpu.sparse_decode(
            q, ck, cv, c_len, k, v, rs, lens, layer, window=64, new_kv=(kn, vn), key_norms=n,
            config=GPU_CFG, interpret=gpu_interpret()))(k, v, norms)}
    else:  # (the Mosaic kernel with and without its own stores: jax 0.11 on, compiled)
        runs = {f"kernel_stores={ks}": jax.jit(lambda k, v, n, ks=ks: sparse_decode(
            q, ck, cv, c_len, k, v, rs, lens, layer=layer, window=64, new_kv=(kn, vn),
            key_norms=n, impl=impl, kernel_stores=ks))(k, v, norms)
                for ks in ((False, True) if impl == "mosaic_gpu" else (False,))}
    for what, (out, k2, v2, n2) in runs.items():
        want_k, want_v = _check_new_token_stored(k, v, norms, kn, vn, lens, k2, v2, n2)
        ref = reference.sparse_decode(q, ck[1], cv[1], c_len, jnp.asarray(want_k[1]),
                                      jnp.asarray(want_v[1]), rs, lens)
        assert rel_err(out, ref) <= TOL[dtype], what


@pytest.mark.parametrize("impl", [GPU_IMPL, "xla"])
def test_dense_output_into_rows(impl):
    """out_into: row i's output lands in row dest[i] of the given buffer (dest out of range:
    dropped); the buffer's other rows stay as they were."""
    b, hq, hkv, s, d = 5, 8, 2, 150, 64
    ks = jax.random.split(jax.random.PRNGKey(31), 4)
    k = normal(ks[1], (b, hkv, s, d), jnp.float32)
    v = normal(ks[2], (b, hkv, s, d), jnp.float32)
    rows = jnp.asarray([4, 1, 0], jnp.int32)
    dest = jnp.asarray([4, 7, 0], jnp.int32)  # 7 >= 5: dropped
    q = normal(ks[0], (3, hq, d), jnp.float32)
    lens = jnp.asarray([150, 20, 0], jnp.int32)
    base = normal(ks[3], (b, hq, d), jnp.float32)
    if impl == "pallas_gpu":
        got = gpu.dense_decode(q, k, v, lens, None, rows, out_into=base, out_rows=dest,
                               config=GPU_CFG, interpret=gpu_interpret())
    else:
        got = api.dense_decode(q, k, v, lens, rows=rows, out_into=(base, dest), impl=impl)
    ref = reference.dense_decode(q, k[rows], v[rows], lens)
    want = np.array(base)
    want[4], want[0] = np.asarray(ref[0]), np.asarray(ref[2])
    assert rel_err(got, want) <= 1e-5
    np.testing.assert_array_equal(np.asarray(got)[[1, 2, 3]], np.asarray(base)[[1, 2, 3]])
    assert not np.asarray(got[0]).any()  # a row of length 0 gives zeros
    # gather_q: q with the cache's rows, row i using q[rows[i]] (no gathered copy)
    q_all = normal(ks[0], (b, hq, d), jnp.float32)
    if impl == "pallas_gpu":
        out = gpu.dense_decode(q_all, k, v, lens, None, rows, gather_q=True, config=GPU_CFG,
                               interpret=gpu_interpret())
    else:
        out = api.dense_decode(q_all, k, v, lens, rows=rows, gather_q=True, impl=impl)
    assert rel_err(out, reference.dense_decode(q_all[rows], k[rows], v[rows], lens)) <= 1e-5
    with pytest.raises(ValueError, match="gather_q"):
        api.dense_decode(q_all[:3], k, v, lens, rows=rows, gather_q=True)


@pytest.mark.parametrize("impl", [GPU_IMPL, MGPU_IMPL, "xla"])
def test_repack_copies_the_selected_rows(impl):
    """repack: occupied slots get the cache rows at their positions (entries at -1 move
    nothing with Triton's kernel), every other row of the compact buffers stays as it was;
    the Mosaic GPU twin in blocks of 4 positions (C = 36: 9 blocks)."""
    n_layers, b, hkv, s, c, d = 3, 4, 2, 50, 37 - (impl == "mosaic_gpu"), 64
    ks = jax.random.split(jax.random.PRNGKey(41), 5)
    k = normal(ks[0], (n_layers, b, hkv, s, d), jnp.bfloat16)
    v = normal(ks[1], (n_layers, b, hkv, s, d), jnp.bfloat16)
    ck = normal(ks[2], (n_layers, b, hkv, c, d), jnp.bfloat16)
    cv = normal(ks[3], (n_layers, b, hkv, c, d), jnp.bfloat16)
    slots = jnp.asarray([2, 0, 5], jnp.int32)  # 5 >= b: an empty slot
    pos = jnp.asarray(host_rng(ks[4]).integers(-1, s, (n_layers, 3, hkv, c), dtype=np.int32))
    if impl == "pallas_gpu":
        got = gpu.repack(ck, cv, k, v, pos, slots, interpret=gpu_interpret(), block=16)
    elif impl == "mosaic_gpu":
        got = mgpu.repack(ck, cv, k, v, pos, slots, interpret=gpu_interpret(), block=4)
        np.testing.assert_array_equal(  # (the dispatch takes the twin too)
            np.asarray(api.repack(ck, cv, k, v, pos, slots, impl=impl)[0]), np.asarray(got[0]))
    else:
        got = api.repack(ck, cv, k, v, pos, slots, impl=impl)
    pos_np = np.asarray(pos)
    for new, old, cache in zip(got, (ck, cv), (k, v)):
        new, old, cache = np.asarray(new), np.asarray(old), np.asarray(cache)
        np.testing.assert_array_equal(new[:, [1, 3]], old[:, [1, 3]])
        for j, row in enumerate([2, 0]):
            for l in range(n_layers):
                for h in range(hkv):
                    p = pos_np[l, j, h]
                    np.testing.assert_array_equal(new[l, row, h][p >= 0],
                                                  cache[l, row, h][p[p >= 0]])
                    if impl == "pallas_gpu":
                        np.testing.assert_array_equal(new[l, row, h][p < 0],
                                                      old[l, row, h][p < 0])
    with pytest.raises(ValueError, match="positions"):
        api.repack(ck, cv, k, v, pos[:, :2], slots)


def test_sparse_equals_dense_over_the_union():
    """The compact buffer holding positions [0, P) plus the window [P, len) is dense attention."""
    b, hq, hkv, s, d, p = 2, 8, 2, 90, 64, 40
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    q = normal(ks[0], (b, hq, d), jnp.float32)
    k, v = normal(ks[1], (b, hkv, s, d), jnp.float32), normal(ks[2], (b, hkv, s, d), jnp.float32)
    lens = jnp.asarray([90, 61], jnp.int32)
    c_len = jnp.full((b, hkv), p, jnp.int32)
    rs = jnp.full((b,), p, jnp.int32)
    got = sparse_decode(q, k[:, :, :p], v[:, :, :p], c_len, k, v, rs, lens, impl="xla")
    assert rel_err(got, reference.dense_decode(q, k, v, lens)) <= 1e-5


def _np_attention(q, keys, vals):
    """float64 softmax attention of one query over a list of keys."""
    if len(keys) == 0:
        return np.zeros_like(q), -np.inf
    s = np.asarray(keys) @ q / math.sqrt(q.shape[0])
    m = s.max()
    p = np.exp(s - m)
    return p @ np.asarray(vals) / p.sum(), m + np.log(p.sum())


def test_reference_matches_numpy_loops():
    b, hq, hkv, s, c, d = 2, 6, 3, 20, 7, 8
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(x) for x in [(b, hq, d), (b, hkv, s, d), (b, hkv, s, d)])
    ck, cv = rng.standard_normal((b, hkv, c, d)), rng.standard_normal((b, hkv, c, d))
    lens, rs = np.array([13, 0]), np.array([9, 0])
    c_len = np.array([[0, 7, 3], [2, 0, 1]])
    out, lg, lse = reference.dense_decode(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
                                          jnp.asarray(lens), return_logits=True)
    sp = reference.sparse_decode(*(jnp.asarray(x, jnp.float32) for x in (q, ck, cv)),
                                 jnp.asarray(c_len), *(jnp.asarray(x, jnp.float32) for x in (k, v)),
                                 jnp.asarray(rs), jnp.asarray(lens))
    g = hq // hkv
    for i in range(b):
        for h in range(hq):
            kh = h // g
            o, l = _np_attention(q[i, h], k[i, kh, :lens[i]], v[i, kh, :lens[i]])
            np.testing.assert_allclose(out[i, h], o, atol=1e-5)
            np.testing.assert_allclose(lse[i, h], l, atol=1e-5)
            want = k[i, kh] @ q[i, h] / math.sqrt(d)
            np.testing.assert_allclose(lg[i, h, :lens[i]], want[:lens[i]], atol=1e-5)
            assert np.isneginf(np.asarray(lg[i, h, lens[i]:])).all()
            keys = np.concatenate([ck[i, kh, :c_len[i, kh]], k[i, kh, rs[i]:lens[i]]])
            vals = np.concatenate([cv[i, kh, :c_len[i, kh]], v[i, kh, rs[i]:lens[i]]])
            np.testing.assert_allclose(sp[i, h], _np_attention(q[i, h], keys, vals)[0], atol=1e-5)


def test_reference_window_path_matches_full_path():
    q, ck, cv, k, v = _sparse_inputs(jax.random.PRNGKey(1), b=3, hq=4, hkv=2, s=50, c=9, d=16,
                                     dtype=jnp.float32)
    c_len = jnp.asarray([[9, 0], [4, 4], [0, 0]], jnp.int32)
    rs, lens = jnp.asarray([45, 0, 3], jnp.int32), jnp.asarray([50, 6, 3], jnp.int32)
    full = reference.sparse_decode(q, ck, cv, c_len, k, v, rs, lens)
    assert rel_err(reference.sparse_decode(q, ck, cv, c_len, k, v, rs, lens, window=6), full) < 1e-6


def _numpy_attention(q, keys, values):
    """Attention of q [Hq, D] over per-KV-head keys and values (lists of [n, D]) in float64;
    query head h reads KV head h // G."""
    q = np.asarray(q, np.float64)
    G = q.shape[0] // len(keys)
    out = []
    for h in range(q.shape[0]):
        kh, vh = (np.asarray(x[h // G], np.float64) for x in (keys, values))
        s = kh @ q[h] / math.sqrt(q.shape[-1])
        p = np.exp(s - s.max())
        out.append(p @ vh / p.sum())
    return np.stack(out)


def test_api_dispatch_and_defaults():
    """Every implementation, "auto" included, gives numpy's attention on distinct k and v."""
    rng = host_rng(0)
    q, k, v, ck, cv = (rng.standard_normal(shape, dtype=np.float32) for shape in
                       [(2, 4, 64), (2, 2, 40, 64), (2, 2, 40, 64), (2, 2, 8, 64), (2, 2, 8, 64)])
    lens, recent = np.array([40, 3], np.int32), np.array([30, 1], np.int32)
    c_len = np.array([[5, 8], [0, 2]], np.int32)
    want = np.stack([_numpy_attention(q[b], k[b, :, :lens[b]], v[b, :, :lens[b]])
                     for b in range(2)])

    def union(c, x, b):  # the compact buffer's valid prefix, then the recent window
        return [np.concatenate([c[b, h, :c_len[b, h]], x[b, h, recent[b]:lens[b]]])
                for h in range(2)]

    want_sparse = np.stack([_numpy_attention(q[b], union(ck, k, b), union(cv, v, b))
                            for b in range(2)])
    q, k, v, ck, cv, lens, recent, c_len = map(jnp.asarray, (q, k, v, ck, cv, lens, recent, c_len))
    # "auto" is the platform's kernel ("xla" on a CPU, where CI runs)
    assert api.resolve_impl("auto") == {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(
        platform(), "xla")
    for impl in ["auto", "xla"] + IMPLS:
        assert rel_err(dense_decode(q, k, v, lens, impl=impl), want) <= 1e-5, impl
        got = sparse_decode(q, ck, cv, c_len, k, v, recent, lens, impl=impl)
        assert rel_err(got, want_sparse) <= 1e-5, impl


def test_api_rejects_bad_input():
    q = jnp.zeros((2, 4, 64))
    k = jnp.zeros((2, 3, 40, 64))
    lens = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="not a multiple"):
        dense_decode(q, k, k, lens)
    with pytest.raises(ValueError, match="impl"):
        dense_decode(q, k[:, :2], k[:, :2], lens, impl="cuda")
    with pytest.raises(ValueError, match="lengths"):
        dense_decode(q, k[:, :2], k[:, :2], lens[:1])
    with pytest.raises(ValueError, match="stacked"):
        dense_decode(q, k[:, :2], k[:, :2], lens, layer=0)
    with pytest.raises(ValueError, match="c_len"):
        sparse_decode(q, k[:, :2], k[:, :2], lens, k[:, :2], k[:, :2], lens, lens)


# ------------------------------------------------------------------ attention heads (GPU)

@pytest.mark.parametrize("qk_norm, hq, hkv, d, dtype",
                         [(True, 8, 2, 32, jnp.bfloat16), (True, 4, 4, 16, jnp.float32),
                          (False, 3, 1, 64, jnp.bfloat16)],
                         ids=["qwen3-bf16", "mha-f32", "llama-odd-heads"])
@pytest.mark.gpu
def test_norm_rope_heads_kernel_matches_jnp(qk_norm, hq, hkv, d, dtype):
    """The one-launch q/k norm + rope + v split (compiled on a GPU) against the model's jnp path
    (attention_inputs with impl="xla") on fresh random weights and far-apart positions."""

    from sfi_jax.models.config import ModelConfig
    from sfi_jax.models.modeling import WeightLayout, attention_inputs

    cfg = ModelConfig(num_layers=1, hidden_size=48, intermediate_size=64, num_q_heads=hq,
                      num_kv_heads=hkv, head_dim=d, vocab_size=16, max_position_embeddings=1 << 18,
                      rope_theta=1e6, qk_norm=qk_norm)
    ks = jax.random.split(jax.random.key(hq * d), 5)
    width = (hq + 2 * hkv) * d
    w = {"attn_norm": 1 + 0.1 * normal(ks[0], (48,), dtype),
         "wqkv": normal(ks[1], (48, width), dtype) * 0.3}
    if qk_norm:
        w["q_norm"] = 1 + 0.3 * normal(ks[2], (d,), dtype)
        w["k_norm"] = 1 + 0.3 * normal(ks[3], (d,), dtype)
    x = normal(ks[4], (5, 1, 48), dtype)
    fused = WeightLayout(split=True, fused_qkv=True)  # (a layer's weights with one "wqkv")
    pos = jnp.array([[0], [1], [777], [65536], [200003]], jnp.int32)
    want = attention_inputs(w, cfg, x, pos, heads="xla", layout=fused)
    got = attention_inputs(w, cfg, x, pos, heads="kernel", layout=fused)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    for name, a, b in zip("qkv", got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) < tol, (name, rel_err(a, b))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))  # v: a plain copy
    # a wrong rotation (no sign flip) or a missing norm would not pass
    bad = attention_inputs(w, dataclasses.replace(cfg, rope_theta=1e4), x, pos, heads="xla",
                           layout=fused)
    assert rel_err(got[0], bad[0]) > 10 * tol
    # only a decode step (one position per row) with fused q/k/v weights takes the kernel
    def uses_kernel(w, x, pos, layout=fused):
        return "sfi_norm_rope_heads" in str(jax.make_jaxpr(
            lambda x: attention_inputs(w, cfg, x, pos, heads="kernel", layout=layout))(x))

    assert uses_kernel(w, x, pos)
    assert not uses_kernel(w, jnp.concatenate([x, x], 1), jnp.concatenate([pos, pos + 1], 1))
    nq, nkv = hq * d, hkv * d
    split = {**w, "wq": w["wqkv"][:, :nq], "wk": w["wqkv"][:, nq:nq + nkv],
             "wv": w["wqkv"][:, nq + nkv:]}
    del split["wqkv"]
    assert not uses_kernel(split, x, pos, WeightLayout(split=True))


@pytest.mark.parametrize("qk_norm, hq, hkv, d, rows",
                         [(True, 4, 2, 64, 5), (False, 3, 1, 128, 1), (True, 2, 1, 64, 9)],
                         ids=["qwen3-5rows", "llama-odd-heads-1row", "qwen3-9rows"])
@pytest.mark.gpu
def test_norm_rope_heads_mosaic_matches_jnp(qk_norm, hq, hkv, d, rows):
    """The heads' Mosaic GPU twin (heads="mosaic_gpu", compiled on a GPU) against the model's
    jnp path on fresh random bf16 weights and far-apart positions, its rows padded to 8 and
    read unpadded (zero_fill); a wrong rotation would not pass; other inputs go to jnp."""
    from sfi_jax.kernels import heads as heads_kernels
    from sfi_jax.models.config import ModelConfig
    from sfi_jax.models.modeling import WeightLayout, attention_inputs
    from sfi_jax.options import KernelTuning

    dtype, hidden = jnp.bfloat16, 64
    cfg = ModelConfig(num_layers=1, hidden_size=hidden, intermediate_size=64, num_q_heads=hq,
                      num_kv_heads=hkv, head_dim=d, vocab_size=16, max_position_embeddings=1 << 18,
                      rope_theta=1e6, qk_norm=qk_norm)
    ks = jax.random.split(jax.random.key(hq * d + rows), 5)
    w = {"attn_norm": 1 + 0.1 * normal(ks[0], (hidden,), dtype),
         "wqkv": normal(ks[1], (hidden, (hq + 2 * hkv) * d), dtype) * 0.3}
    if qk_norm:
        w["q_norm"] = 1 + 0.3 * normal(ks[2], (d,), dtype)
        w["k_norm"] = 1 + 0.3 * normal(ks[3], (d,), dtype)
    x = normal(ks[4], (rows, 1, hidden), dtype)
    fused = WeightLayout(split=True, fused_qkv=True)
    pos = jnp.asarray([[p] for p in (777, 0, 1, 65536, 200003, 5, 9, 31, 4097)[:rows]],
                      jnp.int32)
    want = attention_inputs(w, cfg, x, pos, heads="xla", layout=fused)
    for zero_fill in (False, True):
        got = attention_inputs(w, cfg, x, pos, heads="mosaic_gpu", layout=fused,
                               tuning=KernelTuning(zero_fill=zero_fill))
        for name, a, b in zip("qkv", got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            assert rel_err(a, b) < 1e-2, (name, zero_fill, rel_err(a, b))
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))  # v: a copy
    bad = attention_inputs(w, dataclasses.replace(cfg, rope_theta=1e4), x, pos, heads="xla",
                           layout=fused)
    assert rel_err(got[0], bad[0]) > 0.1
    def launches_kernel(heads):  # (mpmd_map: plgpu.kernel's primitive)
        return "mpmd_map" in str(jax.make_jaxpr(lambda x: attention_inputs(
            w, cfg, x, pos, heads=heads, layout=fused))(x))

    assert launches_kernel("mosaic_gpu") and not launches_kernel("xla")
    # float32 rows: jnp's heads, the same values
    qkv = normal(ks[1], (2, (hq + 2 * hkv) * d), jnp.float32)
    cs = jnp.ones((2, d // 2), jnp.float32)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, eps=1e-6)
    for a, b in zip(heads_kernels.norm_rope_heads(qkv, cs, cs, None, None, impl="mosaic_gpu",
                                                  **kw),
                    heads_kernels.norm_rope_heads(qkv, cs, cs, None, None, impl="xla", **kw)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ MoE grouped matmuls (GPU)

@pytest.mark.parametrize("n, skew, dtype", [(5, False, jnp.float32), (6, False, jnp.bfloat16),
                                            (40, True, jnp.float32)],
                         ids=["decode-f32", "decode-bf16", "one-expert-many-blocks"])
@pytest.mark.gpu
def test_moe_kernels_match_ragged_dot(n, skew, dtype):
    """The grouped expert matmuls (compiled on a GPU) against the lax.ragged_dot path of moe_mlp
    on fresh random weights: experts with no rows, one row, and more rows than one block."""
    from sfi_jax.kernels import moe_gpu
    from sfi_jax.models.config import ModelConfig
    from sfi_jax.models.modeling import moe_mlp

    e, h, inter = 8, 128, 64
    cfg = ModelConfig(num_layers=1, hidden_size=h, intermediate_size=inter, num_q_heads=2,
                      num_kv_heads=1, head_dim=64, vocab_size=16, max_position_embeddings=64,
                      num_experts=e, num_experts_per_tok=2, moe_intermediate_size=inter)
    ks = jax.random.split(jax.random.key(n), 5)
    w = {"router": normal(ks[0], (h, e), dtype),
         "we_gate": normal(ks[1], (e, h, inter), dtype) * 0.1,
         "we_up": normal(ks[2], (e, h, inter), dtype) * 0.1,
         "we_down": normal(ks[3], (e, inter, h), dtype) * 0.1}
    if skew:  # every token routes to expert 3 first: 40 rows there, three blocks of 16
        w["router"] = w["router"].at[:, 3].add(50.0)
    x = normal(ks[4], (n, h), dtype) + (1.0 if skew else 0.0)
    want = moe_mlp(w, cfg, x, impl="xla")
    got = moe_mlp(w, cfg, x, impl="kernel")
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < (2e-2 if dtype == jnp.bfloat16 else 1e-5), rel_err(got, want)
    # the kernels ran (and are not the ragged_dot path)
    jaxpr = str(jax.make_jaxpr(lambda x: moe_mlp(w, cfg, x, impl="kernel"))(x))
    assert "sfi_moe_swiglu" in jaxpr and "ragged_dot" not in jaxpr
    # row blocks: each expert's rows in ceil(count / 16) blocks, then empty ones
    sizes = jnp.array([0, 1, 17, 16, 0, 3], jnp.int32)
    ex, start, rows = (np.asarray(a) for a in moe_gpu.row_blocks(sizes, 37))
    n_used = 0 + 1 + 2 + 1 + 0 + 1
    np.testing.assert_array_equal(ex[:n_used], [1, 2, 2, 3, 5])
    np.testing.assert_array_equal(start, [0, 1, 17, 18, 34] + [37] * 4)
    np.testing.assert_array_equal(rows[:n_used], [1, 16, 1, 16, 3])
    assert len(rows) == 3 + 6 and not rows[n_used:].any()


@pytest.mark.parametrize("block_n, block_k", [(32, 16), (64, 32), (128, 64)])
@pytest.mark.gpu
def test_moe_kernel_tiles_match_ragged_dot(block_n, block_k):
    """Other weight tiles (the diagnostic's sweep; 128 x 64 is the models' default where it
    divides the dims) give the grouped product (a float64 reference); a tile that does not
    divide the dims is an error naming them."""
    from sfi_jax.kernels import moe_gpu

    e, k, n, m = 4, 128 if block_n == 128 else 64, 96 if block_n == 32 else 128, 21
    ks = jax.random.split(jax.random.key(block_n + block_k), 2)
    x = normal(ks[0], (m, k), jnp.float32)
    w = normal(ks[1], (e, k, n), jnp.float32)
    sizes = jnp.array([5, 0, 16, 0], jnp.int32)  # 21 rows: a one-block and a full-block expert
    got = moe_gpu.grouped_matmul(x, w, sizes, interpret=gpu_interpret(), block_n=block_n,
                                 block_k=block_k)
    # float64 on the host: lax.ragged_dot at its default precision takes TF32 for float32 on a
    # GPU (rel err ~3e-4 against the kernel's full-precision dots); float32 products summed
    # over k <= 128 in another order stay near 1e-7
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want = np.concatenate([x64[:5] @ w64[0], x64[5:] @ w64[2]])
    assert rel_err(got[:m], want) < 1e-5
    with pytest.raises(ValueError, match="multiples of 48"):
        moe_gpu.grouped_matmul(x, w, sizes, interpret=True, block_k=48)


def test_moe_tile_is_the_largest_that_divides():
    from sfi_jax.kernels import moe_gpu

    assert moe_gpu.tile(2048, 768) == (128, 64)  # Qwen3-30B-A3B
    assert moe_gpu.tile(128, 64) == (64, 64) and moe_gpu.tile(96, 64) is None


@pytest.mark.parametrize("n, dtype", [(1, jnp.float32), (6, jnp.bfloat16), (16, jnp.float32),
                                      (17, jnp.float32)])
@pytest.mark.gpu
def test_moe_token_tiles_match_ragged_dot(n, dtype):
    """grouping="tokens" (every expert multiplies all of a step's tokens; compiled on a GPU)
    against the ragged_dot path, on fresh random weights with 20 experts (three down-projection
    groups, the last one partial); more than 16 tokens fall back to the sorted kernels."""
    from sfi_jax.models.config import ModelConfig
    from sfi_jax.models.modeling import moe_mlp

    e, h, inter = 20, 128, 128 if n == 6 else 64  # tile 128 x 64 at 128, else 64 x 64
    cfg = ModelConfig(num_layers=1, hidden_size=h, intermediate_size=inter, num_q_heads=2,
                      num_kv_heads=1, head_dim=64, vocab_size=16, max_position_embeddings=64,
                      num_experts=e, num_experts_per_tok=3, moe_intermediate_size=inter)
    ks = jax.random.split(jax.random.key(100 + n), 5)
    w = {"router": normal(ks[0], (h, e), dtype),
         "we_gate": normal(ks[1], (e, h, inter), dtype) * 0.1,
         "we_up": normal(ks[2], (e, h, inter), dtype) * 0.1,
         "we_down": normal(ks[3], (e, inter, h), dtype) * 0.1}
    x = normal(ks[4], (n, h), dtype)
    want = moe_mlp(w, cfg, x, impl="xla")
    got = moe_mlp(w, cfg, x, impl="tokens")
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < (2e-2 if dtype == jnp.bfloat16 else 1e-5), rel_err(got, want)
    jaxpr = str(jax.make_jaxpr(lambda x: moe_mlp(w, cfg, x, impl="tokens"))(x))
    assert ("sfi_moe_token_swiglu" in jaxpr) == (n <= 16) and "ragged_dot" not in jaxpr
    with pytest.raises(ValueError, match="moe impl"):
        moe_mlp(w, cfg, x, impl="pallas_gpu")


# ------------------------------------------------------------------ Mosaic GPU dispatch


@pytest.mark.gpu
def test_mosaic_dense_buffers_through_api():
    """impl="mosaic_gpu" through the public API: logits written into a stacked buffer, the
    output into chosen rows of a buffer, q gathered by rows, each equal to the reference."""
    q, k, v, ks = _stacked_case(9, 4, jnp.bfloat16)
    q_all = normal(ks[3], (4, 8, 64), jnp.bfloat16)  # one query row per cache row
    rows = jnp.asarray([2, 0, 3], jnp.int32)
    lens = jnp.asarray([200, 0, 71], jnp.int32)
    buf = normal(ks[3], (3, 3, 8, 200), jnp.float32)
    base = normal(ks[2], (4, 8, 64), jnp.bfloat16)
    dest = jnp.asarray([3, 1, 9], jnp.int32)  # 9 >= 4: dropped
    out, new, lse = api.dense_decode(q_all, k, v, lens, layer=jnp.int32(1), rows=rows,
                                     gather_q=True, logits_into=buf, out_into=(base, dest),
                                     impl="mosaic_gpu")
    r_out, r_lg, r_lse = reference.dense_decode(q_all[rows], k[1][rows], v[1][rows], lens,
                                                return_logits=True)
    want = np.asarray(base, np.float32).copy()
    want[3], want[1] = np.asarray(r_out[0], np.float32), np.asarray(r_out[1], np.float32)
    assert rel_err(out, want) <= TOL[jnp.bfloat16]
    np.testing.assert_array_equal(np.asarray(out)[[0, 2]], np.asarray(base)[[0, 2]])
    assert_close_logits(lse, r_lse, 1e-5)
    new = np.asarray(new)
    np.testing.assert_array_equal(new[[0, 2]], np.asarray(buf)[[0, 2]])
    for i, n in enumerate(np.asarray(lens)):
        if n:
            assert rel_err(new[1, i, :, :n], r_lg[i, :, :n]) <= 1e-5


def test_mosaic_dispatch():
    """mosaic_gpu takes half-precision caches with head dim 64/128/256, S and Hkv * C
    multiples of 8; float32 (wgmma would round it to TF32), other head dims and lengths take
    the Triton kernel, with its results."""
    q = jnp.zeros((2, 8, 64), jnp.bfloat16)
    assert mgpu.supported(q, jnp.zeros((2, 2, 40, 64), jnp.bfloat16))
    assert not mgpu.supported(q, jnp.zeros((2, 2, 40, 64), jnp.float32))
    assert not mgpu.supported(q[..., :48], jnp.zeros((2, 2, 40, 48), jnp.bfloat16))
    assert not mgpu.supported(q, jnp.zeros((2, 2, 44, 64), jnp.bfloat16))
    kv = jnp.zeros((2, 2, 40, 64), jnp.bfloat16)
    assert mgpu.supported(q, kv, jnp.zeros((2, 2, 12, 64), jnp.bfloat16))  # 2 heads x 12
    assert not mgpu.supported(q, kv, jnp.zeros((2, 2, 13, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="bf16/f16"):
        mgpu.dense_decode(q.astype(jnp.float32), jnp.zeros((2, 2, 40, 64)),
                          jnp.zeros((2, 2, 40, 64)), jnp.zeros((2,), jnp.int32))


MGPU_EXPORT = [(4, 32, 8, 128, 1000, 300, jnp.bfloat16), (3, 10, 2, 64, 136, 36, jnp.bfloat16),
               (2, 16, 2, 256, 512, 64, jnp.float16)]  # (B, Hq, Hkv, D, S, C, dtype)


@pytest.mark.parametrize("b,hq,hkv,d,s,c,dtype", MGPU_EXPORT)
def test_mosaic_kernels_lower_for_cuda(b, hq, hkv, d, s, c, dtype):
    """The Mosaic GPU kernels go through Mosaic GPU's own lowering for a CUDA target on any
    machine (layouts, TMA shapes, shared memory size), which interpret mode does not."""
    from sfi_jax.kernels import multi_query_decode_mgpu as mq_mgpu

    sds = jax.ShapeDtypeStruct
    q, vec = sds((b, hq, d), dtype), sds((b,), jnp.int32)
    kv, ckv = sds((2, b, hkv, s, d), dtype), sds((2, b, hkv, c, d), dtype)
    fns = {
        "dense": (lambda q, k, v, n: mgpu.dense_decode(q, k, v, n, jnp.int32(1)), (q, kv, kv, vec)),
        "dense_logits": (lambda q, k, v, n, r: mgpu.dense_decode(
            q, k, v, n, jnp.int32(0), r, return_logits=True), (q, kv, kv, vec, vec)),
        "dense_logits_2_buffers": (lambda q, k, v, n: mgpu.dense_decode(
            q, k, v, n, jnp.int32(0), return_logits=True, config=mgpu.fit(
                dataclasses.replace(mgpu.DENSE_LOGITS, score_buffers=2), q.shape[-1], True)),
            (q, kv, kv, vec)),
        "sparse": (lambda q, ck, cv, cl, k, v, rs, n: mgpu.sparse_decode(
            q, ck, cv, cl, k, v, rs, n, jnp.int32(1), window=64),
            (q, ckv, ckv, sds((2, b, hkv), jnp.int32), kv, kv, vec, vec)),
        # the query groups read unpadded (KernelTuning.zero_fill)
        "dense_logits_zero_fill": (lambda q, k, v, n: mgpu.dense_decode(
            q, k, v, n, jnp.int32(0), return_logits=True, zero_fill=True), (q, kv, kv, vec)),
        "sparse_zero_fill": (lambda q, ck, cv, cl, k, v, rs, n: mgpu.sparse_decode(
            q, ck, cv, cl, k, v, rs, n, jnp.int32(1), window=64, zero_fill=True),
            (q, ckv, ckv, sds((2, b, hkv), jnp.int32), kv, kv, vec, vec)),
        # P·V's operand from registers (Config.p_regs), with and without logits
        "sparse_p_regs": (lambda q, ck, cv, cl, k, v, rs, n: mgpu.sparse_decode(
            q, ck, cv, cl, k, v, rs, n, jnp.int32(1), window=64, config=mgpu.fit(
                dataclasses.replace(mgpu.SPARSE, p_regs=True), q.shape[-1])),
            (q, ckv, ckv, sds((2, b, hkv), jnp.int32), kv, kv, vec, vec)),
        "dense_one_split": (lambda q, k, v, n: mgpu.dense_decode(
            q, k, v, n, jnp.int32(1),
            config=mgpu.fit(dataclasses.replace(mgpu.DENSE, programs=1), q.shape[-1])),
            (q, kv, kv, vec)),
        "sparse_one_split": (lambda q, ck, cv, cl, k, v, rs, n: mgpu.sparse_decode(
            q, ck, cv, cl, k, v, rs, n, jnp.int32(1), window=64,
            config=mgpu.fit(dataclasses.replace(mgpu.SPARSE, programs=1), q.shape[-1])),
            (q, ckv, ckv, sds((2, b, hkv), jnp.int32), kv, kv, vec, vec)),
        "dense_logits_p_regs": (lambda q, k, v, n: mgpu.dense_decode(
            q, k, v, n, jnp.int32(0), return_logits=True, config=mgpu.fit(
                dataclasses.replace(mgpu.DENSE_LOGITS, p_regs=True), q.shape[-1], True)),
            (q, kv, kv, vec)),
        "repack": (lambda ck, cv, k, v, p, s: mgpu.repack(ck, cv, k, v, p, s),
                   (ckv, ckv, kv, kv, sds((2, b, hkv, c), jnp.int32), vec)),
        "verify_logits": (lambda q, k, v, a, n: mq_mgpu.multi_query_decode(
            q, k, v, a, n, jnp.int32(1), return_logits=True),
            (sds((b, 64 * hkv // hq, hq, d), dtype), kv, kv, vec, vec)),
    }
    if mgpu.KERNEL_REFS:  # the new token stored by the kernel into `jax.new_ref` caches
        fns["sparse_new_token"] = (
            lambda q, ck, cv, cl, k, v, rs, n, kn, vn: mgpu.sparse_decode(
                q, ck, cv, cl, k, v, rs, n, jnp.int32(1), window=64, new_kv=(kn, vn)),
            (q, ckv, ckv, sds((2, b, hkv), jnp.int32), kv, kv, vec, vec,
             sds((b, hkv, d), dtype), sds((b, hkv, d), dtype)))
    checks = [jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")]
    for name, (f, args) in fns.items():
        exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(*args)
        assert "mosaic_gpu" in exp.mlir_module(), name
