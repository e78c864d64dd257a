"""Small GGUF files written with the `gguf` package for the loader and tokenizer tests."""

from __future__ import annotations

import numpy as np
import pytest

from sfi_jax.models import tokenizer as tk

# a tiny llama: 2 query heads and 1 KV head of 16, hidden 32, MLP 64, 2 layers
SHAPE = dict(layers=2, hidden=32, ffn=64, heads=2, kv_heads=1)


def synthetic_tokenizer(pre: str) -> dict:
    """Byte-level BPE: 256 byte tokens, a few merges, control and user-defined tokens."""
    spelling = tk.byte_spelling()
    tokens = [spelling[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "1 2", "12 3", "Ġ Ġ"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    types = [1] * len(tokens)
    # <|endoftext|> too: transformers' GGUF path appends it to a vocabulary that lacks it
    tokens += ["<|endoftext|>", "<|begin|>", "<|end|>", "<think>"]
    types += [3, 3, 3, 4]
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "merges": merges, "token_type": types,
            "bos_token_id": len(tokens) - 3, "eos_token_id": len(tokens) - 2,
            "add_bos_token": False,
            "chat_template": "{% for m in messages %}<|begin|>{{ m['content'] }}<|end|>"
                             "{% endfor %}{% if add_generation_prompt %}<|begin|>{% endif %}"}


def _add_tokenizer(w, tokenizer: dict) -> None:
    for key, value in tokenizer.items():
        if key == "chat_template":
            w.add_chat_template(value)
        elif key == "model":
            w.add_tokenizer_model(value)
        elif key == "pre":
            w.add_tokenizer_pre(value)
        elif key == "tokens":
            w.add_token_list(value)
        elif key == "merges":
            w.add_token_merges(value)
        elif key == "token_type":
            w.add_token_types(value)
        elif key.endswith("_token_id"):
            w.add_uint32(f"tokenizer.ggml.{key}", value)
        else:
            w.add_bool(f"tokenizer.ggml.{key}", value)


def _add_weights(w, gguf, vocab: int, seed: int) -> None:
    """Random weights, matrices quantised (Q8_0 and Q4_1, as in real files), norms float32."""
    rng = np.random.default_rng(seed)
    s = SHAPE
    head_dim = s["hidden"] // s["heads"]

    def put(name, shape, qtype):
        x = rng.standard_normal(shape).astype(np.float32) * (0.5 if len(shape) > 1 else 0.1) + \
            (1.0 if len(shape) == 1 else 0.0)
        if qtype is None:
            w.add_tensor(name, x)
        else:
            q = gguf.quants.quantize(x, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    Q8, Q41 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
    put("token_embd.weight", (vocab, s["hidden"]), Q8)
    put("output_norm.weight", (s["hidden"],), None)
    for i in range(s["layers"]):
        put(f"blk.{i}.attn_norm.weight", (s["hidden"],), None)
        put(f"blk.{i}.ffn_norm.weight", (s["hidden"],), None)
        put(f"blk.{i}.attn_q.weight", (s["heads"] * head_dim, s["hidden"]), Q41)
        put(f"blk.{i}.attn_k.weight", (s["kv_heads"] * head_dim, s["hidden"]), Q41)
        put(f"blk.{i}.attn_v.weight", (s["kv_heads"] * head_dim, s["hidden"]), Q8)
        put(f"blk.{i}.attn_output.weight", (s["hidden"], s["heads"] * head_dim), Q41)
        put(f"blk.{i}.ffn_gate.weight", (s["ffn"], s["hidden"]), Q41)
        put(f"blk.{i}.ffn_up.weight", (s["ffn"], s["hidden"]), Q8)
        put(f"blk.{i}.ffn_down.weight", (s["hidden"], s["ffn"]), Q41)


def write_gguf(path, *, tokenizer: dict | None, weights: bool = False, seed: int = 0) -> str:
    """A tiny llama GGUF file. `tokenizer`: tokenizer.ggml.<key> (and chat_template) values;
    weights: the full model's tensors (else only a token embedding)."""
    gguf = pytest.importorskip("gguf")
    s = SHAPE
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(s["layers"])
    w.add_context_length(256)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if tokenizer:
        _add_tokenizer(w, tokenizer)
    vocab = len(tokenizer["tokens"]) if tokenizer else 64
    if weights:
        _add_weights(w, gguf, vocab, seed)
    else:
        w.add_tensor("token_embd.weight", np.zeros((vocab, s["hidden"]), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
