"""The Mosaic GPU decode attention inside generate, in Mosaic GPU's interpret mode on a CPU
(slow: ~6 min on 2 cores). A CPU keeps float32 KV caches (`runtime.state.cache_dtype`), which
the Mosaic read does not take (its engine runs would read with the Triton kernels), so the
caches are made bfloat16 here, as on a GPU, where test_gpu_engine.py runs the same check
compiled."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from conftest import on_gpu
from sfi_jax.runtime import generation, state
from test_gpu_engine import check_mosaic_attention_in_generate

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(on_gpu(), reason="test_gpu_engine.py runs it compiled")]


def test_mosaic_attention_in_generate_interpreted(tmp_path, monkeypatch):
    for module in (state, generation):
        monkeypatch.setattr(module, "cache_dtype", lambda dtype: jnp.dtype(dtype))
    check_mosaic_attention_in_generate(tmp_path)
