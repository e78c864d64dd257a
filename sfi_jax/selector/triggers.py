"""Trigger tokens (SFI_METHOD.md §3): computed once on the host from the tokenizer, so the
decode loop only looks ids up in a boolean mask and never decodes strings."""

from __future__ import annotations

import weakref

import jax.numpy as jnp
import numpy as np

SENTENCE_ENDS = (".", "?", "!", ";", "\u3002", "\uff1f", "\uff01", "\uff1b")  # . ? ! ; 。 ？ ！ ；

_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def is_trigger_text(text: str) -> bool:
    """True for a token text that ends a sentence or clause, or contains a newline."""
    return "\n" in text or text.rstrip().endswith(SENTENCE_ENDS)


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(i))
    return ids


def _token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each id decoded on its own (byte-level BPE pieces such as 'Ġ' and 'Ċ' become ' ' and '\\n')."""
    tokens = tokenizer.convert_ids_to_tokens(ids)
    texts = []
    for i, tok in zip(ids, tokens):
        try:
            text = tokenizer.convert_tokens_to_string([tok]) if tok is not None else None
        except Exception:  # tokenizers without a per-token string path
            text = None
        if text is None:
            text = tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        texts.append(text)
    return texts


def trigger_token_ids(tokenizer) -> np.ndarray:
    """Sorted unique int32 ids of the trigger tokens of a transformers tokenizer.

    Special tokens are never triggers. The result is cached per tokenizer object.
    """
    try:
        return _cache[tokenizer].copy()
    except (KeyError, TypeError):
        pass
    ids = sorted({int(i) for i in tokenizer.get_vocab().values()} - _special_ids(tokenizer))
    texts = _token_texts(tokenizer, ids)
    out = np.asarray([i for i, t in zip(ids, texts) if is_trigger_text(t)], dtype=np.int32)
    try:
        _cache[tokenizer] = out
    except TypeError:
        pass
    return out.copy()


def trigger_mask(trigger_ids, vocab_size: int) -> np.ndarray:
    """Boolean [vocab_size] mask from trigger ids (vocab_size is the model's, which may be
    larger than the tokenizer's); ids outside the vocabulary are dropped."""
    ids = np.asarray(trigger_ids, dtype=np.int64)
    mask = np.zeros((vocab_size,), dtype=bool)
    mask[ids[(ids >= 0) & (ids < vocab_size)]] = True
    return mask


def is_trigger(token_ids, trigger_mask):
    """Device-side lookup: bool array shaped like token_ids; ids outside the mask are False."""
    token_ids = jnp.asarray(token_ids)
    vocab = trigger_mask.shape[0]
    inside = (token_ids >= 0) & (token_ids < vocab)
    return jnp.asarray(trigger_mask)[jnp.clip(token_ids, 0, vocab - 1)] & inside
