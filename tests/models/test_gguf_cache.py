"""The on-disk GGUF cache: a model loaded cold, warm (nothing read from the GGUF) and with the
cache off has the same weights, config and tokenizer; a damaged entry is rebuilt, a changed
file gets a new entry, an unwritable cache falls back to the file."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import sfi_jax
from gguf_files import synthetic_tokenizer, write_gguf
from sfi_jax.models import gguf_loader


def _host(model):
    return jax.tree.map(np.asarray, model.params)


def _equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), a, b)


@pytest.fixture()
def tiny_gguf(tmp_path):
    return write_gguf(tmp_path / "tiny.gguf", tokenizer=synthetic_tokenizer("smollm"),
                      weights=True)


def _forbid_reading(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the GGUF file was read although its cache entry exists")

    gguf_loader._reader_at.cache_clear()
    monkeypatch.setattr(gguf_loader, "_reader_at", fail)


def test_cold_warm_and_uncached_loads_agree(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", "off")
    gguf_loader._reader_at.cache_clear()
    ref = sfi_jax.load_model(tiny_gguf, dtype="float32")
    ref_bf16 = _host(sfi_jax.load_model(tiny_gguf, dtype="bfloat16"))
    ref_tok = sfi_jax.load_tokenizer(tiny_gguf)
    assert not (tmp_path / "cache").exists()

    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    cold = sfi_jax.load_model(tiny_gguf, dtype="float32")
    cold_tok = sfi_jax.load_tokenizer(tiny_gguf)
    (entry,) = (tmp_path / "cache" / "gguf").iterdir()
    assert entry.name.startswith("tiny-")
    assert sorted(p.name for p in entry.iterdir()) == [
        "config.json", "config.json.sha256.json", "tokenizer", "tokenizer.sha256.json",
        "weights-f32-q2-kv1.safetensors", "weights-f32-q2-kv1.safetensors.sha256.json"]

    _forbid_reading(monkeypatch)
    warm = sfi_jax.load_model(tiny_gguf, dtype="float32")
    warm_tok = sfi_jax.load_tokenizer(tiny_gguf)
    for m in (cold, warm):
        assert m.config == ref.config
        _equal(_host(m), _host(ref))
    texts = ["the 123 in", "<|begin|>hi<|end|><think>", "  he er"]
    for t in (cold_tok, warm_tok):
        assert t(texts)["input_ids"] == ref_tok(texts)["input_ids"]
        assert t.backend_tokenizer.to_str() == ref_tok.backend_tokenizer.to_str()
        assert t.special_tokens_map == ref_tok.special_tokens_map
        assert t.chat_template == ref_tok.chat_template
    # bfloat16 from the float32 cache: the same rounding as from the file
    _equal(_host(sfi_jax.load_model(tiny_gguf, dtype="bfloat16")), ref_bf16)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `permute`: HF (rotate-half) Q/K rows -> GGUF rows."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def test_cached_tensors_equal_the_dequantised_file(tiny_gguf, tmp_path, monkeypatch):
    """Every cached tensor, HF-named, against the gguf package's own dequantisation of the
    file's tensor; Q and K permuted back with llama.cpp's conversion formula."""
    import gguf

    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    cfg = gguf_loader.gguf_config(tiny_gguf)
    gguf_loader.gguf_getter(tiny_gguf, cfg)  # writes the cache entry
    cached = gguf_loader.gguf_getter(tiny_gguf, cfg)  # reads it back
    raw = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        [int(d) for d in reversed(t.shape)]) for t in gguf.GGUFReader(tiny_gguf).tensors}
    hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    per_layer = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
                 "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
                 "attn_v": "self_attn.v_proj.weight", "attn_output": "self_attn.o_proj.weight",
                 "ffn_gate": "mlp.gate_proj.weight", "ffn_up": "mlp.up_proj.weight",
                 "ffn_down": "mlp.down_proj.weight"}
    checked = 0
    for gname, ref in raw.items():
        parts = gname.split(".")
        name = hf.get(gname) or f"model.layers.{parts[1]}.{per_layer[parts[2]]}"
        a = np.asarray(cached(name)[...])
        assert a.dtype == np.float32 and a.shape == ref.shape, name
        if parts[-2] == "attn_q":
            a = _llama_cpp_permute(a, cfg.num_q_heads)
        elif parts[-2] == "attn_k":
            a = _llama_cpp_permute(a, cfg.num_kv_heads)
        np.testing.assert_array_equal(a, ref, err_msg=name)
        checked += 1
    assert checked == 2 + 9 * cfg.num_layers
    with pytest.raises(ValueError, match=r"tiny\.gguf: tensor output\.weight .* is missing"):
        cached("lm_head.weight")


def test_damaged_entry_is_rebuilt(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    ref = _host(sfi_jax.load_model(tiny_gguf, dtype="float32"))
    ids = sfi_jax.load_tokenizer(tiny_gguf)("the 123")["input_ids"]
    (entry,) = (tmp_path / "cache" / "gguf").iterdir()
    weights = entry / "weights-f32-q2-kv1.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    (entry / "config.json").write_text("{not json")
    (entry / "tokenizer" / "tokenizer.json").write_text("")
    _equal(_host(sfi_jax.load_model(tiny_gguf, dtype="float32")), ref)
    assert weights.stat().st_size == size
    assert sfi_jax.load_tokenizer(tiny_gguf)("the 123")["input_ids"] == ids
    assert (entry / "tokenizer" / "tokenizer.json").stat().st_size > 0


def test_changed_file_gets_a_new_entry(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    first = _host(sfi_jax.load_model(tiny_gguf, dtype="float32"))
    write_gguf(tiny_gguf, tokenizer=synthetic_tokenizer("smollm"), weights=True, seed=1)
    st = os.stat(tiny_gguf)
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = _host(sfi_jax.load_model(tiny_gguf, dtype="float32"))
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 2
    assert not np.array_equal(first["embed"], second["embed"])
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", "off")
    _equal(_host(sfi_jax.load_model(tiny_gguf, dtype="float32")), second)


def test_unwritable_cache_falls_back_to_the_file(tiny_gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(blocker / "cache"))  # cannot be created
    with pytest.warns(UserWarning, match="could not cache"):
        model = sfi_jax.load_model(tiny_gguf, dtype="float32")
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", "off")
    _equal(_host(model), _host(sfi_jax.load_model(tiny_gguf, dtype="float32")))
