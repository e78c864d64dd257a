"""The compiled decode loop updates the KV cache, the compact buffers and the logits scratch in
place: no `copy` of those buffers in the HLO (a copy per step costs more than the step saves;
see docs/DESIGN.md for the layouts that made XLA copy them)."""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
import pytest

from sfi_jax import EngineOptions, SFIConfig
from sfi_jax.models.config import PRESETS
from sfi_jax.models.modeling import split_layers
from sfi_jax.models.params import random_params
from sfi_jax.runtime import decode
from sfi_jax.runtime.sampling import SamplingConfig
from sfi_jax.runtime.state import DecodeState, cache_dtype, empty_sfi_state

# compiling many briefly-run programs is most of this file's time (conftest.py)
pytestmark = pytest.mark.usefixtures("xla_fast_compile")

# The HLO checked here is compiled with XLA:CPU's default fusion emitters, which the rest of the
# suite turns off for its compile time (xla_cpu_flags.py): that setting changes XLA:CPU's pass
# pipeline (e.g. scatters expanded into loops, with more small copies)
XLA_DEFAULT = ({"xla_cpu_use_fusion_emitters": True}
               if "xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "") else None)

CFG = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=3, hidden_size=64,
                          intermediate_size=128, num_q_heads=4, num_kv_heads=2, head_dim=16,
                          vocab_size=300)
B, S, N = 4, 384, 4


def _big_copies(sfi, split: bool, options: EngineOptions = EngineOptions(), cfg=CFG):
    params = random_params(cfg, "float32", 0)
    if split:
        params["layers"] = split_layers(params["layers"], fuse_qkv=True)
    shape = (cfg.num_layers, B, cfg.num_kv_heads, S, cfg.head_dim)
    st = None
    if sfi is not None:
        st = empty_sfi_state(cfg, sfi, B, S, jnp.bfloat16)
    # a bf16 cache as on accelerators (on CPU, bf16 updates inside conditions copied buffers
    # where f32 ones did not)
    state = DecodeState(k=jnp.zeros(shape, jnp.bfloat16), v=jnp.zeros(shape, jnp.bfloat16),
                        lengths=jnp.full((B,), 300, jnp.int32), token=jnp.zeros((B,), jnp.int32),
                        done=jnp.zeros((B,), bool), step=jnp.int32(0),
                        key=jnp.zeros((2,), jnp.uint32), sfi=st)
    mask = jnp.zeros((cfg.vocab_size,), bool)
    forced = jnp.zeros((B, N), jnp.int32)
    text = decode.decode_chunk.lower(params, state, mask, mask, forced, cfg=cfg, sfi=sfi,
                                     sampling=SamplingConfig(), n_steps=N,
                                     options=options.resolved()) \
        .compile(compiler_options=XLA_DEFAULT).as_text()
    dims = [("bf16", shape)]
    if sfi is not None:
        dims.append(("bf16", (cfg.num_layers, B, cfg.num_kv_heads, sfi.compact_size,
                              cfg.head_dim)))
        buf = decode.slow_logits_buffer(cfg, sfi, B, S)
        if buf is not None:
            dims.append(("f32", buf.shape))
    return _copies_of(text, dims)


def _copies_of(text, dims):
    """The `copy` ops in compiled HLO text of arrays of the given (dtype, shape) pairs."""
    wanted = [f"{t}[" + ",".join(map(str, d)) + "]" for t, d in dims]
    return [line.strip()[:120] for line in text.splitlines()
            if re.search(r"= \S+ copy(-start)?\(", line) and any(w in line for w in wanted)]


@pytest.mark.parametrize("split", [False, True], ids=["stacked", "split"])
@pytest.mark.parametrize("sfi", [None, SFIConfig(n_sink=2, k_select=32, n_recent=16, t_max=4,
                                                refresh_rows=2)], ids=["dense", "sfi"])
def test_decode_loop_has_no_big_copies(sfi, split):
    assert _big_copies(sfi, split) == []


def test_cpu_caches_keep_the_token_write_in_place():
    """On a CPU a bfloat16 model's caches are float32 (state.cache_dtype): XLA:CPU turns a
    bfloat16 scatter into a convert of the whole cache and back at every step."""
    assert jax.default_backend() == "cpu"
    assert cache_dtype(jnp.bfloat16) == jnp.float32
    assert cache_dtype(jnp.float16) == jnp.float16 and cache_dtype("float32") == jnp.float32
    params = random_params(CFG, "bfloat16", 0)
    shape = (CFG.num_layers, B, CFG.num_kv_heads, S, CFG.head_dim)
    dtype = cache_dtype(jnp.bfloat16)
    state = DecodeState(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                        lengths=jnp.full((B,), 300, jnp.int32), token=jnp.zeros((B,), jnp.int32),
                        done=jnp.zeros((B,), bool), step=jnp.int32(0),
                        key=jnp.zeros((2,), jnp.uint32), sfi=None)
    mask = jnp.zeros((CFG.vocab_size,), bool)
    text = decode.decode_chunk.lower(params, state, mask, mask, jnp.zeros((B, N), jnp.int32),
                                     cfg=CFG, sfi=None, sampling=SamplingConfig(), n_steps=N,
                                     options=EngineOptions().resolved()) \
        .compile(compiler_options=XLA_DEFAULT).as_text()
    cache = ",".join(map(str, shape)) + "]"
    converts = [line for line in text.splitlines() if " convert(" in line and cache in line]
    assert converts == []


@pytest.mark.parametrize("repack", [pytest.param("xla", marks=pytest.mark.slow), "kernel"])
def test_gpu_kernels_update_in_place(repack):
    """The GPU kernels (interpret mode here) in the loop: the unconditional refresh writes the
    logits into the scratch buffer, the sparse kernel the cache, and the repack kernel the
    compact buffers, through aliased outputs, without copying them. (XLA's repack beside the
    GPU kernels is in the slow suite: the default suite checks it beside XLA's attention,
    test_decode_loop_has_no_big_copies[sfi-split].)"""
    sfi = SFIConfig(n_sink=2, k_select=32, n_recent=16, t_max=4, refresh_rows=2)
    options = EngineOptions(attention="pallas_gpu", repack=repack)
    # two layers (a boundary between layers, where a copy would show) halve the compile of
    # the interpreted kernels
    assert _big_copies(sfi, True, options, dataclasses.replace(CFG, num_layers=2)) == []


def _sub_jaxprs(eqn):
    for p in eqn.params.values():
        for j in (p if isinstance(p, (tuple, list)) else (p,)):
            if isinstance(j, jex_core.ClosedJaxpr):
                yield j.jaxpr
            elif isinstance(j, jex_core.Jaxpr):
                yield j


def _kernels(jaxpr, skip_whiles=False):
    """Names of the Pallas calls in a jaxpr and everything nested in it (not inside while
    loops with skip_whiles)."""
    names = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.add(eqn.params["name"])
        if skip_whiles and eqn.primitive.name == "while":
            continue
        for sub in _sub_jaxprs(eqn):
            names |= _kernels(sub, skip_whiles)
    return names


def _whiles(jaxpr):
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            out.append(eqn)
        else:
            for sub in _sub_jaxprs(eqn):
                out += _whiles(sub)
    return out


def _loop_bodies(options):
    """The decode loop's outer body (a step that may refresh rows) and its fast loop's body,
    as jaxprs, for the tiny model with split weights and `options`."""
    sfi = SFIConfig(n_sink=2, k_select=32, n_recent=16, t_max=4, refresh_rows=2)
    params = random_params(CFG, "float32", 0)
    params["layers"] = split_layers(params["layers"], fuse_qkv=True)
    shape = (CFG.num_layers, B, CFG.num_kv_heads, S, CFG.head_dim)
    state = DecodeState(k=jnp.zeros(shape, jnp.bfloat16), v=jnp.zeros(shape, jnp.bfloat16),
                        lengths=jnp.full((B,), 300, jnp.int32), token=jnp.zeros((B,), jnp.int32),
                        done=jnp.zeros((B,), bool), step=jnp.int32(0),
                        key=jnp.zeros((2,), jnp.uint32),
                        sfi=empty_sfi_state(CFG, sfi, B, S, jnp.bfloat16))
    mask = jnp.zeros((CFG.vocab_size,), bool)
    jaxpr = jax.make_jaxpr(lambda s: decode.decode_chunk(
        params, s, mask, mask, jnp.zeros((B, N), jnp.int32), cfg=CFG, sfi=sfi,
        sampling=SamplingConfig(), n_steps=N, options=options.resolved()))(state).jaxpr
    outer, = [w for w in _whiles(jaxpr) if _whiles(w.params["body_jaxpr"].jaxpr)]
    body = outer.params["body_jaxpr"].jaxpr
    fast, = [w for w in _whiles(body) if "sfi_sparse_decode" in _kernels(
        w.params["body_jaxpr"].jaxpr)]
    return body, fast.params["body_jaxpr"].jaxpr


def test_fast_steps_launch_no_refresh_read():
    """The decode loop is a step that may refresh rows (the refresh slots' dense kernel) and
    then a fast loop whose steps launch only the sparse kernel."""
    body, fast = _loop_bodies(EngineOptions(attention="pallas_gpu"))
    assert {"sfi_sparse_decode", "sfi_dense_decode"} <= _kernels(body, skip_whiles=True)
    assert "sfi_dense_decode" not in _kernels(fast)


def _launches(jaxpr, name):
    """How many Pallas calls named `name` a jaxpr makes (nested ones included)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "pallas_call" and eqn.params["name"] == name
        n += sum(_launches(sub, name) for sub in _sub_jaxprs(eqn))
    return n


@pytest.mark.parametrize("epilogue", ["fused", "xla"])
def test_fused_epilogues_take_the_heads_launch(epilogue):
    """With the fused epilogues (the GPU default for a few rows) a layer of a fast step is
    four matmul launches whose epilogues produce the heads and the residual stream: no heads
    kernel; with epilogue="xla" the heads kernel runs after the q/k/v matmul."""
    _, fast = _loop_bodies(EngineOptions(attention="pallas_gpu", epilogue=epilogue))
    assert _launches(fast, "sfi_skinny_matmul") == 4 * CFG.num_layers
    heads = 0 if epilogue == "fused" else CFG.num_layers
    assert _launches(fast, "sfi_norm_rope_heads") == heads


def _grids(jaxpr, name):
    """The grids of the Pallas calls named `name` in a jaxpr (nested ones included)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call" and eqn.params["name"] == name:
            out.append(tuple(eqn.params["grid_mapping"].grid))
        for sub in _sub_jaxprs(eqn):
            out += _grids(sub, name)
    return out


def test_kernel_tuning_reaches_the_kernels():
    """`EngineOptions.tuning` is how a benchmark sweeps a kernel's config in the decode loop:
    a sparse config aiming at one program per call gives every sparse launch one split, where
    the tuned config splits each (row, KV head) over many programs."""
    from sfi_jax.kernels import attention_gpu
    from sfi_jax.options import KernelTuning

    one = attention_gpu.Config(block_k=16, num_warps=4, num_stages=1, programs=1)
    tuned = EngineOptions(attention="pallas_gpu", epilogue="xla")
    _, fast = _loop_bodies(tuned)
    assert {g[-1] for g in _grids(fast, "sfi_sparse_decode")} != {1}
    _, fast = _loop_bodies(dataclasses.replace(tuned, tuning=KernelTuning(sparse_attention=one)))
    grids = _grids(fast, "sfi_sparse_decode")
    assert len(grids) == CFG.num_layers and {g[-1] for g in grids} == {1}


def _exact_big_copies(sfi: SFIConfig):
    """Copies of the cache or the compact buffers in the compiled exact-mode chunk."""
    from sfi_jax.runtime import exact

    params = random_params(CFG, "float32", 0)
    shape = (CFG.num_layers, B, CFG.num_kv_heads, S, CFG.head_dim)
    state = DecodeState(k=jnp.zeros(shape, jnp.bfloat16), v=jnp.zeros(shape, jnp.bfloat16),
                        lengths=jnp.full((B,), 300, jnp.int32), token=jnp.zeros((B,), jnp.int32),
                        done=jnp.zeros((B,), bool), step=jnp.int32(0),
                        key=jax.random.key(0), sfi=empty_sfi_state(CFG, sfi, B, S, jnp.bfloat16),
                        nonfinite=jnp.zeros((B,), bool))
    counts = exact.initial_counts(B, jnp.full((B,), 40, jnp.int32))
    mask = jnp.zeros((CFG.vocab_size,), bool)
    text = exact.exact_chunk.lower(params, state, counts, mask, mask, cfg=CFG, sfi=sfi,
                                   sampling=SamplingConfig(), n_rounds=2,
                                   options=EngineOptions().resolved()) \
        .compile(compiler_options=XLA_DEFAULT).as_text()
    return _copies_of(text, [("bf16", shape), ("bf16", (CFG.num_layers, B, CFG.num_kv_heads,
                                                        sfi.compact_size, CFG.head_dim))])


@pytest.mark.parametrize("draft_len", [3, 7])
def test_exact_rounds_have_no_big_copies(draft_len):
    """Exact mode's rounds (drafts, the verify, the refresh) update the cache and the compact
    buffers in place."""
    sfi = SFIConfig(n_sink=2, k_select=32, n_recent=16, t_max=4, refresh_rows=2,
                    draft_len=draft_len)
    assert _exact_big_copies(sfi) == []
