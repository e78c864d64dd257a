"""`generate`'s argument checks: each bad value is one clear ValueError before any device
work (prefill is replaced by a trap), and the values that are fine (numpy integers) pass."""

from __future__ import annotations

import numpy as np
import pytest

import sfi_jax
from sfi_jax.models.config import ModelConfig
from sfi_jax.models.modeling import Model
from sfi_jax.models.params import random_params
from sfi_jax.runtime import generation

# the tiny model's programs compile with XLA's slower optimisations off (conftest.py)
pytestmark = pytest.mark.usefixtures("xla_fast_compile")

CFG = ModelConfig(name="tiny", num_layers=1, hidden_size=32, intermediate_size=64,
                  num_q_heads=2, num_kv_heads=1, head_dim=16, vocab_size=50,
                  max_position_embeddings=128, qk_norm=False, eos_token_ids=(1,))


@pytest.fixture(scope="module")
def model():
    return Model(CFG, random_params(CFG, "float32"))


@pytest.fixture()
def no_work(monkeypatch):
    def trap(*a, **k):
        raise AssertionError("device work started before the arguments were checked")

    monkeypatch.setattr(generation, "_allocate", trap)


@pytest.mark.parametrize("kw,expected", [
    (dict(prompts=123), "prompts must be a string, a list of strings or a list of token id "
                        "lists, got int 123"),
    (dict(prompts=None), "prompts must be a string, .* got NoneType None"),
    (dict(prompts=[[1, 2], 7]), "prompt 1 must be a string or a list of token ids, got int 7"),
    (dict(prompts=[[1, True, 3]]), "prompt 0 has token id True, which is not an integer"),
    (dict(prompts=[True, 2]), "prompts must be .* got|prompt 0 must be a string"),
    (dict(prompts=[[1, 2.0]]), "prompt 0 has token id 2.0, which is not an integer"),
    (dict(chunk_steps=2.5), r"chunk_steps must be an integer >= 1, got 2.5"),
    (dict(chunk_steps=True), r"chunk_steps must be an integer >= 1, got True"),
    (dict(chunk_steps=0), r"chunk_steps must be an integer >= 1, got 0"),
    (dict(max_new_tokens=True), r"max_new_tokens must be an integer >= 1, got True"),
    (dict(max_new_tokens=2.0), r"max_new_tokens must be an integer >= 1, got 2.0"),
    (dict(temperature=float("inf")), r"temperature must be a finite number, got inf"),
    (dict(temperature=float("nan")), r"temperature must be a finite number, got nan"),
    (dict(top_p=float("nan")), r"top_p must be a finite number, got nan"),
    (dict(top_k=51, temperature=1.0), r"top_k must be an integer in \[0, 50\] \(the vocabulary "
                                      r"size; 0 = off\), got 51"),
    (dict(top_k=2.5, temperature=1.0), r"top_k must be an integer in \[0, 50\]"),
    (dict(top_k=-1), r"top_k must be an integer in \[0, 50\]"),
])
def test_bad_arguments_before_any_work(model, no_work, kw, expected):
    args = dict(prompts=[[3, 4, 5]], max_new_tokens=2, mode="dense")
    args.update(kw)
    with pytest.raises(ValueError, match=expected):
        sfi_jax.generate(model, args.pop("prompts"), **args)


def test_numpy_integers_are_accepted(model):
    """np.int64 as max_new_tokens, chunk_steps and token ids: the same tokens as Python ints
    (greedy dense decoding, which EOS cannot stop early here)."""
    ref = sfi_jax.generate(model, [[3, 4, 5]], max_new_tokens=3, mode="dense", chunk_steps=2,
                           stop_at_eos=False)
    got = sfi_jax.generate(model, np.array([[3, 4, 5]], np.int64), max_new_tokens=np.int64(3),
                           mode="dense", chunk_steps=np.int32(2), stop_at_eos=False)
    assert got.tokens == ref.tokens and len(ref.tokens[0]) == 3


def test_k_select_beyond_the_context_is_capped(model):
    """A budget larger than the cache selects nothing more: the state is sized by the cache,
    and the tokens are those of k_select = the cache length."""
    prompt = [[3, 4, 5, 6, 7, 8, 9, 10]]
    huge = sfi_jax.generate(model, prompt, max_new_tokens=4, mode="sfi",
                            sfi=sfi_jax.SFIConfig(k_select=10 ** 6, n_recent=2, n_sink=1))
    S = huge.stats["max_len"]
    fit = sfi_jax.generate(model, prompt, max_new_tokens=4, mode="sfi",
                           sfi=sfi_jax.SFIConfig(k_select=S, n_recent=2, n_sink=1))
    assert huge.tokens == fit.tokens
    assert huge.stats["memory_bytes"] == fit.stats["memory_bytes"]
    assert sfi_jax.SFIConfig(k_select=10 ** 6).capped(S).k_select == S
    engine = sfi_jax.Engine(model, mode="sfi", sfi=sfi_jax.SFIConfig(k_select=10 ** 6),
                            max_slots=1, max_len=64)
    assert engine.sfi.k_select == 64
