"""`generate`: the host side of decoding. Validates input, prefills, then runs jitted chunks of
decode steps, streaming tokens between chunks and stopping when every row has ended."""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sfi_jax.config import SFIConfig
from sfi_jax.options import EngineOptions
from sfi_jax.models.modeling import Model, output_logits, unfuse_qkv_weights
from sfi_jax.runtime import engine, sharding
from sfi_jax.runtime.sampling import SamplingConfig, sample
from sfi_jax.runtime.state import DecodeState, empty_cache, empty_sfi_state, state_bytes


@dataclasses.dataclass
class GenerateResult:
    """tokens: generated ids per prompt (EOS included when hit); text: decoded, when a
    tokenizer is known; stats: timings and per-sequence slow/fast step counts."""

    tokens: list[list[int]]
    text: list[str] | None
    stats: dict


def _round_up(n, m):
    return (n + m - 1) // m * m


def _available_device_bytes(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if device.platform == "cpu":
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


def _memory_fraction_hint(device) -> str:
    """On GPU, JAX takes XLA_PYTHON_CLIENT_MEM_FRACTION of the memory (0.75 unless set)."""
    if device.platform != "gpu":
        return ""
    frac = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75 (the default)")
    return (f", or give JAX more of the GPU: XLA_PYTHON_CLIENT_MEM_FRACTION is {frac}; set it "
            "(e.g. to 0.94) before jax is imported")


def _tokenize(prompts, tokenizer) -> list[list[int]]:
    if hasattr(prompts, "tolist"):  # numpy / jax arrays: [T] one prompt, [B, T] a batch
        prompts = prompts.tolist()
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
        prompts = [prompts]
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("string prompts need a tokenizer: pass tokenizer=load_tokenizer(...)"
                                 " or token id lists")
            ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        else:
            ids = []
            for t in p:
                try:
                    ids.append(operator.index(t))
                except TypeError:
                    raise ValueError(f"prompt {i} has token id {t!r}, which is not an "
                                     "integer") from None
        if not ids:
            raise ValueError(f"prompt {i} is empty (no tokens)")
        out.append(ids)
    return out


_COMPILED: dict = {}


def _compiled_decode(args, statics):
    """Ahead-of-time compiled decode chunk, cached, so compile time stays out of decode_s."""
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "sharding", None)), args)
    key = (jax.tree.structure(args), tuple(jax.tree.leaves(shapes)), tuple(sorted(statics.items())))
    if key not in _COMPILED:
        if len(_COMPILED) > 32:
            _COMPILED.clear()
        _COMPILED[key] = engine.decode_chunk.lower(*args, **statics).compile()
    return _COMPILED[key]


def decode_programs() -> dict:
    """The compiled decode programs held now: {cache key: its static arguments (cfg, sfi,
    options, ...)}, for tests and reports (which engine options were compiled)."""
    return {key: dict(key[2]) for key in _COMPILED}


def trigger_mask_for(tokenizer, vocab_size: int) -> np.ndarray:
    from sfi_jax.selector import trigger_token_ids

    mask = np.zeros((vocab_size,), bool)
    if tokenizer is not None:
        ids = trigger_token_ids(tokenizer)
        mask[ids[ids < vocab_size]] = True
    return mask


def _on_own_mesh(fn):
    """Run generate under the mesh it uses (Auto axes) or none, whatever mesh the caller has
    set with jax.set_mesh: an outer Explicit-axes context would clash with our shardings."""

    @functools.wraps(fn)
    def wrapper(model, *args, mesh=None, **kw):
        mesh = sharding.make_mesh(mesh) if mesh is not None else sharding.mesh_of(model.params)
        with jax.set_mesh(mesh):
            return fn(model, *args, mesh=mesh, **kw)

    return wrapper


@_on_own_mesh
def generate(model: Model, prompts, *, max_new_tokens: int, mode: str = "sfi",
             sfi: SFIConfig | None = None, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int = 0, stop_at_eos: bool = True, tokenizer=None,
             chunk_steps: int = 32, options: EngineOptions | None = None,
             impl: str | None = None, trigger_ids=None,
             on_tokens: Callable[[list[list[int]]], None] | None = None,
             forced_tokens=None, return_logits: bool = False, max_len: int | None = None,
             diagnostics: bool = False, mesh=None) -> GenerateResult:
    """Generate up to max_new_tokens per prompt; mode "sfi" (default) or "dense".

    prompts: strings (needs tokenizer) or lists of token ids, of different lengths. The first
    new token comes from the prefill logits; each further token is one decode step.
    trigger_ids: override the trigger-token set (default: from the tokenizer; none without one).
    forced_tokens: [B, max_new_tokens] ids fed instead of sampled ones (teacher forcing; -1 =
    sample). on_tokens(list of new ids per row) is called after each chunk, for streaming.
    diagnostics (SFI mode): stats["selected_positions"] [L, B, Hkv, C] (the selection in force
    at the end), stats["coverage"] [B, steps, L, Hkv], the share of the dense
    attention mass that each step's attended set covers, and stats["support_jaccard"], the
    overlap of the dense top-k_select support with the previous step's (slow: for evaluation).
    mesh: a device mesh (or 'DxM' spec) to run on; default: the mesh the model's parameters
    are sharded over (`load_model(..., mesh=...)`), or one device when they are not.
    options: how the engine runs (`EngineOptions`; default: the platform's defaults).
    impl: a shortcut for options.attention (kept for old callers).
    """
    cfg = model.config
    options = EngineOptions() if options is None else options
    if not isinstance(options, EngineOptions):
        raise ValueError(f"options must be an EngineOptions, got {type(options).__name__}")
    if impl is not None:
        options = dataclasses.replace(options, attention=impl)
    options = options.resolved()
    if mode not in ("sfi", "dense"):
        raise ValueError(f"mode must be 'sfi' or 'dense', got {mode!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if diagnostics and mode != "sfi":
        raise ValueError("diagnostics=True needs mode='sfi' (use a budget >= the context for a "
                         "dense reference)")
    if chunk_steps < 1:
        raise ValueError(f"chunk_steps must be >= 1, got {chunk_steps}")
    sampling = SamplingConfig(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k))
    if mode == "sfi":
        sfi = sfi if sfi is not None else SFIConfig()
        if not isinstance(sfi, SFIConfig):
            raise ValueError(f"sfi must be an SFIConfig, got {type(sfi).__name__}")
    else:
        sfi = None
    ids = _tokenize(prompts, tokenizer)
    B = len(ids)
    lens = np.array([len(p) for p in ids], np.int32)
    for i, p in enumerate(ids):
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary "
                             f"[0, {cfg.vocab_size})")
    need = int(lens.max()) + max_new_tokens
    if need > cfg.max_position_embeddings:
        raise ValueError(f"longest prompt ({int(lens.max())} tokens) + max_new_tokens "
                         f"({max_new_tokens}) = {need} exceeds the model's context "
                         f"({cfg.max_position_embeddings})")
    S = max_len or min(_round_up(need, 128), cfg.max_position_embeddings)
    chunk = engine.prefill_chunk_size(cfg, B, S, int(lens.max()))
    T = _round_up(int(lens.max()), chunk)
    if max_len is None:
        S = max(S, T)  # the last prefill chunk writes whole chunks into the cache
    if S < max(need, T):
        raise ValueError(f"max_len {S} is shorter than prompt + max_new_tokens = {need} (or "
                         f"the padded prompt, {T})")
    dtype = model.dtype
    params = model.params
    mesh = sharding.make_mesh(mesh) if mesh is not None else sharding.mesh_of(params)
    plan = sharding.plan_for(cfg, mesh, B)
    if plan is not None and sharding.mesh_of(params) != plan.mesh:
        if isinstance(params["layers"], list) and "wqkv" in params["layers"][0]:
            # per-head shardings need q, k, v apart: split each layer's fused weight on the mesh
            rep = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())
            params["layers"] = [unfuse_qkv_weights(jax.device_put(w, rep), cfg)
                                for w in params["layers"]]
        params = jax.device_put(params, sharding.param_shardings(
            cfg, plan.mesh, split_layers=isinstance(params["layers"], list)))
    if plan is not None and sfi is not None and sfi.evidence_window > 1:
        raise ValueError(f"SFIConfig.evidence_window={sfi.evidence_window} is supported on a "
                         "single device only; use evidence_window=1 on a mesh")
    sizes = state_bytes(cfg, B, S, jnp.dtype(dtype).itemsize, sfi)
    split = plan.shard_factor if plan is not None else 1
    device = jax.local_devices()[0] if plan is None else \
        next(d for d in plan.mesh.devices.flat if d.process_index == jax.process_index())
    avail = _available_device_bytes(device)
    if avail is not None and sum(sizes.values()) / split > avail:
        raise MemoryError(f"KV cache + SFI state need {sum(sizes.values()) / split / 2**30:.2f} "
                          f"GiB per device ({B} rows x {S} positions, split {split} ways) but the "
                          f"device has {avail / 2**30:.2f} GiB free; reduce the batch, the prompt "
                          "length or max_new_tokens" + _memory_fraction_hint(device))
    if forced_tokens is not None:
        forced_tokens = np.asarray(forced_tokens, np.int32)
        if forced_tokens.shape != (B, max_new_tokens):
            raise ValueError(f"forced_tokens must have shape {(B, max_new_tokens)}, "
                             f"got {forced_tokens.shape}")
    if trigger_ids is not None:
        trigger_ids = np.asarray(trigger_ids, np.int64).reshape(-1)
        bad = trigger_ids[(trigger_ids < 0) | (trigger_ids >= cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"trigger id {int(bad[0])} is outside the vocabulary "
                             f"[0, {cfg.vocab_size})")

    # host inputs: replicated over the mesh (every process passes the same values)
    put = jnp.asarray if plan is None else (lambda a: jax.device_put(np.asarray(a), plan.replicated))
    t0 = time.perf_counter()
    tokens = np.zeros((B, T), np.int32)
    for i, p in enumerate(ids):
        tokens[i, :len(p)] = p
    if plan is None:
        k, v = empty_cache(cfg, B, S, dtype)
        sfi_state = empty_sfi_state(cfg, sfi, B, S, dtype) if sfi is not None else None
    else:  # created in place, each device holding only its rows and heads
        k, v = sharding.place(lambda: empty_cache(cfg, B, S, dtype),
                              (sharding.cache_sharding(plan),) * 2)
        sfi_state = sharding.place(lambda: empty_sfi_state(cfg, sfi, B, S, dtype),
                                   sharding.sfi_state_shardings(plan)) if sfi is not None else None
    key_norms = sfi_state.key_norms if sfi is not None else put(np.zeros((0,), np.float32))
    last_hidden = put(np.zeros((B, cfg.hidden_size), jnp.dtype(dtype)))
    lengths = put(lens)
    for start in range(0, T, chunk):
        k, v, key_norms, last_hidden = engine.prefill_chunk(
            params, k, v, key_norms, put(tokens[:, start:start + chunk]),
            put(np.int32(start)), lengths, last_hidden, cfg=cfg, with_norms=sfi is not None,
            plan=plan)
    if sfi is not None:
        sfi_state = sfi_state._replace(key_norms=key_norms)
        if sfi.policy == "streaming":
            sfi_state = engine.sink_only_selection(sfi_state, k, v, lengths, cfg=cfg, sfi=sfi,
                                                   plan=plan)
        else:
            W = sfi.prefill_window
            win = np.zeros((B, W), np.int32)
            for i, p in enumerate(ids):
                tail = p[-W:]
                win[i, W - len(tail):] = tail
            sfi_state = engine.prefill_selection(params, sfi_state, k, v, put(win),
                                                 lengths, cfg=cfg, sfi=sfi, options=options,
                                                 plan=plan)
    first_logits = output_logits(params, cfg, last_hidden[:, None])[:, 0]
    if plan is not None:  # readable by the host on every process
        first_logits = jax.device_put(first_logits, plan.replicated)
    if not bool(jnp.all(jnp.isfinite(first_logits))):
        raise FloatingPointError("prefill produced non-finite logits (NaN/inf); check the "
                                 "checkpoint and dtype")
    key = jax.random.key(seed) if plan is None else \
        sharding.place(lambda: jax.random.key(seed), plan.replicated)
    key, sub = jax.random.split(key)
    first = sample(first_logits, sub, sampling)
    if forced_tokens is not None:
        first = jnp.where(forced_tokens[:, 0] >= 0, forced_tokens[:, 0], first)
    first = np.asarray(jax.block_until_ready(first))
    prefill_s = time.perf_counter() - t0

    eos_ids = [t for t in cfg.eos_token_ids if t is not None]
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos_ids.append(tokenizer.eos_token_id)
    eos_mask = np.zeros((cfg.vocab_size,), bool)
    if stop_at_eos:
        eos_mask[[t for t in eos_ids if 0 <= t < cfg.vocab_size]] = True
    if trigger_ids is not None:
        trig = np.zeros((cfg.vocab_size,), bool)
        trig[trigger_ids] = True
    else:
        trig = trigger_mask_for(tokenizer, cfg.vocab_size) if sfi is not None else \
            np.zeros((cfg.vocab_size,), bool)

    generated = [[int(t)] for t in first]
    done = eos_mask[first]
    logits_out = [np.asarray(first_logits)[:, None]] if return_logits else None
    slow_flags, diag_parts = [], []
    if on_tokens:
        on_tokens([[int(t)] for t in first])
    state = DecodeState(k=k, v=v, lengths=lengths, token=put(first), done=put(done),
                        step=put(np.int32(0)), key=key, sfi=sfi_state,
                        diag=jnp.zeros((cfg.num_layers, B, cfg.num_kv_heads, S), bool)
                        if diagnostics else None,
                        q_hist=jnp.zeros((cfg.num_layers, B, cfg.num_q_heads,
                                          sfi.evidence_window, cfg.head_dim), dtype)
                        if sfi is not None and sfi.evidence_window > 1 else None)
    if plan is not None:
        state = jax.device_put(state, sharding.decode_state_shardings(plan, state))
    eos_j, trig_j = put(eos_mask), put(trig)
    remaining = max_new_tokens - 1
    decode_s, steps_taken, compile_s = 0.0, 0, 0.0
    t1 = time.perf_counter()
    while remaining > 0 and not bool(np.all(done)):
        n = min(chunk_steps, remaining) if remaining < chunk_steps else chunk_steps
        forced = np.full((B, n), -1, np.int32)
        if forced_tokens is not None:
            got = forced_tokens[:, 1 + steps_taken: 1 + steps_taken + n]
            forced[:, :got.shape[1]] = got
        args = (params, state, eos_j, trig_j, put(forced))
        statics = dict(cfg=cfg, sfi=sfi, sampling=sampling, n_steps=n, options=options,
                       return_logits=return_logits, plan=plan)
        tc = time.perf_counter()
        step_fn = _compiled_decode(args, statics)
        compile_s += time.perf_counter() - tc
        state, toks, taken, slow, lg, dg = step_fn(*args)
        toks, taken = np.asarray(toks), int(taken)
        new = [[int(t) for t in row[:taken] if t >= 0] for row in toks]
        for g, nw in zip(generated, new):
            g.extend(nw)
        if return_logits:
            logits_out.append(np.asarray(lg)[:, :taken])
        slow_flags.append(np.asarray(slow)[:, :taken])
        if diagnostics:
            diag_parts.append(np.asarray(dg)[:, :, :taken])
        done = np.asarray(state.done)
        steps_taken += taken
        remaining -= taken
        if on_tokens:
            on_tokens(new)
        if taken < n:
            break
    jax.block_until_ready(state.lengths)
    decode_s = time.perf_counter() - t1 - compile_s

    n_decoded = sum(len(g) - 1 for g in generated)
    stats = {
        "mode": mode, "batch": B, "prompt_tokens": lens.tolist(), "max_len": S,
        "prefill_s": prefill_s, "decode_compile_s": compile_s, "decode_s": decode_s, "decode_steps": steps_taken,
        "decode_tokens": n_decoded,
        "decode_tokens_per_s": n_decoded / decode_s if decode_s > 0 else float("nan"),
        "new_tokens": [len(g) for g in generated],
        "memory_bytes": sizes,
    }
    if sfi is not None:
        st = state.sfi
        stats.update(slow_steps=np.asarray(st.slow_steps).tolist(),
                     fast_steps=np.asarray(st.fast_steps).tolist(),
                     slow_timeline=(np.concatenate(slow_flags, 1) if slow_flags else
                                    np.zeros((B, 0), bool)))
    else:
        stats.update(slow_steps=[0] * B, fast_steps=[0] * B)
    if return_logits:
        stats["logits"] = np.concatenate(logits_out, axis=1)
    if diagnostics:
        d = (np.concatenate(diag_parts, axis=2) if diag_parts else
             np.zeros((2, B, 0, cfg.num_layers, cfg.num_kv_heads), np.float32))
        stats["coverage"], stats["support_jaccard"] = d[0], d[1]
        # the selection in force at the end: [L, B, Hkv, n_sink + k_select], -1 = empty
        stats["selected_positions"] = np.asarray(state.sfi.positions)
    text = None
    if tokenizer is not None:
        text = [tokenizer.decode([t for t in g if t not in eos_ids], skip_special_tokens=True)
                for g in generated]
    return GenerateResult(tokens=generated, text=text, stats=stats)
