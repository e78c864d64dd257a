"""Tokenizers from GGUF metadata, built with the `tokenizers` library alone (no torch).

A GGUF file carries its tokenizer as llama.cpp metadata (tokens, merges, token types, special
ids, chat template) instead of a `tokenizer.json`. transformers can read that too, but its GGUF
reader needs torch; this module builds the same byte-level BPE tokenizer from the metadata and
wraps it in `transformers.PreTrainedTokenizerFast`, so only the tokenizer packages are needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

# token types in tokenizer.ggml.token_type (llama.cpp's llama_token_type)
CONTROL = 3
USER_DEFINED = 4

META_KEYS = ("model", "pre", "tokens", "merges", "token_type", "bos_token_id", "eos_token_id",
             "unknown_token_id", "padding_token_id", "add_bos_token", "add_eos_token")

# Split patterns of byte-level BPE vocabularies other than GPT-2's (the ByteLevel default).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def read_gguf_metadata(reader, path: str) -> dict:
    """The tokenizer metadata of an open `gguf.GGUFReader` as a JSON-able dict.

    Raises ValueError naming `path` when the file has no tokenizer in it.
    """
    meta = {}
    for key in META_KEYS:
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            meta[key] = field.contents()
    chat = reader.fields.get("tokenizer.chat_template")
    if chat is not None:
        meta["chat_template"] = chat.contents()
    if not meta.get("tokens"):
        raise ValueError(f"{path} holds no tokenizer (no tokenizer.ggml.tokens metadata); pass "
                         "--tokenizer / load_tokenizer(...) a Hugging Face directory instead")
    return meta


def byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> character map of byte-level BPE: printable Latin-1 bytes stand for
    themselves, the other bytes for the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    spelling, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _respell(token: str, spelling: dict[int, str], alphabet: set[str]) -> str:
    """A token in the byte-level alphabet; tokens stored as plain text are re-spelled."""
    if set(token) <= alphabet:
        return token
    return "".join(spelling[b] for b in token.encode("utf-8"))


def build_backend(meta: dict, source: str = "GGUF"):
    """A `tokenizers.Tokenizer` (byte-level BPE) from GGUF tokenizer metadata."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers,
                            processors)

    kind = meta.get("model")
    if kind != "gpt2":
        raise ValueError(f"{source}: tokenizer.ggml.model is {kind!r}; only byte-level BPE "
                         "('gpt2') GGUF tokenizers are supported. Pass a Hugging Face tokenizer "
                         "directory as the tokenizer instead")
    tokens = list(meta["tokens"])
    merges = meta.get("merges")
    if not merges:
        raise ValueError(f"{source}: a byte-level BPE tokenizer without tokenizer.ggml.merges")
    spelling = byte_spelling()
    alphabet = set(spelling.values())
    vocab = {}
    for i, t in enumerate(tokens):
        vocab[_respell(t, spelling, alphabet)] = i
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"{source}: malformed merge {m!r} (expected two tokens)")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                               continuing_subword_prefix="", end_of_word_suffix=""))
    split = _SPLITS.get(meta.get("pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    types = list(meta.get("token_type") or ())
    # Control tokens stay whole and are special (skipped by decode(skip_special_tokens=True));
    # one outside the byte alphabet would be a mislabelled entry and is left out.
    special = [t for t, ty in zip(tokens, types) if ty == CONTROL and set(t) <= alphabet]
    user = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tok


def _token(meta: dict, key: str, source: str):
    i = meta.get(key)
    if i is None:
        return None
    tokens = meta["tokens"]
    if not 0 <= int(i) < len(tokens):
        raise ValueError(f"{source}: tokenizer.ggml.{key}={i} is outside the vocabulary "
                         f"(size {len(tokens)})")
    return tokens[int(i)]


def settings_of(meta: dict, source: str = "GGUF") -> dict:
    """What `wrap` needs besides the backend: named special tokens, flags, chat template."""
    out = {"bos_token": _token(meta, "bos_token_id", source),
           "eos_token": _token(meta, "eos_token_id", source),
           "unk_token": _token(meta, "unknown_token_id", source),
           "pad_token": _token(meta, "padding_token_id", source)}
    if meta.get("chat_template"):
        out["chat_template"] = meta["chat_template"]
    for key in ("add_bos_token", "add_eos_token"):
        if key in meta:
            out[key] = bool(meta[key])
    return out


def import_transformers():
    """`import transformers`, without its notice that models need torch when torch is absent
    (only its tokenizers are used here)."""
    if "transformers" not in sys.modules and importlib.util.find_spec("torch") is None:
        key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
        before = os.environ.get(key)
        os.environ[key] = "1"
        try:
            import transformers
        finally:
            if before is None:
                del os.environ[key]
            else:
                os.environ[key] = before
    import transformers

    return transformers


def wrap(backend, settings: dict):
    """`PreTrainedTokenizerFast` around `backend` with the file's special tokens and template."""
    return import_transformers().PreTrainedTokenizerFast(tokenizer_object=backend, **settings)


def tokenizer_from_metadata(meta: dict, source: str = "GGUF"):
    """The transformers fast tokenizer a GGUF file's tokenizer metadata describes."""
    return wrap(build_backend(meta, source), settings_of(meta, source))


def save(tok, directory: str) -> None:
    """Store a tokenizer made here for `load` (tokenizer.json + the wrapper's settings)."""
    settings = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    settings["chat_template"] = tok.chat_template
    for key in ("add_bos_token", "add_eos_token"):
        if key in tok.init_kwargs:
            settings[key] = tok.init_kwargs[key]
    os.makedirs(directory, exist_ok=True)
    tok.backend_tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "settings.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in settings.items() if v is not None}, f)


def load(directory: str):
    """A tokenizer stored by `save` (no merge list to parse: fast)."""
    from tokenizers import Tokenizer

    with open(os.path.join(directory, "settings.json"), encoding="utf-8") as f:
        settings = json.load(f)
    return wrap(Tokenizer.from_file(os.path.join(directory, "tokenizer.json")), settings)
