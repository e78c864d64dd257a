"""A jax without Pallas' Triton lowering (deprecated in jax 0.11, to be removed later): "auto"
takes no Triton kernel, a Mosaic GPU kernel's unsupported inputs go to XLA instead of its
Triton twin, generation on the GPU choices gives the XLA path's tokens, and asking for a
Triton kernel explicitly is a clear error. The lowering's absence is simulated in a fresh
process (its import fails, as after its removal)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from sfi_jax.kernels import common
from sfi_jax.options import EngineOptions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRITON_CHOICES = {"attention": "pallas_gpu", "selector_scores": "pallas_gpu",
                  "selector_topk": "radix_kernel", "moe": "tokens", "heads": "kernel",
                  "repack": "kernel", "matmul": "by_shape", "epilogue": "fused"}


@pytest.mark.parametrize("hopper", [True, False])
def test_auto_takes_no_triton_kernel(hopper, monkeypatch):
    monkeypatch.setattr(common, "triton_available", lambda: False)
    monkeypatch.setattr(common, "hopper", lambda: hopper)
    gpu = EngineOptions().resolved(platform="gpu")
    for name, triton in TRITON_CHOICES.items():
        assert getattr(gpu, name) != triton, (name, gpu)
    mosaic = "mosaic_gpu" if hopper else "xla"
    assert (gpu.attention, gpu.moe, gpu.prefill_attention) == \
        (mosaic, mosaic, "mosaic_gpu" if hopper else "cudnn")
    assert gpu.selector_topk == ("radix_mosaic_gpu" if hopper else "radix")  # won there
    assert gpu.heads == gpu.repack == "xla"
    assert gpu.matmul == ("mosaic_by_shape" if hopper else "xla")  # the twin won there
    # explicit choices stay as asked; CPU and TPU do not change
    assert EngineOptions(heads="kernel").resolved(platform="gpu").heads == "kernel"
    assert EngineOptions().resolved(platform="cpu") == EngineOptions().resolved(platform="cpu")
    monkeypatch.setattr(common, "triton_available", lambda: True)
    with_triton = EngineOptions().resolved(platform="gpu")
    # (the top-k's Mosaic twin is as fast as its Triton kernel: a Hopper takes it either way)
    want = dict(TRITON_CHOICES, selector_topk="radix_mosaic_gpu" if hopper else "radix_kernel")
    assert all(getattr(with_triton, n) == t for n, t in want.items()), with_triton


def test_fallbacks_follow_the_triton_lowering(monkeypatch):
    monkeypatch.setattr(common, "triton_available", lambda: True)
    assert common.gpu_fallback() == "pallas_gpu"
    monkeypatch.setattr(common, "triton_available", lambda: False)
    assert common.gpu_fallback() == "xla"
    monkeypatch.setattr(common, "platform", lambda: "gpu")
    for hopper, want in ((True, "mosaic_gpu"), (False, "xla")):
        monkeypatch.setattr(common, "hopper", lambda h=hopper: h)
        assert common.platform_kernel() == want


NO_TRITON = textwrap.dedent("""
    import sys
    sys.modules["jax.experimental.pallas.triton"] = None  # its import fails, as once removed

    import jax.numpy as jnp
    import numpy as np

    import sfi_jax
    from sfi_jax.kernels import common
    from sfi_jax.models.config import ModelConfig
    from sfi_jax.models.modeling import Model
    from sfi_jax.models.params import random_params

    assert not common.triton_available()
    common.hopper = lambda: True  # as on an H100 / H200
    gpu = sfi_jax.EngineOptions().resolved(platform="gpu")
    cfg = ModelConfig(name="tiny-moe", num_layers=2, hidden_size=64, intermediate_size=128,
                      num_q_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256,
                      max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=64)
    model = Model(cfg, random_params(cfg, "float32", seed=3))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (30, 41)]
    kw = dict(max_new_tokens=10, stop_at_eos=False, trigger_ids=[7],
              sfi=sfi_jax.SFIConfig.paper(n_sink=2, k_select=8, n_recent=8, t_max=4))
    for mode in ("sfi", "dense", "exact"):
        want = sfi_jax.generate(model, prompts, mode=mode, **kw).tokens
        got = sfi_jax.generate(model, prompts, mode=mode, options=gpu, **kw).tokens
        assert got == want, (mode, got, want)
    triton = sorted(m for m in sys.modules if m.startswith("sfi_jax.kernels.")
                    and m.endswith("_gpu") or m == "sfi_jax.kernels.triton_lowering")
    assert not triton, triton
    try:
        sfi_jax.generate(model, prompts, options=sfi_jax.EngineOptions(attention="pallas_gpu"),
                        **kw)
    except ImportError as e:
        assert "no Pallas Triton lowering" in str(e) and "'mosaic_gpu' or 'xla'" in str(e), e
    else:
        raise AssertionError("an explicit Triton kernel ran without the Triton lowering")
    print("OK", gpu)
""")


def test_generation_without_the_triton_lowering():
    """On the GPU choices (Mosaic GPU kernels in interpret mode here, where the CPU's float32
    caches send them to XLA) every mode gives the XLA path's tokens, with no Triton module
    imported; an explicit Triton kernel raises an ImportError that names the way out."""
    # XLA's slower optimisations off in the child (compiling the tiny model's programs is most
    # of its time): both sides of each comparison compile the same way
    env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
