"""The compiled decode loop updates the KV cache, the compact buffers and the logits scratch in
place: no `copy` of those buffers in the HLO (a copy per step costs more than the step saves;
see docs/DESIGN.md for the layouts that made XLA copy them)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from sfi_jax import EngineOptions, SFIConfig
from sfi_jax.models.config import PRESETS
from sfi_jax.models.modeling import split_layers
from sfi_jax.models.params import random_params
from sfi_jax.runtime import decode
from sfi_jax.runtime.sampling import SamplingConfig
from sfi_jax.runtime.state import DecodeState, empty_sfi_state

CFG = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=3, hidden_size=64,
                          intermediate_size=128, num_q_heads=4, num_kv_heads=2, head_dim=16,
                          vocab_size=300)
B, S, N = 4, 384, 4


def _big_copies(sfi, split: bool, options: EngineOptions = EngineOptions()):
    params = random_params(CFG, "float32", 0)
    if split:
        params["layers"] = split_layers(params["layers"], fuse_qkv=True)
    shape = (CFG.num_layers, B, CFG.num_kv_heads, S, CFG.head_dim)
    st = None
    if sfi is not None:
        st = empty_sfi_state(CFG, sfi, B, S, jnp.bfloat16)
    # a bf16 cache as on accelerators (on CPU, bf16 updates inside conditions copied buffers
    # where f32 ones did not)
    state = DecodeState(k=jnp.zeros(shape, jnp.bfloat16), v=jnp.zeros(shape, jnp.bfloat16),
                        lengths=jnp.full((B,), 300, jnp.int32), token=jnp.zeros((B,), jnp.int32),
                        done=jnp.zeros((B,), bool), step=jnp.int32(0),
                        key=jnp.zeros((2,), jnp.uint32), sfi=st)
    mask = jnp.zeros((CFG.vocab_size,), bool)
    forced = jnp.zeros((B, N), jnp.int32)
    text = decode.decode_chunk.lower(params, state, mask, mask, forced, cfg=CFG, sfi=sfi,
                                     sampling=SamplingConfig(), n_steps=N,
                                     options=options.resolved()).compile().as_text()
    dims = [("bf16", shape)]
    if sfi is not None:
        dims.append(("bf16", (CFG.num_layers, B, CFG.num_kv_heads, sfi.compact_size,
                              CFG.head_dim)))
        buf = decode.slow_logits_buffer(CFG, sfi, B, S)
        if buf is not None:
            dims.append(("f32", buf.shape))
    wanted = [f"{t}[" + ",".join(map(str, d)) + "]" for t, d in dims]
    return [line.strip()[:120] for line in text.splitlines()
            if re.search(r"= \S+ copy(-start)?\(", line) and any(w in line for w in wanted)]


@pytest.mark.parametrize("split", [False, True], ids=["stacked", "split"])
@pytest.mark.parametrize("sfi", [None, SFIConfig(n_sink=2, k_select=32, n_recent=16, t_max=4,
                                                refresh_rows=2)], ids=["dense", "sfi"])
def test_decode_loop_has_no_big_copies(sfi, split):
    assert _big_copies(sfi, split) == []


@pytest.mark.parametrize("repack", ["xla", "kernel"])
def test_gpu_kernels_update_in_place(repack):
    """The GPU kernels (interpret mode here) in the loop: the unconditional refresh writes the
    logits into the scratch buffer, the sparse kernel the cache, and the repack kernel the
    compact buffers, through aliased outputs, without copying them."""
    sfi = SFIConfig(n_sink=2, k_select=32, n_recent=16, t_max=4, refresh_rows=2)
    options = EngineOptions(attention="pallas_gpu", repack=repack)
    assert _big_copies(sfi, True, options) == []
