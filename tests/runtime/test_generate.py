"""generate(): ragged batches, sampling, EOS, and clear errors on bad input."""

from __future__ import annotations

import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest

import sfi_jax
from conftest import TINY_EOS, assert_same_greedy, hf_logits, rel_err
from sfi_jax.runtime.sampling import SamplingConfig, sample

# the tiny models' programs: compiling them is most of this file's time (conftest.py)
pytestmark = pytest.mark.usefixtures("xla_fast_compile")

SMALL = sfi_jax.SFIConfig(n_sink=2, k_select=8, n_recent=8, t_max=8)
# The tiny-model calls share static shapes (3 or 1 rows, 16 new tokens, logits returned, a
# 128-position cache) so that they reuse compiled decode loops.
NEW = 16
KW = dict(max_new_tokens=NEW, stop_at_eos=False, return_logits=True)


def _prompts(lengths, seed=0, lo=0, hi=TINY_EOS):
    rng = np.random.default_rng(seed)
    return [rng.integers(lo, hi, n).tolist() for n in lengths]


# ---------------------------------------------------------------- ragged batches

@pytest.mark.parametrize("mode", ["dense", "sfi"])
def test_ragged_batch_rows_equal_prompts_alone(tiny_qwen3, mode):
    """Rows of lengths 5, 17 and 40 in one batch give what each prompt gives alone."""
    model = tiny_qwen3.model
    prompts = _prompts([5, 17, 40], seed=1)
    kw = dict(KW, mode=mode, sfi=SMALL)
    batch = sfi_jax.generate(model, prompts, **kw)
    assert batch.stats["prompt_tokens"] == [5, 17, 40]
    for i, p in enumerate(prompts):
        alone = sfi_jax.generate(model, [p], **kw)
        assert len(batch.tokens[i]) == 16
        assert_same_greedy(batch.tokens[i], alone.tokens[0], alone.stats["logits"][0],
                           what=f"{mode} row {i}")
        if batch.tokens[i] == alone.tokens[0]:
            np.testing.assert_allclose(batch.stats["logits"][i], alone.stats["logits"][0],
                                       rtol=0, atol=1e-5)
        if mode == "sfi":
            np.testing.assert_array_equal(batch.stats["slow_timeline"][i],
                                          alone.stats["slow_timeline"][0])
        else:  # and what transformers gives for the prompt followed by those tokens
            ref = hf_logits(tiny_qwen3.hf, [p + batch.tokens[i][:-1]])[0, len(p) - 1:]
            assert rel_err(batch.stats["logits"][i], ref) < 1e-4, f"row {i}"
    if mode == "sfi":
        assert batch.stats["slow_timeline"][:, 0].all()


def test_prompt_forms(tiny_qwen3):
    """A flat id list is one prompt; numpy ids and a [B, T] array work; same ids, same tokens."""
    p = _prompts([9], seed=2)[0]
    a = sfi_jax.generate(tiny_qwen3.model, p, mode="dense", **KW)
    assert len(a.tokens) == 1 and len(a.tokens[0]) == NEW and a.text is None
    assert a.stats["decode_steps"] == NEW - 1 and a.stats["slow_steps"] == [0]
    for form in ([np.asarray(p)], np.asarray(p), np.asarray([p])):
        assert sfi_jax.generate(tiny_qwen3.model, form, mode="dense", **KW).tokens == a.tokens
    three = sfi_jax.generate(tiny_qwen3.model, np.asarray([p, p, p]), mode="dense", **KW)
    assert three.tokens == a.tokens * 3


def test_eos_ends_a_row_and_others_continue(tiny_qwen3):
    prompts = _prompts([6, 11, 30], seed=3)
    forced = np.full((3, NEW), -1, np.int32)
    forced[0, 4] = TINY_EOS
    forced[2, 0] = TINY_EOS
    res = sfi_jax.generate(tiny_qwen3.model, prompts, mode="dense", forced_tokens=forced,
                           max_new_tokens=NEW, return_logits=True)
    assert res.tokens[0][-1] == TINY_EOS and len(res.tokens[0]) == 5
    assert res.tokens[2] == [TINY_EOS]
    assert len(res.tokens[1]) == NEW and TINY_EOS not in res.tokens[1]
    assert res.stats["new_tokens"] == [5, NEW, 1]
    kept = sfi_jax.generate(tiny_qwen3.model, prompts, mode="dense", forced_tokens=forced, **KW)
    assert len(kept.tokens[0]) == NEW and kept.tokens[0][4] == TINY_EOS
    assert kept.tokens[0][:5] == res.tokens[0] and kept.tokens[1] == res.tokens[1]


def test_all_rows_eos_stops_early(tiny_qwen3):
    forced = np.full((3, NEW), -1, np.int32)
    forced[:, 2] = TINY_EOS
    res = sfi_jax.generate(tiny_qwen3.model, _prompts([6, 11, 30], seed=3), mode="dense",
                           forced_tokens=forced, max_new_tokens=NEW, return_logits=True)
    assert [len(t) for t in res.tokens] == [3, 3, 3]
    assert res.stats["decode_steps"] == 2


# ---------------------------------------------------------------- sampling

def test_sampling_reproducible_from_seed(tiny_qwen3):
    prompts = _prompts([7, 13, 20], seed=4)
    kw = dict(KW, mode="dense", temperature=0.8, top_k=20, top_p=0.9)
    a = sfi_jax.generate(tiny_qwen3.model, prompts, seed=11, **kw)
    b = sfi_jax.generate(tiny_qwen3.model, prompts, seed=11, **kw)
    c = sfi_jax.generate(tiny_qwen3.model, prompts, seed=12, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    assert all(0 <= t < 256 for row in a.tokens + c.tokens for t in row)
    greedy = sfi_jax.generate(tiny_qwen3.model, prompts, mode="dense", **KW)
    assert a.tokens != greedy.tokens
    # every sampled token is inside the top-20 of the logits it was drawn from
    lg = a.stats["logits"]
    for r in range(3):
        for i, t in enumerate(a.tokens[r]):
            assert t in np.argsort(lg[r, i])[-20:]


def _logits(batch=64, vocab=50, seed=0, scale=3.0):
    return np.random.default_rng(seed).normal(size=(batch, vocab)).astype(np.float32) * scale


def test_greedy_is_argmax():
    lg = _logits()
    out = sample(lg, jax.random.key(0), SamplingConfig())
    np.testing.assert_array_equal(np.asarray(out), lg.argmax(-1))


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0, top_k=1),
                                 SamplingConfig(temperature=5.0, top_p=1e-6),
                                 SamplingConfig(temperature=0.7, top_k=3, top_p=1e-6)])
def test_top_k_1_and_tiny_top_p_are_greedy(cfg):
    lg = _logits(seed=1)
    for s in range(5):
        out = sample(lg, jax.random.key(s), cfg)
        np.testing.assert_array_equal(np.asarray(out), lg.argmax(-1))


def _expected_probs(logits, temperature, top_k=0, top_p=1.0):
    """Plain numpy: softmax(logits / T) restricted to the top-k, then to the smallest set of the
    most likely tokens whose mass reaches top_p, renormalised."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    keep[order[:top_k] if top_k else order] = True
    p = np.where(keep, p, 0)
    p /= p.sum()
    if top_p < 1:
        cum = np.cumsum(p[order])
        n = int(np.searchsorted(cum, top_p) + 1)
        keep2 = np.zeros_like(keep)
        keep2[order[:n]] = True
        p = np.where(keep2, p, 0)
        p /= p.sum()
    return p


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.3, 0, 1.0),
                                                       (1.0, 3, 1.0), (1.0, 0, 0.8)])
def test_sample_distribution_matches_softmax(temperature, top_k, top_p):
    logits = np.array([1.0, 0.5, 0.0, -0.3, -1.0, 0.8], np.float32)
    n = 40000
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    draws = np.asarray(sample(np.tile(logits, (n, 1)), jax.random.key(3), cfg))
    counts = np.bincount(draws, minlength=len(logits))
    p = _expected_probs(logits, temperature, top_k, top_p)
    assert np.all(counts[p == 0] == 0), (counts, p)
    expected = n * p[p > 0]
    chi2 = float(np.sum((counts[p > 0] - expected) ** 2 / expected))
    dof = int((p > 0).sum()) - 1
    # far beyond the 99.9% quantile for these degrees of freedom (<= 5): 20.5
    assert chi2 < 25.0, (chi2, dof, counts, expected)


@pytest.mark.parametrize("kw, bad", [(dict(temperature=-0.1), "-0.1"), (dict(top_p=0.0), "0.0"),
                                     (dict(top_p=1.5), "1.5"), (dict(top_k=-2), "-2")])
def test_sampling_config_rejects_bad_values(kw, bad):
    with pytest.raises(ValueError, match=bad):
        SamplingConfig(**kw)


# ---------------------------------------------------------------- bad input

def _copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_unknown_preset():
    with pytest.raises(ValueError, match="qwen3-999b"):
        sfi_jax.load_model("qwen3-999b")


def test_hub_id_offline_and_not_cached(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="no-such-owner/no-such-model"):
        sfi_jax.load_model("no-such-owner/no-such-model")


def test_tokenizer_of_a_config_only_preset():
    with pytest.raises(ValueError, match="qwen3-4b"):
        sfi_jax.load_tokenizer("qwen3-4b")


def test_forward_rejects_bad_shapes(tiny_qwen3):
    with pytest.raises(ValueError, match=r"\(5,\)"):
        sfi_jax.forward(tiny_qwen3.model, np.arange(5))
    with pytest.raises(ValueError, match="513"):
        sfi_jax.forward(tiny_qwen3.model, np.zeros((1, 513), np.int32))


def test_missing_directory(tmp_path):
    with pytest.raises((ValueError, FileNotFoundError), match="no_such_model"):
        sfi_jax.load_model(str(tmp_path / "no_such_model"))


def test_directory_without_config(tmp_path):
    d = tmp_path / "empty_ckpt"
    d.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        sfi_jax.load_model(str(d))


def test_directory_without_weights(tiny_qwen3, tmp_path):
    d = tmp_path / "no_weights"
    d.mkdir()
    shutil.copy(os.path.join(tiny_qwen3.dir, "config.json"), d)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        sfi_jax.load_model(str(d), dtype="float32")


@pytest.mark.parametrize("damage", ["garbage", "bad_header", "truncated", "tiny"])
def test_corrupt_safetensors(tiny_qwen3, tmp_path, damage):
    d = _copy_checkpoint(tiny_qwen3.dir, tmp_path / "ckpt")
    path = os.path.join(d, "model.safetensors")
    data = open(path, "rb").read()
    new = {"garbage": np.random.default_rng(0).bytes(1000),
           "bad_header": (16).to_bytes(8, "little") + b"this is not json",
           "truncated": data[:len(data) // 2],
           "tiny": data[:5]}[damage]
    with open(path, "wb") as f:
        f.write(new)
    with pytest.raises(ValueError, match="model.safetensors"):
        sfi_jax.load_model(d, dtype="float32")


def test_config_weight_shape_mismatch(tiny_qwen3, tmp_path):
    d = _copy_checkpoint(tiny_qwen3.dir, tmp_path / "ckpt")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["hidden_size"] = 96
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight.*\(256, 64\).*\(256, 96\)"):
        sfi_jax.load_model(d, dtype="float32")


def test_config_with_more_layers_than_weights(tiny_qwen3, tmp_path):
    d = _copy_checkpoint(tiny_qwen3.dir, tmp_path / "ckpt")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["num_hidden_layers"] = 3
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"model\.layers\.2\."):
        sfi_jax.load_model(d, dtype="float32")


@pytest.mark.parametrize("dtype", ["int8", "float64", "fp8"])
def test_bad_dtype(tiny_qwen3, dtype):
    with pytest.raises(ValueError, match=dtype):
        sfi_jax.load_model(tiny_qwen3.dir, dtype=dtype)


def test_non_finite_logits_are_reported(tiny_qwen3, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy_checkpoint(tiny_qwen3.dir, tmp_path / "ckpt")
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors["model.norm.weight"][:] = np.nan
    save_file(tensors, path, metadata={"format": "pt"})
    model = sfi_jax.load_model(d, dtype="float32")
    with pytest.raises(FloatingPointError, match="non-finite"):
        sfi_jax.generate(model, [[1, 2, 3]], max_new_tokens=2, mode="dense")


@pytest.mark.parametrize("prompts, kw, match", [
    ([[1] * 500], dict(max_new_tokens=20), r"500.*20.*520.*512"),
    ([[1, 2], []], dict(max_new_tokens=2), "prompt 1 is empty"),
    ([], dict(max_new_tokens=2), "empty"),
    ([[1, 2]], dict(max_new_tokens=0), "max_new_tokens.*0"),
    ([[1, 2]], dict(max_new_tokens=-3), "max_new_tokens.*-3"),
    ([[1, 2]], dict(max_new_tokens=2.5), "max_new_tokens.*2.5"),
    ([[1, 2], [3, 256]], dict(max_new_tokens=2), r"prompt 1 .*256.*\[0, 256\)"),
    ([[-1, 2]], dict(max_new_tokens=2), "-1"),
    ([[1, 2.5]], dict(max_new_tokens=2), "2.5"),
    ("hello", dict(max_new_tokens=2), "tokenizer"),
    ([[1, 2]], dict(max_new_tokens=2, mode="fast"), "fast"),
    ([[1, 2]], dict(max_new_tokens=2, sfi="small"), "SFIConfig"),
    ([[1, 2]], dict(max_new_tokens=2, temperature=-1.0), "temperature"),
    ([[1, 2]], dict(max_new_tokens=2, top_p=0.0), "top_p"),
    ([[1, 2]], dict(max_new_tokens=2, top_k=-1), "top_k"),
    ([[1, 2]], dict(max_new_tokens=3, forced_tokens=[[1, 2]]), "forced_tokens"),
    ([[1, 2]], dict(max_new_tokens=2, trigger_ids=[5, 300]), "300"),
])
def test_bad_generate_input(tiny_qwen3, prompts, kw, match):
    with pytest.raises(ValueError, match=match):
        sfi_jax.generate(tiny_qwen3.model, prompts, **kw)


def test_empty_string_prompt(tiny_qwen3, smol_tokenizer):
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        sfi_jax.generate(tiny_qwen3.model, [""], max_new_tokens=2, tokenizer=smol_tokenizer)


@pytest.mark.parametrize("kw, match", [(dict(k_select=0), "k_select"), (dict(t_max=0), "t_max"),
                                       (dict(n_recent=-1), "n_recent"),
                                       (dict(policy="never"), "never"),
                                       (dict(power_alpha=1.5), "power_alpha")])
def test_bad_sfi_config(kw, match):
    with pytest.raises(ValueError, match=match):
        sfi_jax.SFIConfig(**kw)


def test_kv_cache_that_does_not_fit(tiny_qwen3, monkeypatch):
    runtime = sys.modules[sfi_jax.generate.__module__]
    monkeypatch.setattr(runtime, "_available_device_bytes", lambda *a, **k: 10_000)
    with pytest.raises(MemoryError, match="GiB"):
        sfi_jax.generate(tiny_qwen3.model, [[1, 2, 3]], max_new_tokens=4, mode="dense")
    with pytest.raises(MemoryError, match="GiB"):
        sfi_jax.generate(tiny_qwen3.model, [[1, 2, 3]], max_new_tokens=4, mode="sfi")
    gpu = type("FakeGpu", (), {"platform": "gpu"})()
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert "XLA_CLIENT_MEM_FRACTION is unset (0.75)" in runtime._memory_fraction_hint(gpu)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION is 0.5" in runtime._memory_fraction_hint(gpu)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.8")
    assert "XLA_CLIENT_MEM_FRACTION is 0.8" in runtime._memory_fraction_hint(gpu)
    assert runtime._memory_fraction_hint(type("Cpu", (), {"platform": "cpu"})()) == ""
