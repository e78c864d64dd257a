"""The prefill in generate(): first-token logits against `forward` and transformers across
chunk and bucket edges, ragged batches, GQA groups and head dims; the initial selection from
the prefill's own window queries against an independent computation; no compile for a new
prompt length in the same bucket; decode after a kernel prefill; the progress hook; bad input."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfi_jax
from conftest import hf_logits, make_hf_checkpoint, rel_err
from sfi_jax.models.modeling import (STACKED, attention_inputs, attention_output_and_mlp,
                                     embed_tokens, grouped_attention, run_layers)
from sfi_jax.kernels import common
from sfi_jax.options import EngineOptions
from sfi_jax.runtime import generation, prefill, programs
from sfi_reference import assert_positions, sfi_reference

# the tiny models' programs: compiling them is most of this file's time (conftest.py)
pytestmark = pytest.mark.usefixtures("xla_fast_compile")

ONE = dict(max_new_tokens=1, mode="dense", return_logits=True, stop_at_eos=False)


def _prompts(lengths, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def gqa_models(tmp_path_factory):
    """Tiny Qwen3 checkpoints: (query heads, KV heads, head dim) -> .hf, .model."""
    out = {}
    for hq, hkv, d in ((4, 4, 64), (8, 2, 128), (8, 1, 64), (4, 2, 128)):
        hf, path = make_hf_checkpoint(tmp_path_factory.mktemp(f"q{hq}k{hkv}d{d}"), "qwen3",
                                      seed=hq + d, num_attention_heads=hq,
                                      num_key_value_heads=hkv, head_dim=d)
        out[(hq, hkv, d)] = types.SimpleNamespace(
            hf=hf, model=sfi_jax.load_model(path, dtype="float32"))
    return out


@pytest.mark.parametrize("hopper", [False, True])
def test_prefill_attention_choice(hopper, monkeypatch):
    """On a GPU: the Mosaic GPU kernel on a Hopper, else "cudnn", where each takes the inputs;
    then cuDNN, then the Triton kernel; "xla" on a mesh."""
    monkeypatch.setattr(common, "hopper", lambda: hopper)
    gpu = EngineOptions().resolved(platform="gpu")
    assert gpu.prefill_attention == ("mosaic_gpu" if hopper else "cudnn")
    assert EngineOptions().resolved(platform="tpu").prefill_attention == "pallas_tpu"
    assert EngineOptions().resolved(platform="cpu").prefill_attention == "xla"
    on_gpu = jax.default_backend() == "gpu"
    cudnn = "cudnn" if on_gpu else "pallas_gpu"  # the cuDNN choice off a GPU: the Triton kernel
    assert prefill.attention_impl(gpu, jnp.bfloat16, 128, 4, 4096) == \
        ("mosaic_gpu" if hopper else cudnn)
    assert prefill.attention_impl(gpu, jnp.float32, 128) == "pallas_gpu"
    assert prefill.attention_impl(gpu, jnp.bfloat16, 256) == \
        ("mosaic_gpu" if hopper else "pallas_gpu")  # cuDNN takes D <= 128
    on_mesh = EngineOptions().resolved(platform="gpu", mesh=object())
    assert prefill.attention_impl(on_mesh, jnp.bfloat16, 128) == "xla"
    mosaic = EngineOptions(prefill_attention="mosaic_gpu").resolved(platform="gpu")
    assert prefill.attention_impl(mosaic, jnp.bfloat16, 128, 4, 4096) == "mosaic_gpu"
    assert prefill.attention_impl(mosaic, jnp.float32, 128, 4, 4096) == "pallas_gpu"
    assert prefill.attention_impl(mosaic, jnp.bfloat16, 96, 4, 4096) == cudnn
    assert prefill.attention_impl(mosaic, jnp.bfloat16, 128, 3, 4096) == cudnn  # 64 % 3


def test_mosaic_gpu_prefill_in_generate(tmp_path, monkeypatch):
    """prefill_attention="mosaic_gpu" runs its kernel (interpret mode off a GPU) for every
    chunk of a bfloat16 model and gives the XLA prefill's first-token logits, across a chunk
    edge and ragged rows. (A CPU keeps bfloat16 caches in float32, which the kernel does not
    take: here the cache stays bfloat16.)"""
    from sfi_jax.kernels import prefill_attention_mgpu
    from sfi_jax.runtime import engine

    for module in (generation, engine):
        monkeypatch.setattr(module, "cache_dtype", jnp.dtype)
    # the one-warpgroup layout: the warp-specialised default's three simulated warpgroups
    # stalled, waiting on each other, in interpret mode inside the engine's compiled program
    # on a 2-core CPU (alone, the same call passes). tests/kernels covers both layouts in
    # interpret mode; test_gpu_engine compiles the default inside the engine.
    monkeypatch.setattr(prefill_attention_mgpu, "DEFAULT",
                        prefill_attention_mgpu.Config(block_k=128, stages=2, warpgroups=1))
    calls = []
    kernel = prefill_attention_mgpu.prefill_attention
    monkeypatch.setattr(prefill_attention_mgpu, "prefill_attention",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))
    _, d = make_hf_checkpoint(tmp_path, "qwen3", seed=11, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=64)
    model = sfi_jax.load_model(d, dtype="bfloat16")
    prompts = _prompts([30, 64, 100], seed=12)
    ref = sfi_jax.generate(model, prompts, prefill_chunk=64,
                           options=EngineOptions(prefill_attention="xla"), **ONE)
    assert not calls
    got = sfi_jax.generate(model, prompts, prefill_chunk=64,
                           options=EngineOptions(prefill_attention="mosaic_gpu"), **ONE)
    assert calls and got.stats["prefill_chunks"] == 2
    for i in range(len(prompts)):
        assert rel_err(got.stats["logits"][i, 0], ref.stats["logits"][i, 0]) < 2e-2, f"row {i}"


def test_buckets():
    assert [prefill.bucket(n) for n in (1, 256, 257, 8191, 8192, 8193, 20000)] == \
        [256, 256, 512, 8192, 8192, 16384, 24576]
    assert [prefill.bucket(n, 16) for n in (1, 16, 17, 33)] == [16, 16, 32, 48]
    assert [prefill.bucket(n, 1024) for n in (100, 300, 1024, 1025)] == [256, 512, 1024, 2048]
    assert prefill.prefill_chunk_size(512, 8192) == 512
    assert prefill.prefill_chunk_size(16384, 8192) == 8192
    for bad in (0, 12, 100, 2.0, True):
        with pytest.raises(ValueError, match="prefill_chunk"):
            prefill.check_max_chunk(bad)


@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 128), (8, 1, 64), (4, 2, 128)],
                         ids=lambda h: f"G{h[0] // h[1]}-D{h[2]}")
def test_first_token_logits_equal_forward_and_transformers(gqa_models, heads):
    """A ragged batch whose rows end before, at and after chunk edges (16-token chunks: 1 to 4
    chunks) gives each row's forward / transformers last-position logits."""
    m = gqa_models[heads]
    prompts = _prompts([5, 16, 17, 47], seed=sum(heads))
    res = sfi_jax.generate(m.model, prompts, prefill_chunk=16, **ONE)
    assert res.stats["prefill_chunks"] == 3 and res.stats["padded_prompt"] == 48
    got = res.stats["logits"][:, 0]
    for i, p in enumerate(prompts):
        ours = np.asarray(sfi_jax.forward(m.model, [p]))[0, -1]
        assert rel_err(got[i], ours) < 1e-5, f"row {i} vs forward"
        assert rel_err(got[i], hf_logits(m.hf, [p])[0, -1]) < 1e-4, f"row {i} vs transformers"


def test_bucket_edges_one_chunk_and_many(tiny_qwen3):
    """Prompts at and around the 256-position bucket edge, one chunk (default size) and
    chunks of 64: the same logits, equal to transformers'."""
    prompts = _prompts([255, 256, 257], seed=3)
    whole = sfi_jax.generate(tiny_qwen3.model, prompts, **ONE)
    assert whole.stats["prefill_chunks"] == 1 and whole.stats["padded_prompt"] == 512
    chunked = sfi_jax.generate(tiny_qwen3.model, prompts, prefill_chunk=64, **ONE)
    assert chunked.stats["prefill_chunks"] == 5  # 320 = bucket(257, 64)
    for i, p in enumerate(prompts):
        ref = hf_logits(tiny_qwen3.hf, [p])[0, -1]
        assert rel_err(whole.stats["logits"][i, 0], ref) < 1e-4
        assert rel_err(chunked.stats["logits"][i, 0], ref) < 1e-4


@functools.partial(jax.jit, static_argnums=(1,))
def _plain_layers(params, cfg, tokens):
    """Each layer's post-RoPE q [L, B, T, Hq, D] and k, v [L, B, T, Hkv, D] by a plain causal
    forward over whole prompts (no cache, no chunks, no prefill kernels)."""
    B, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))

    def layer(x, xs):
        w, _ = xs
        q, k, v = attention_inputs(w, cfg, x, pos)
        return attention_output_and_mlp(w, cfg, x, grouped_attention(q, k, v, causal)), (q, k, v)

    _, qkv = run_layers(layer, embed_tokens(params, tokens), params["layers"], STACKED,
                        cfg.num_layers)
    return qkv


def test_initial_selection_from_prefill_queries(tiny_qwen3):
    """The selection decode starts from (policy prefill_only keeps it) equals the float64
    selector of SFI_METHOD.md §4 on transformers' queries and keys (tests/sfi_reference.py),
    for windows inside one chunk, straddling chunks, and longer than the prompt."""
    sfi = sfi_jax.SFIConfig.paper(n_sink=2, n_recent=8, k_select=12, policy="prefill_only")
    prompts = _prompts([9, 20, 40, 64], seed=4, vocab=250)
    res = sfi_jax.generate(tiny_qwen3.model, prompts, max_new_tokens=1, sfi=sfi,
                           diagnostics=True, stop_at_eos=False, prefill_chunk=16,
                           return_logits=True)
    got = res.stats["selected_positions"]  # [L, B, Hkv, C]
    for i, p in enumerate(prompts):
        ref = sfi_reference(tiny_qwen3.hf, p, len(p), sfi)
        assert rel_err(res.stats["logits"][i], ref.logits) < 1e-4
        for l, want in enumerate(ref.initial):
            assert_positions(got[l, i], want, len(p), sfi, what=f"row {i} layer {l}")
    assert (got[:, 3] >= 0).sum() == got.shape[0] * got.shape[2] * (2 + 12)
    assert (got[:, 0] >= 0).sum() == got.shape[0] * got.shape[2] * 2  # J is empty


def test_window_queries_kept_across_chunks(tiny_qwen3):
    """The carry's window queries equal a plain forward's queries at the last W positions,
    for rows whose window lies in one chunk or straddles two."""
    model = tiny_qwen3.model
    W = 16
    prompts = _prompts([7, 24, 33], seed=8)
    run = generation._validate(
        model, prompts, max_new_tokens=1, mode="sfi", sfi=sfi_jax.SFIConfig(prefill_window=W),
        temperature=0.0, top_p=1.0, top_k=0, tokenizer=None, chunk_steps=8, options=None,
        impl=None, forced_tokens=None, trigger_ids=None, max_len=None, diagnostics=True,
        mesh=None, prefill_chunk=16)  # (diagnostics: the SFI path, though the rows fit)
    k, v, st = generation._allocate(run, model.dtype)
    pre = generation._prefill(run, k, v, st, model.dtype)
    wq = np.asarray(pre.carry.window_q)  # [L, B, W, Hq, D]
    for i, p in enumerate(prompts):
        want = np.asarray(_plain_layers(model.params, model.config, jnp.asarray([p]))[0])
        want = want[:, 0, -W:]
        n = want.shape[1]
        np.testing.assert_allclose(wq[:, i, W - n:], want, rtol=1e-5, atol=1e-5)
        assert not wq[:, i, :W - n].any()


def test_new_prompt_length_in_the_bucket_compiles_nothing(tiny_qwen3):
    """A second prompt of another length in the same bucket (and batch) compiles no program:
    not the prefill chunk, the selection, the first-token logits, the decode loop, nor any
    small op (counted by JAX's compile events)."""
    model = tiny_qwen3.model
    # t_max 5: a decode program of this test's own, so that the first run compiles
    sfi = sfi_jax.SFIConfig(n_sink=2, n_recent=8, k_select=8, t_max=5)
    kw = dict(max_new_tokens=8, sfi=sfi, stop_at_eos=False)
    compiles = []

    def listen(name, seconds, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first = sfi_jax.generate(model, _prompts([100, 37], seed=1), **kw)
        n_first = len(compiles)
        held = sorted(map(repr, programs.programs()))
        second = sfi_jax.generate(model, _prompts([150, 201], seed=2), **kw)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert first.stats["padded_prompt"] == 256 and first.stats["max_len"] == 256
    # the events and the stats see the first run's compiles
    assert n_first > 0 and first.stats["decode_compile_s"] > 0
    assert first.stats["compile_s"] >= first.stats["decode_compile_s"]
    assert compiles[n_first:] == []
    assert sorted(map(repr, programs.programs())) == held  # (a hit reorders the cache)
    assert second.stats["prefill_compile_s"] == 0.0 and second.stats["decode_compile_s"] < 0.5
    assert second.stats["ttft_s"] <= second.stats["ttft_with_compile_s"]
    for key in ("ttft_s", "ttft_with_compile_s", "prefill_tokens_per_s", "compile_s"):
        assert np.isfinite(second.stats[key]) and second.stats[key] >= 0, key


KERNEL_SFI = dict(max_new_tokens=6, stop_at_eos=False, return_logits=True, prefill_chunk=16,
                  sfi=sfi_jax.SFIConfig(n_sink=2, n_recent=8, k_select=8, t_max=4))
KERNEL_PROMPTS = _prompts([23, 40], seed=6, vocab=250)


@pytest.fixture(scope="module")
def xla_prefill_run(tiny_qwen3):
    return sfi_jax.generate(tiny_qwen3.model, KERNEL_PROMPTS, **KERNEL_SFI,
                            options=EngineOptions(prefill_attention="xla"))


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_decode_after_kernel_prefill(tiny_qwen3, xla_prefill_run, impl, xla_fast_compile):
    """SFI decode after a Pallas prefill (interpret mode) gives the xla prefill's tokens."""
    got = sfi_jax.generate(tiny_qwen3.model, KERNEL_PROMPTS, **KERNEL_SFI,
                           options=EngineOptions(prefill_attention=impl))
    assert got.tokens == xla_prefill_run.tokens
    assert rel_err(got.stats["logits"], xla_prefill_run.stats["logits"]) < 1e-4


def test_progress_hook(tiny_qwen3):
    calls = []
    sfi_jax.generate(tiny_qwen3.model, _prompts([40, 10], seed=9), prefill_chunk=16,
                     progress=lambda *a: calls.append(a), **ONE)
    assert calls == [(1, 3, 26), (2, 3, 42), (3, 3, 50)]


def test_bad_prefill_input(tiny_qwen3, monkeypatch):
    model = tiny_qwen3.model
    with pytest.raises(ValueError, match=r"prefill_chunk=100.*power of two"):
        sfi_jax.generate(model, [[1, 2, 3]], max_new_tokens=2, prefill_chunk=100)
    with pytest.raises(ValueError, match="prefill_attention='flash'"):
        EngineOptions(prefill_attention="flash")
    with pytest.raises(ValueError, match=r"max_len 20 .* 23"):
        sfi_jax.generate(model, [[1] * 20], max_new_tokens=3, max_len=20)
    with pytest.raises(ValueError, match=r"511.*2.*513.*512"):  # nothing truncated
        sfi_jax.generate(model, [[1] * 511], max_new_tokens=2)
    # the cache fits, the prefill's activations do not: both named, before any device work
    cfg = model.config
    kv = sum(generation.state_bytes(cfg, 1, 512, 4, None).values())
    monkeypatch.setattr(generation, "_available_device_bytes", lambda *a, **k: kv + 1000)
    monkeypatch.setattr(prefill, "prefill_chunk", None)  # a device call would fail
    with pytest.raises(MemoryError, match=r"KV cache.*activations.*chunks of 256 tokens"):
        sfi_jax.generate(model, [[1] * 300], max_new_tokens=2, mode="dense")


def test_activation_estimate_grows_with_the_chunk():
    from sfi_jax.models.config import PRESETS

    c = PRESETS["qwen3-4b"]
    a = sum(prefill.activation_bytes(c, 1, 8192, 16384, 2).values())
    b = sum(prefill.activation_bytes(c, 1, 4096, 16384, 2).values())
    assert 1.8 < a / b < 2.0  # linear in the chunk, plus the last position's logits
    w = prefill.activation_bytes(c, 4, 8192, 131072, 2, window=16)
    assert w["prefill_selection_logits"] == 3 * 4 * 32 * 16 * 131072 * 4
    # gate, up and their product in bf16, and one float32 matmul result
    assert w["prefill_mlp"] == 4 * 8192 * c.intermediate_size * 10


def test_cli_prefill_bar(capsys):
    """The CLI's bar appears for a prefill of several chunks only, with a token rate."""
    from sfi_jax.cli import _PrefillBar

    one = _PrefillBar(enabled=True)
    one(1, 1, 300)
    assert one.bar is None
    bar = _PrefillBar(enabled=True)
    for done in (1, 2, 3):
        bar(done, 3, 4096 * done)
    assert bar.bar.n == 3
    bar.close()
    err = capsys.readouterr().err
    assert "prefill" in err and "3/3" in err and "tokens/s" in err
