"""The engine with the GPU kernels compiled (not interpret mode): `sfi_jax.generate` on small
random-weight models in sfi, dense and exact mode with the platform's defaults (the Triton
decode, verify, selector, heads, repack, matmul and MoE kernels), against the same call with
every operation by XLA. Needs a GPU: on a CPU the kernels' own tests cover them in interpret
mode, and these skip."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import sfi_jax
from conftest import TINY_EOS, assert_same_greedy, make_hf_checkpoint, on_gpu, rel_err
from sfi_jax.options import EngineOptions

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not on_gpu(), reason="runs the compiled GPU kernels")]

XLA = EngineOptions(attention="xla", prefill_attention="xla", selector_scores="xla",
                    selector_topk="lax", selector_adjust="xla", moe="xla", heads="xla",
                    repack="xla", refresh="cond", matmul="xla", epilogue="xla")
SFI = sfi_jax.SFIConfig(n_sink=2, k_select=8, n_recent=8, t_max=6, draft_len=3)
NEW = 24
# (model kind, overrides): a Qwen3 layout (group 4, head dim 64); a group of 3 on 3 KV heads
# (SmolLM2-135M's layout: padded rows and heads in every kernel); a Qwen3-MoE (the expert
# kernels). Small enough to compile in seconds, large enough for the kernels' tiles.
MODELS = {
    "qwen3-g4": ("qwen3", dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=64)),
    "qwen3-g3": ("qwen3", dict(hidden_size=192, intermediate_size=384, num_attention_heads=9,
                               num_key_value_heads=3, head_dim=64)),
    "qwen3-moe": ("qwen3_moe", dict(hidden_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=64, moe_intermediate_size=64,
                                    num_experts=8, num_experts_per_tok=2)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, (kind, kw) in MODELS.items():
        _, d = make_hf_checkpoint(tmp_path_factory.mktemp(name), kind, seed=5,
                                  eos_token_id=TINY_EOS, **kw)
        out[name] = sfi_jax.load_model(d, dtype="float32")
    return out


def _prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY_EOS, n).tolist() for n in lengths]


def _both(model, prompts, options=None, ref_mode=None, **kw):
    """generate() with the GPU defaults (plus `options`), and with every operation by XLA in
    `ref_mode` (default: the same mode, returning logits), both with float32 matmuls at full
    precision (XLA's GPU default, TF32, would differ by ~1e-3)."""
    kw = dict(max_new_tokens=NEW, stop_at_eos=False, **kw)
    mode = kw.pop("mode")
    with jax.default_matmul_precision("highest"):
        gpu = sfi_jax.generate(model, prompts, options=options or EngineOptions(), mode=mode,
                               return_logits=mode != "exact", **kw)
        ref = sfi_jax.generate(model, prompts, options=XLA, mode=ref_mode or mode,
                               return_logits=True, **kw)
    return gpu, ref


def _assert_same(gpu, ref, what, tol=1e-4):
    """Greedy tokens equal (a divergence only at a near-tie of the reference's logits), and the
    logits (where returned) up to the first divergence within tol."""
    for b, (got, want) in enumerate(zip(gpu.tokens, ref.tokens)):
        assert_same_greedy(got, want, ref.stats["logits"][b], what=f"{what} row {b}")
        n = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), len(want))
        if n and "logits" in gpu.stats:
            err = rel_err(gpu.stats["logits"][b][:n], ref.stats["logits"][b][:n])
            assert err < tol, f"{what} row {b}: logits rel err {err:.2e}"


def test_gpu_defaults_use_the_kernels():
    """What the comparisons below exercise: the platform's defaults are the Triton kernels."""
    o = EngineOptions().resolved("gpu")
    assert (o.attention, o.selector_scores, o.selector_topk, o.heads, o.repack, o.moe) == (
        "pallas_gpu", "pallas_gpu", "radix_kernel", "kernel", "kernel", "tokens")
    assert EngineOptions().resolved() == o  # this machine is a GPU


@pytest.mark.parametrize("mode", ["dense", "sfi", "exact"])
@pytest.mark.parametrize("name", ["qwen3-g4", "qwen3-g3"])
def test_generate_with_gpu_kernels_matches_xla(models, name, mode):
    """A ragged batch (prompts shorter and far longer than the SFI budget) through the
    compiled kernels gives the XLA engine's tokens and logits; exact mode (drafts by the
    sparse kernel, verified by the multi-query kernel) gives XLA dense decoding's tokens."""
    prompts = _prompts([13, 70, 150], seed=len(name) + len(mode))
    gpu, ref = _both(models[name], prompts, mode=mode, sfi=SFI,
                     ref_mode="dense" if mode == "exact" else None)
    _assert_same(gpu, ref, f"{name} {mode}")
    if mode != "dense":  # fast steps ran (the sparse kernel)
        assert min(gpu.stats["fast_steps"]) > 0, gpu.stats["fast_steps"]


@pytest.mark.parametrize("radius", [3, 16])
def test_selector_adjust_kernel_any_radius(models, radius):
    """The selector's steps 5-6 by the kernel (selector_adjust="kernel") with a soft-NMS
    radius that is not a power of two (3) and the default (16), on 3 KV heads."""
    cfg = sfi_jax.SFIConfig(n_sink=2, k_select=8, n_recent=8, t_max=6, nms_radius=radius)
    prompts = _prompts([60, 150], seed=radius)
    gpu, ref = _both(models["qwen3-g3"], prompts, EngineOptions(selector_adjust="kernel"),
                     mode="sfi", sfi=cfg)
    _assert_same(gpu, ref, f"adjust kernel radius {radius}")


def test_moe_kernels_in_generate(models):
    """Qwen3-MoE through the expert kernels (grouping by tokens, the default, and the
    grouped matmuls) against lax.ragged_dot."""
    prompts = _prompts([9, 40], seed=3)
    for moe in ("tokens", "kernel"):
        gpu, ref = _both(models["qwen3-moe"], prompts, EngineOptions(moe=moe), mode="dense")
        _assert_same(gpu, ref, f"moe {moe}")
