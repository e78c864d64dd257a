"""Model parity with Hugging Face transformers (random tiny checkpoints and the embedded SmolLM2),
checkpoint formats (sharded safetensors, bfloat16, Orbax)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfi_jax
from conftest import (assert_same_greedy, build_hf_model, hf_greedy, hf_logits,
                      make_hf_checkpoint, rel_err)

torch = pytest.importorskip("torch")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
LINEAR = {"rope_type": "linear", "factor": 4.0}

# name: (kind, config overrides)
CASES = {
    "qwen3_yarn_tied": ("qwen3", dict(tie_word_embeddings=True, rope_scaling=YARN)),
    "qwen3_untied": ("qwen3", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3_moe_norm_topk": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2,
                                              norm_topk_prob=True)),
    "qwen3_moe_raw_topk": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                             norm_topk_prob=False, num_hidden_layers=3)),
    "llama_llama3_rope": ("llama", dict(rope_scaling=LLAMA3, num_hidden_layers=3)),
    "llama_linear_rope": ("llama", dict(rope_scaling=LINEAR, rope_theta=500.0)),
}


def _tokens(shape, seed=0, vocab=256):
    return np.random.default_rng(seed).integers(0, vocab, shape)


@pytest.mark.parametrize("name", list(CASES))
def test_hf_parity_logits_and_greedy(name, tmp_path, xla_fast_compile):
    kind, overrides = CASES[name]
    hf, d = make_hf_checkpoint(tmp_path / name, kind, seed=1, **overrides)
    model = sfi_jax.load_model(d, dtype="float32")
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size) == (overrides.get("num_hidden_layers", 2), 64, 4, 2, 16, 256)
    if kind == "qwen3_moe":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (
            overrides["num_experts"], 2, overrides["norm_topk_prob"])

    tokens = _tokens((2, 40), seed=2)
    ref = hf_logits(hf, tokens)
    got = np.asarray(sfi_jax.forward(model, tokens))
    assert got.shape == ref.shape and got.dtype == np.float32
    assert rel_err(got, ref) < 1e-4, name

    prompts = _tokens((2, 12), seed=3)
    want, want_logits = hf_greedy(hf, prompts, 32)
    res = sfi_jax.generate(model, prompts.tolist(), max_new_tokens=32, mode="dense",
                           stop_at_eos=False)
    for b in range(2):
        assert len(res.tokens[b]) == 32
        assert_same_greedy(res.tokens[b], want[b], want_logits[b], what=f"{name} row {b}")


@pytest.mark.parametrize("name", ["qwen3_yarn_tied", "llama_llama3_rope", "llama_linear_rope"])
def test_rope_scaling_is_visible_at_the_tolerance(name):
    """The parity tolerance can tell a scaled rope from an unscaled one on these configs."""
    kind, overrides = CASES[name]
    scaled = build_hf_model(kind, seed=1, **overrides)
    plain = build_hf_model(kind, seed=1, **{k: v for k, v in overrides.items()
                                            if k != "rope_scaling"})
    plain.load_state_dict(scaled.state_dict())
    tokens = _tokens((2, 40), seed=2)
    assert rel_err(hf_logits(plain, tokens), hf_logits(scaled, tokens)) > 1e-3


def test_sharded_safetensors(tmp_path):
    hf, d = make_hf_checkpoint(tmp_path / "sharded", "qwen3", seed=4,
                               save_kw=dict(max_shard_size="100KB"), tie_word_embeddings=False)
    index = os.path.join(d, "model.safetensors.index.json")
    assert os.path.exists(index)
    shards = glob.glob(os.path.join(d, "*.safetensors"))
    assert len(shards) > 1
    assert set(json.load(open(index))["weight_map"].values()) == {os.path.basename(s) for s in shards}
    model = sfi_jax.load_model(d, dtype="float32")
    tokens = _tokens((2, 40), seed=5)
    assert rel_err(np.asarray(sfi_jax.forward(model, tokens)), hf_logits(hf, tokens)) < 1e-4


def test_bfloat16_load_against_float32_reference(tmp_path):
    hf, d = make_hf_checkpoint(tmp_path / "bf16", "qwen3", seed=6)
    model = sfi_jax.load_model(d, dtype="bfloat16")
    assert str(model.dtype) == "bfloat16"
    assert str(model.params["layers"]["wq"].dtype) == "bfloat16"
    tokens = _tokens((2, 40), seed=7)
    got = np.asarray(sfi_jax.forward(model, tokens))
    assert got.dtype == np.float32 and np.all(np.isfinite(got))
    err = rel_err(got, hf_logits(hf, tokens))
    assert err < 3e-2


def test_orbax_round_trip(tmp_path):
    _, d = make_hf_checkpoint(tmp_path / "src", "qwen3_moe", seed=8, num_experts=4)
    model = sfi_jax.load_model(d, dtype="float32")
    out = sfi_jax.models.save_orbax(model, str(tmp_path / "orbax"))
    restored = sfi_jax.load_model(out, dtype="float32")
    assert restored.config == model.config
    tokens = _tokens((2, 24), seed=9)
    a = np.asarray(sfi_jax.forward(model, tokens))
    b = np.asarray(sfi_jax.forward(restored, tokens))
    np.testing.assert_array_equal(a, b)
    for x, y in zip(jax.tree.leaves(model.params), jax.tree.leaves(restored.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------- the embedded SmolLM2

SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):\n",
                "Once upon a time, in a small village,"]


def test_smollm2_config(smol_model):
    cfg = smol_model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and not cfg.qk_norm


def test_smollm2_logits_match_transformers_gguf(smol_model, smol_tokenizer, smol_hf):
    text = ("Slow-fast inference keeps a small set of past tokens for most decoding steps. "
            "It refreshes the set at sentence boundaries.")
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens = np.asarray([ids])
    ref = hf_logits(smol_hf, tokens)
    got = np.asarray(sfi_jax.forward(smol_model, tokens))
    assert rel_err(got, ref) < 1e-4
    assert np.array_equal(got[0, -1].argmax(), ref[0, -1].argmax())


def test_smollm2_greedy_matches_transformers(smol_model, smol_tokenizer, smol_hf):
    res = sfi_jax.generate(smol_model, SMOL_PROMPTS, max_new_tokens=24, mode="dense",
                           tokenizer=smol_tokenizer, stop_at_eos=False)
    for i, prompt in enumerate(SMOL_PROMPTS):
        ids = smol_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        want, want_logits = hf_greedy(smol_hf, [ids], 24)
        assert len(res.tokens[i]) == 24
        assert_same_greedy(res.tokens[i], want[0], want_logits[0], what=f"prompt {i}")
        assert res.text[i] == smol_tokenizer.decode(res.tokens[i], skip_special_tokens=True)
    assert res.stats["decode_steps"] == 23


@pytest.mark.parametrize("fuse", [False, True])
def test_split_layers_via_host_and_on_device(fuse, xla_fast_compile):
    """Both split paths give each layer's slice of the stacked weights (q/k/v concatenated when
    fused; the o and MLP weights transposed with fuse's K-major layout), on the stacked
    weights' device, and free the stacked tensors."""
    from sfi_jax.models.config import PRESETS
    from sfi_jax.models.modeling import (K_MAJOR, QKV, WeightLayout, split_layers,
                                         unfuse_qkv_weights)
    from sfi_jax.models.params import random_params

    cfg = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=3, hidden_size=64,
                              intermediate_size=96, num_q_heads=4, num_kv_heads=2, head_dim=16,
                              vocab_size=128)
    want = {k: np.asarray(v) for k, v in random_params(cfg, "bfloat16", 5)["layers"].items()}
    for via_host in (True, False):
        stacked = random_params(cfg, "bfloat16", 5)["layers"]
        kept = dict(stacked)
        layers = split_layers(stacked, fuse_qkv=fuse, via_host=via_host, k_major=fuse)
        assert not stacked and all(a.is_deleted() for a in kept.values())
        assert len(layers) == 3
        for i, layer in enumerate(layers):
            names = [n for n in want if not (fuse and n in QKV)] + (["wqkv"] if fuse else [])
            names = [n + "_t" if fuse and n in K_MAJOR else n for n in names]
            assert sorted(layer) == sorted(names), (via_host, list(layer))
            layout = WeightLayout(split=True, fused_qkv=fuse, k_major=fuse)
            assert WeightLayout.of(layers) == layout
            canon = unfuse_qkv_weights(layer, cfg, layout)
            assert sorted(canon) == sorted(want)
            for n in want:
                np.testing.assert_array_equal(np.asarray(canon[n]), want[n][i])
            for n in names:
                ref = (np.concatenate([want[q][i] for q in QKV], -1) if n == "wqkv"
                       else want[n[:-2]][i].T if n.endswith("_t") else want[n][i])
                got = layer[n]
                assert got.dtype == ref.dtype and got.devices() == {jax.devices()[0]}
                np.testing.assert_array_equal(np.asarray(got), ref, err_msg=f"{via_host} {n}")


def test_random_weights_draw_one_layer_at_a_time():
    """random_params draws a stacked tensor layer by layer: the initialiser's temporaries stay
    well below the weights it makes (Qwen3-30B-A3B: 21 GiB beside 57 on the CPU; drawn whole,
    one expert stack's float32 draw alone was 144 GiB), so a model that fits a GPU can be made
    on it. Compiled, not run. Each layer of a stack is a fresh normal draw."""
    from sfi_jax.models.config import PRESETS
    from sfi_jax.models.params import _random_init, random_params

    cfg = PRESETS["qwen3-30b-a3b"]
    memory = _random_init(cfg, jnp.dtype("bfloat16"), 0, None).lower().compile() \
        .memory_analysis()
    assert memory.temp_size_in_bytes < 0.5 * memory.output_size_in_bytes, (
        memory.temp_size_in_bytes / 2**30, memory.output_size_in_bytes / 2**30)
    small = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=3, hidden_size=64,
                                intermediate_size=96, num_q_heads=4, num_kv_heads=2,
                                head_dim=16, vocab_size=128)
    wq = np.asarray(random_params(small, "float32", 1)["layers"]["wq"])
    assert wq.shape == (3, 64, 64) and not np.allclose(wq[0], wq[1])
    assert abs(wq.std() * 64 ** 0.5 - 1.0) < 0.05  # std 1 / sqrt(fan_in)
