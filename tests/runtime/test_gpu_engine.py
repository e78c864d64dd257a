"""The engine with the GPU kernels compiled (not interpret mode): `sfi_jax.generate` on small
random-weight models in sfi, dense and exact mode with the platform's defaults (the Triton
decode, verify, selector, heads, repack, matmul and MoE kernels), against the same call with
every operation by XLA. Needs a GPU: on a CPU the kernels' own tests cover them in interpret
mode, and these skip."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfi_jax
from sfi_jax.kernels import attention_mgpu as mgpu, common
from conftest import (TINY_EOS, assert_same_greedy, fast_compile, make_hf_checkpoint, on_gpu,
                      rel_err)
from sfi_jax.options import EngineOptions, KernelTuning
from sfi_jax.runtime import state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not on_gpu(), reason="runs the compiled GPU kernels")]

XLA = EngineOptions(attention="xla", prefill_attention="xla", selector_scores="xla",
                    selector_topk="lax", selector_adjust="xla", moe="xla", heads="xla",
                    repack="xla", refresh="cond", matmul="xla", epilogue="xla")
# the budget far below the prompts; soft-NMS radius 3 (not a power of two) with the selector's
# steps 5-6 by the kernel on the GPU side
SFI = sfi_jax.SFIConfig(n_sink=2, k_select=8, n_recent=8, t_max=6, draft_len=3, nms_radius=3)
# exact mode drafts every round (adaptive drafts stop drafting on a random model, whose drafts
# are rejected, and the sparse kernel would then not run)
SFI_EXACT = dataclasses.replace(SFI, adaptive_draft=False)
GPU = EngineOptions(selector_adjust="kernel")
NEW = 24
# (model kind, overrides): a group of 3 on 3 KV heads (SmolLM2-135M's layout: padded rows and
# heads in every kernel), and a Qwen3-MoE (the expert kernels). Small enough to compile in
# seconds, large enough for the kernels' tiles.
MODELS = {
    "qwen3-g3": ("qwen3", dict(hidden_size=192, intermediate_size=384, num_attention_heads=9,
                               num_key_value_heads=3, head_dim=64)),
    "qwen3-moe": ("qwen3_moe", dict(hidden_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=64, moe_intermediate_size=64,
                                    num_experts=8, num_experts_per_tok=2)),
}
PROMPTS = [13, 70, 150]  # shorter and far longer than the SFI budget


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(model name, mode, options) -> generate's result, each call made once per module
    (the XLA dense run is the reference of three tests), with float32 matmuls at full
    precision (XLA's GPU default, TF32, would differ by ~1e-3)."""
    models, results = {}, {}
    prompts = [np.random.default_rng(n).integers(0, TINY_EOS, n).tolist() for n in PROMPTS]

    def call(name, mode, options):
        key = (name, mode, options)
        if key not in results:
            if name not in models:
                kind, kw = MODELS[name]
                _, d = make_hf_checkpoint(tmp_path_factory.mktemp(name), kind, seed=5,
                                          eos_token_id=TINY_EOS, **kw)
                models[name] = sfi_jax.load_model(d, dtype="float32")
            with jax.default_matmul_precision("highest"), fast_compile():
                results[key] = sfi_jax.generate(
                    models[name], prompts, mode=mode, sfi=SFI_EXACT if mode == "exact" else SFI,
                    options=options,
                    max_new_tokens=NEW, stop_at_eos=False, return_logits=mode != "exact")
        return results[key]

    return call


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
    o = GPU.resolved()
    assert (o.attention, o.selector_scores, o.selector_adjust, o.heads, o.repack, o.moe) == \
        ("pallas_gpu", "pallas_gpu", "kernel", "kernel", "kernel", "tokens")
    # the top-k's Mosaic GPU twin on a Hopper, its Triton kernel elsewhere
    assert o.selector_topk == ("radix_mosaic_gpu" if common.hopper() else "radix_kernel")


@pytest.mark.parametrize("mode", ["dense", "sfi", "exact"])
def test_generate_with_gpu_kernels_matches_xla(run, mode):
    """A ragged batch through the compiled kernels gives the XLA engine's tokens and logits;
    exact mode (drafts by the sparse kernel, verified by the multi-query kernel) gives XLA
    dense decoding's tokens."""
    gpu = run("qwen3-g3", mode, GPU)
    ref = run("qwen3-g3", "dense" if mode == "exact" else mode, XLA)
    _assert_same(gpu, ref, f"qwen3-g3 {mode}")
    if mode != "dense":  # fast steps ran (the sparse kernel)
        assert min(gpu.stats["fast_steps"]) > 0, gpu.stats["fast_steps"]


def test_moe_kernels_in_generate(run):
    """Qwen3-MoE through the expert kernels (the default grouping by tokens) against
    lax.ragged_dot."""
    _assert_same(run("qwen3-moe", "dense", GPU), run("qwen3-moe", "dense", XLA), "moe")


@pytest.mark.parametrize("mode", ["dense", "sfi"])
def test_engine_prefills_into_a_slot_row_with_gpu_kernels(tmp_path, mode):
    """The Engine with the compiled kernels: a prompt of several chunks prefilled by the Triton
    prefill kernel into its slot's row of the shared cache (row= a traced offset) while another
    request decodes beside it; both give the XLA engine's greedy tokens for each prompt alone."""
    kind, kw = MODELS["qwen3-g3"]
    _, d = make_hf_checkpoint(tmp_path, kind, seed=5, eos_token_id=TINY_EOS, **kw)
    model = sfi_jax.load_model(d, dtype="float32")
    rng = np.random.default_rng(31)
    running, late = (rng.integers(0, TINY_EOS, n).tolist() for n in (40, 150))
    options = dataclasses.replace(GPU, prefill_attention="pallas_gpu")
    with jax.default_matmul_precision("highest"), fast_compile():
        with sfi_jax.Engine(model, mode=mode, sfi=SFI, max_slots=2, max_len=256, chunk_steps=2,
                            prefill_chunk=32, options=options) as engine:
            first = engine.submit(sfi_jax.Request(prompt=running, max_tokens=40))
            second = engine.submit(sfi_jax.Request(prompt=late, max_tokens=16))
            got = [first.result(600).token_ids, second.result(600).token_ids]
    for prompt, n, g in ((running, 40, got[0]), (late, 16, got[1])):
        with jax.default_matmul_precision("highest"), fast_compile():
            ref = sfi_jax.generate(model, [prompt], mode=mode, sfi=SFI, options=XLA,
                                   max_new_tokens=n, return_logits=True)
        assert_same_greedy(g, ref.tokens[0], ref.stats["logits"][0],
                           what=f"engine {mode} prompt {len(prompt)}")


def test_mosaic_gpu_prefill_in_generate(tmp_path):
    """prefill_attention="mosaic_gpu" compiled: a bfloat16 model's first-token logits, prompts
    of one and several 64-token chunks, equal the XLA prefill's and cuDNN's up to bfloat16
    rounding."""
    _, d = make_hf_checkpoint(tmp_path, "qwen3", seed=11, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=64)
    model = sfi_jax.load_model(d, dtype="bfloat16")
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, TINY_EOS, n).tolist() for n in (30, 64, 200)]
    out = {}
    for impl in ("xla", "cudnn", "mosaic_gpu"):
        out[impl] = sfi_jax.generate(model, prompts, max_new_tokens=1, mode="dense",
                                     return_logits=True, stop_at_eos=False, prefill_chunk=64,
                                     options=EngineOptions(prefill_attention=impl))
    assert out["mosaic_gpu"].stats["prefill_chunks"] == 4
    for impl in ("cudnn", "mosaic_gpu"):
        for i in range(len(prompts)):
            err = rel_err(out[impl].stats["logits"][i, 0], out["xla"].stats["logits"][i, 0])
            assert err < 2e-2, f"{impl} row {i}: {err:.2e}"


@pytest.mark.parametrize("batch", [1, 6])
def test_mosaic_gpu_matmuls_in_generate(tmp_path, batch):
    """matmul="mosaic_gpu" compiled: every decode projection of a bfloat16 model (dims
    multiples of 64) through the Mosaic kernel, with its residual and SiLU epilogues in the
    kernel (epilogue="fused") or XLA's, gives the XLA matmuls' greedy tokens and logits up
    to bfloat16 rounding, at one row and at six."""
    _, d = make_hf_checkpoint(tmp_path, "qwen3", seed=13, eos_token_id=TINY_EOS,
                              hidden_size=256, intermediate_size=512, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64)
    model = sfi_jax.load_model(d, dtype="bfloat16")
    rng = np.random.default_rng(14)
    prompts = [rng.integers(0, TINY_EOS, 40 + 7 * i).tolist() for i in range(batch)]
    out = {}
    for matmul, epilogue in (("xla", "xla"), ("mosaic_gpu", "xla"), ("mosaic_gpu", "fused")):
        out[matmul, epilogue] = sfi_jax.generate(
            model, prompts, mode="dense", max_new_tokens=8, return_logits=True,
            stop_at_eos=False, options=EngineOptions(matmul=matmul, epilogue=epilogue))
    ref = out["xla", "xla"]
    for epilogue in ("xla", "fused"):
        got = out["mosaic_gpu", epilogue]
        for b in range(batch):
            # (a bfloat16 model rounds each projection's output to 8 bits: summed in another
            # order, a top-2 gap of 3e-4 flipped on the H100 in row 4, so near-ties are taken
            # at bfloat16's 1e-2, not float32's 1e-4)
            assert_same_greedy(got.tokens[b], ref.tokens[b], ref.stats["logits"][b], rel=1e-2,
                               what=f"{epilogue} row {b}")
            assert rel_err(got.stats["logits"][b][0], ref.stats["logits"][b][0]) < 2e-2


def test_mosaic_gpu_attention_in_generate(tmp_path):
    check_mosaic_attention_in_generate(tmp_path)


def check_mosaic_attention_in_generate(tmp_path):
    """attention="mosaic_gpu" (compiled on a GPU; test_mosaic_interpret.py runs it in
    interpret mode on a CPU): a bfloat16 model's SFI decode, fed the XLA attention's
    tokens, gives its logits up to bfloat16 rounding at every step it can be compared at,
    prompts far longer than the budget and one within it, with the kernel's own new-token
    stores and without. Two runs, so that no step's output hangs on a near-tie: the kernels
    round the softmax weights to bfloat16 before P·V and XLA does not, and a random model's
    near-uniform scores put near-ties at the selection's cut, which the two roundings order
    differently (a 97-token row took position 53 or 30 in layer 1, then parted by 1e-1 at
    every fast step; on a CPU too, in interpret mode, with either kernel).
    - every step slow (t_max 1): the dense read with logits, whose output is dense attention;
    - one selection, the first decode step's, then fast steps only: the sparse read with the
      new token, compared on the rows whose selection both runs made alike (diagnostics)."""
    _, d = make_hf_checkpoint(tmp_path, "qwen3", seed=17, eos_token_id=TINY_EOS,
                              hidden_size=256, intermediate_size=512, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=64)
    model = sfi_jax.load_model(d, dtype="bfloat16")
    rng = np.random.default_rng(18)
    prompts = [rng.integers(0, TINY_EOS, n).tolist() for n in (150, 13, 97, 131, 112, 88)]
    # (2 KV heads x 12 compact positions: a multiple of 8, as the Mosaic sparse read takes)
    base = dataclasses.replace(SFI, k_select=10, warmup_steps=0)
    # (the caches are bfloat16 here, as the Mosaic read takes: a CPU keeps float32 ones, whose
    # reads take the Triton kernels)
    assert state.cache_dtype(jnp.bfloat16) == jnp.bfloat16
    assert mgpu.supported(jnp.zeros((1, 8, 64), jnp.bfloat16),
                          jnp.zeros((1, 2, 256, 64), jnp.bfloat16),
                          jnp.zeros((1, 2, base.n_sink + base.k_select, 64), jnp.bfloat16))
    for t_max in (1, 64):
        sfi = dataclasses.replace(base, t_max=t_max)
        kw = dict(mode="sfi", sfi=sfi, max_new_tokens=NEW, return_logits=True,
                  stop_at_eos=False, diagnostics=True)
        ref = sfi_jax.generate(model, prompts, options=EngineOptions(attention="xla"), **kw)
        compared = 0
        for stores in (False, True):  # (True: the sparse read's own new-token stores)
            got = sfi_jax.generate(
                model, prompts, options=EngineOptions(
                    attention="mosaic_gpu", tuning=KernelTuning(kernel_stores=stores)),
                forced_tokens=np.asarray(ref.tokens, np.int32), **kw)
            assert got.tokens == ref.tokens  # (the forced tokens)
            slow = np.asarray(got.stats["slow_timeline"])
            same_set = [np.array_equal(got.stats["selected_positions"][:, b],
                                       ref.stats["selected_positions"][:, b])
                        for b in range(len(prompts))]
            for b in range(len(prompts)):
                # t_max 64: a row that refreshed again after its first step (a trigger), or
                # whose selection parted at a near-tie, is not compared
                if t_max == 1:
                    assert slow[b].all()
                elif slow[b, 1:].any() or not same_set[b]:
                    continue
                else:
                    compared += len(prompts[b]) > sfi.budget
                for t in range(NEW):
                    err = rel_err(got.stats["logits"][b][t], ref.stats["logits"][b][t])
                    assert err < 2e-2, (f"t_max={t_max} kernel_stores={stores} row {b} "
                                        f"step {t}: {err:.2e}")
        # (rows that read a compact buffer at every fast step, with either store form)
        assert t_max == 1 or compared >= 4, compared


def test_mosaic_gpu_moe_in_generate(tmp_path):
    """moe="mosaic_gpu" compiled: a bfloat16 Qwen3-MoE's routed experts through the Mosaic
    twin give lax.ragged_dot's greedy tokens and logits up to bfloat16 rounding."""
    kind, kw = MODELS["qwen3-moe"]
    _, d = make_hf_checkpoint(tmp_path, kind, seed=15, eos_token_id=TINY_EOS, **kw)
    model = sfi_jax.load_model(d, dtype="bfloat16")
    rng = np.random.default_rng(16)
    prompts = [rng.integers(0, TINY_EOS, n).tolist() for n in (30, 57, 9)]
    out = {}
    for moe in ("xla", "mosaic_gpu"):
        out[moe] = sfi_jax.generate(model, prompts, mode="dense", max_new_tokens=8,
                                    return_logits=True, stop_at_eos=False,
                                    options=EngineOptions(moe=moe))
    ref, got = out["xla"], out["mosaic_gpu"]
    for b in range(len(prompts)):
        assert_same_greedy(got.tokens[b], ref.tokens[b], ref.stats["logits"][b], rel=1e-2,
                           what=f"row {b}")
        assert rel_err(got.stats["logits"][b][0], ref.stats["logits"][b][0]) < 2e-2


TRITON_DEPRECATION = "Pallas Triton backend is deprecated"


def test_default_path_prints_no_deprecation_warning(tmp_path):
    """SFI decoding with the platform's defaults (Triton kernels among them, where they are
    faster) prints no deprecation warning under Python's default warning filters: JAX's
    DeprecationWarning is attributed to its own module, which those filters ignore. With
    every DeprecationWarning shown (pytest's setting) the same run prints JAX's, so the
    check sees the warning when it is there, and the defaults do run a Triton kernel."""
    kind, kw = MODELS["qwen3-g3"]
    _, d = make_hf_checkpoint(tmp_path, kind, seed=5, eos_token_id=TINY_EOS, **kw)
    code = ("import sfi_jax\n"
            f"m = sfi_jax.load_model({str(d)!r}, dtype='float32')\n"
            "r = sfi_jax.generate(m, [list(range(1, 150))], mode='sfi', max_new_tokens=8,\n"
            "                     stop_at_eos=False, sfi=sfi_jax.SFIConfig(n_sink=2, k_select=8,"
            " n_recent=8, t_max=6))\n"
            "print(len(r.tokens[0]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS",)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    stderr = {}
    for name, flags in (("default", []), ("shown", ["-W", "always::DeprecationWarning"])):
        proc = subprocess.run([sys.executable, *flags, "-c", code], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.split()[-1] == "8", proc.stdout
        stderr[name] = proc.stderr
    assert TRITON_DEPRECATION not in stderr["default"], stderr["default"][-3000:]
    assert TRITON_DEPRECATION in stderr["shown"], "the defaults ran no Triton kernel"
