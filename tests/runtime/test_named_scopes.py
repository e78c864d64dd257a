"""The decode loop's named scopes reach the lowered program, so a profile's kernels map to the
code: embed, qkv, attend (dense / sparse / refresh), mlp, logits, sample, select."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sfi_jax import EngineOptions, SFIConfig
from sfi_jax.models.config import PRESETS
from sfi_jax.models.params import random_params
from sfi_jax.runtime import decode
from sfi_jax.runtime.sampling import SamplingConfig
from sfi_jax.runtime.state import DecodeState, empty_sfi_state

CFG = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=2, hidden_size=32,
                          intermediate_size=48, num_q_heads=4, num_kv_heads=2, head_dim=8,
                          vocab_size=64)
B, S = 2, 256


def _lowered_text(sfi):
    params = random_params(CFG, "float32", 0)
    shape = (CFG.num_layers, B, CFG.num_kv_heads, S, CFG.head_dim)
    state = DecodeState(k=jnp.zeros(shape), v=jnp.zeros(shape),
                        lengths=jnp.full((B,), 200, jnp.int32), token=jnp.zeros((B,), jnp.int32),
                        done=jnp.zeros((B,), bool), step=jnp.int32(0),
                        key=jnp.zeros((2,), jnp.uint32),
                        sfi=None if sfi is None else empty_sfi_state(CFG, sfi, B, S,
                                                                     jnp.float32))
    mask = jnp.zeros((CFG.vocab_size,), bool)
    lowered = decode.decode_chunk.lower(params, state, mask, mask, jnp.zeros((B, 2), jnp.int32),
                                        cfg=CFG, sfi=sfi, sampling=SamplingConfig(), n_steps=2,
                                        options=EngineOptions().resolved())
    return lowered.as_text(debug_info=True)


def test_scopes_in_the_lowered_decode_loop():
    sfi = SFIConfig(n_sink=4, k_select=32, n_recent=16)
    text = _lowered_text(sfi)
    for scope in ("embed/", "qkv/", "attend/sparse/", "attend/refresh/", "mlp/", "logits/",
                  "sample/", "select/"):
        assert scope in text, scope
    dense = _lowered_text(None)
    assert "attend/dense/" in dense and "attend/sparse/" not in dense
