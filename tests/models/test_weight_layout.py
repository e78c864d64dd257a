"""`WeightLayout`: how the layer weights are stored, decided at load (`Model.layout`) and read
by the layer functions instead of the weights' names."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfi_jax.models.config import PRESETS
from sfi_jax.models.modeling import (STACKED, Model, WeightLayout, attention_inputs,
                                     attention_output_and_mlp, forward, unfuse_qkv_weights)
from sfi_jax.models.params import random_params

CFG = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=2, hidden_size=32,
                          intermediate_size=48, num_q_heads=4, num_kv_heads=2, head_dim=8,
                          vocab_size=64)


def _model(split=None):
    """The test model, stacked (split None) or split with `split`'s layout flags."""
    model = Model(CFG, random_params(CFG, "float32", 4))
    return model if split is None else model.split_layers(**split)


@pytest.mark.parametrize("split, want", [
    (None, STACKED),
    (dict(), WeightLayout(split=True)),
    (dict(fuse_qkv=True), WeightLayout(split=True, fused_qkv=True)),
    (dict(fuse_qkv=True, k_major=True), WeightLayout(split=True, fused_qkv=True, k_major=True)),
    (dict(k_major=True), WeightLayout(split=True, k_major=True)),
])
def test_layout_is_stated_and_matches_the_weights(split, want):
    model = _model(split)
    assert model.layout == want and model.layers_split == want.split
    assert WeightLayout.of(model.params["layers"]) == want
    layers = model.params["layers"]
    names = set(layers[0] if want.split else layers)
    assert names == want.names(random_params(CFG, "float32", 4)["layers"])


def test_layouts_compute_the_same_layer(xla_fast_compile):
    """attention_inputs and attention_output_and_mlp give the stacked layout's values in every
    layout (the fused q/k/v split back, the K-major weights read transposed)."""
    stacked = _model().params["layers"]
    w0 = {n: a[0] for n, a in stacked.items()}
    ks = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(ks[0], (2, 3, CFG.hidden_size))
    attn = jax.random.normal(ks[1], (2, 3, CFG.num_q_heads, CFG.head_dim))
    pos = jnp.broadcast_to(jnp.arange(3), (2, 3))
    want_q = attention_inputs(w0, CFG, x, pos)
    want_x = attention_output_and_mlp(w0, CFG, x, attn)
    for split in (dict(), dict(fuse_qkv=True), dict(fuse_qkv=True, k_major=True)):
        model = _model(split)
        w, layout = model.params["layers"][0], model.layout
        got_q = attention_inputs(w, CFG, x, pos, layout=layout)
        for a, b in zip(got_q, want_q):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        got_x = attention_output_and_mlp(w, CFG, x, attn, layout=layout)
        np.testing.assert_allclose(np.asarray(got_x), np.asarray(want_x), rtol=1e-5, atol=1e-5)
        plain = unfuse_qkv_weights(w, CFG, layout)
        assert set(plain) == set(w0)
        for n in w0:
            np.testing.assert_array_equal(np.asarray(plain[n]), np.asarray(w0[n]))
    tokens = jnp.array([[1, 5, 9, 2]])
    np.testing.assert_allclose(np.asarray(forward(_model(dict(fuse_qkv=True, k_major=True)), tokens)),
                               np.asarray(forward(_model(), tokens)), rtol=1e-5, atol=1e-5)


def test_a_mixed_or_unsplit_layout_is_refused():
    layer = dict(_model(dict(fuse_qkv=True)).params["layers"][0])
    layer["wq"] = layer["wqkv"][:, :32]  # both the fused and a separate q
    with pytest.raises(ValueError, match="no known layout"):
        WeightLayout.of([layer])
    layer = dict(_model(dict(k_major=True)).params["layers"][0])
    layer["w_up"] = layer.pop("w_up_t").T  # one of the K-major weights not transposed
    with pytest.raises(ValueError, match="no known layout"):
        WeightLayout.of([layer])
    with pytest.raises(ValueError, match="layouts of split layers"):
        WeightLayout(fused_qkv=True)


def test_a_stated_layout_is_checked_against_the_weights():
    params = random_params(CFG, "float32", 4)
    with pytest.raises(ValueError, match="not in the stated"):
        Model(CFG, params, layout=WeightLayout(split=True))
    assert Model(CFG, params, layout=STACKED).layout == STACKED
