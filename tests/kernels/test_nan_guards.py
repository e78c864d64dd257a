"""Attention's "no valid key -> 0" guard must not swallow NaN: a row fed NaN gives NaN (so the
runtime's finite checks see it), a row with no valid key gives 0, the other rows their values."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_compile
from sfi_jax.kernels import dense_decode, sparse_decode
from sfi_jax.kernels.multi_query_decode import multi_query_decode
from sfi_jax.kernels.prefill_attention import prefill_attention

B, HQ, HKV, S, D = 3, 4, 2, 64, 16
DECODE = ["xla", "pallas_gpu", "pallas_tpu"]


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, HQ, D)).astype(np.float32)
    k = rng.normal(size=(B, HKV, S, D)).astype(np.float32)
    v = rng.normal(size=(B, HKV, S, D)).astype(np.float32)
    q[0, 1] = np.nan  # row 0: one query head fed NaN
    return q, k, v, np.array([40, 0, 23], np.int32)  # row 1: no valid key


def _check(out, clean_row):
    out = np.asarray(out, np.float32)
    assert np.isnan(out[0, 1]).all(), "NaN input swallowed"
    np.testing.assert_array_equal(out[1], 0.0)
    assert np.isfinite(out[2]).all() and np.abs(out[2] - clean_row).max() < 1e-4


@pytest.mark.parametrize("impl", DECODE)
def test_dense_decode_keeps_nan(impl):
    q, k, v, lengths = _inputs()
    with fast_compile():
        ref = np.asarray(dense_decode(q, k, v, lengths, impl="xla"))
        out, logits, lse = dense_decode(q, k, v, lengths, impl=impl, return_logits=True)
    _check(out, ref[2])
    assert np.isnan(np.asarray(lse)[0, 1]) and np.asarray(lse)[1].max() == -np.inf


@pytest.mark.parametrize("impl", DECODE)
def test_sparse_decode_keeps_nan(impl):
    q, k, v, lengths = _inputs(1)
    C = 8
    ck, cv = k[:, :, :C].copy(), v[:, :, :C].copy()
    c_len = np.array([[5, 8], [0, 0], [3, 2]], np.int32)
    recent_start = np.array([30, 0, 10], np.int32)
    with fast_compile():
        ref = np.asarray(sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths, impl="xla"))
        out = sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths, impl=impl)
    _check(out, ref[2])


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu", "pallas_tpu"])
def test_multi_query_and_prefill_keep_nan(impl):
    rng = np.random.default_rng(2)
    T = 4
    q = rng.normal(size=(B, T, HQ, D)).astype(np.float32)
    k = rng.normal(size=(B, HKV, S, D)).astype(np.float32)
    v = rng.normal(size=(B, HKV, S, D)).astype(np.float32)
    q[0, 2, 1] = np.nan
    q_start = np.array([10, 0, 20], np.int32)
    kv_len = np.array([14, 0, 24], np.int32)
    with fast_compile():
        mq = np.asarray(multi_query_decode(q, k, v, q_start, kv_len, impl=impl), np.float32)
        pf_impl = impl if impl != "xla" else "xla"
        pf = np.asarray(prefill_attention(q, k, v, q_start, kv_len, impl=pf_impl), np.float32)
    for out in (mq, pf):
        assert np.isnan(out[0, 2, 1]).all()
        assert np.isfinite(out[0, :2]).all() and np.isfinite(out[2]).all()
    np.testing.assert_array_equal(mq[1], 0.0)


@pytest.mark.gpu
def test_mosaic_dense_decode_keeps_nan():
    """The Mosaic GPU kernel (half precision, head dim 64): NaN in -> NaN out, no valid key
    -> 0 and lse -inf, the other rows their values."""
    rng = np.random.default_rng(3)
    q = rng.normal(size=(B, HQ, 64)).astype(np.float32)
    k = rng.normal(size=(B, HKV, S, 64)).astype(np.float32)
    v = rng.normal(size=(B, HKV, S, 64)).astype(np.float32)
    q[0, 1] = np.nan
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    lengths = np.array([40, 0, 23], np.int32)
    with fast_compile():
        ref = np.asarray(dense_decode(q, k, v, lengths, impl="xla"), np.float32)
        out, logits, lse = dense_decode(q, k, v, lengths, impl="mosaic_gpu", return_logits=True)
    out = np.asarray(out, np.float32)
    assert np.isnan(out[0, 1]).all(), "NaN input swallowed"
    np.testing.assert_array_equal(out[1], 0.0)
    assert np.isfinite(out[2]).all() and np.abs(out[2] - ref[2]).max() < 2e-2
    assert np.isnan(np.asarray(lse)[0, 1]) and np.asarray(lse)[1].max() == -np.inf
