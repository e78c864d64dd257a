"""`generate`: the host side of decoding, as named steps: validate the input, allocate the
cache and state, prefill all prompts together, make the initial selection, then decode with
the Engine's decode loop (`decoder.SlotDecoder`: the rows are its slots 0..B-1, tokens stream
between chunks, it stops when every row has ended), collect the stats."""

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
from sfi_jax.models.modeling import Model, unfuse_qkv_weights
from sfi_jax.options import EngineOptions
from sfi_jax.runtime import exact, prefill, programs, selection
from sfi_jax.runtime import mesh as mesh_lib
from sfi_jax.runtime.sampling import SamplingConfig, sample
from sfi_jax.runtime.decoder import Active, SlotDecoder
from sfi_jax.runtime.mode import Mode
from sfi_jax.runtime.requests import Request, RequestHandle, TextStream
from sfi_jax.runtime.state import (DecodeState, cache_dtype, empty_cache, empty_sfi_state,
                                   state_bytes)


@dataclasses.dataclass
class GenerateResult:
    """tokens: generated ids per prompt (EOS included when hit); text: decoded, when a
    tokenizer is known; stats: timings and per-sequence slow/fast step counts."""

    tokens: list[list[int]]
    text: list[str] | None
    stats: dict


def _available_device_bytes(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if device.platform == "cpu":
        try:  # MemAvailable counts the page cache the kernel can drop; MemFree does not
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


def _memory_fraction_hint(device) -> str:
    """On GPU, JAX takes XLA_CLIENT_MEM_FRACTION (or its older name
    XLA_PYTHON_CLIENT_MEM_FRACTION) of the memory, 0.75 unless set."""
    if device.platform != "gpu":
        return ""
    name = next((n for n in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
                 if os.environ.get(n)), None)
    said = f"{name} is {os.environ[name]}" if name else \
        "XLA_CLIENT_MEM_FRACTION is unset (0.75)"
    return (f", or give JAX more of the GPU: {said}; set it (e.g. to 0.94) before JAX "
            "starts (python -m sfi_jax.serve: --memory-fraction)")


def _token_id(t) -> int | None:
    """t as a token id (an integer, numpy's included; a bool is not one), else None."""
    if isinstance(t, (bool, np.bool_)):
        return None
    try:
        return operator.index(t)
    except TypeError:
        return None


def _tokenize(prompts, tokenizer) -> list[list[int]]:
    if hasattr(prompts, "tolist"):  # numpy / jax arrays: [T] one prompt, [B, T] a batch
        prompts = prompts.tolist()
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and _token_id(prompts[0]) is not None):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of strings or a list of token id "
                         f"lists, got {type(prompts).__name__} {prompts!r:.60}")
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
            if hasattr(p, "tolist"):
                p = p.tolist()
            if not isinstance(p, (list, tuple)):
                raise ValueError(f"prompt {i} must be a string or a list of token ids, got "
                                 f"{type(p).__name__} {p!r:.60}")
            ids = []
            for t in p:
                if _token_id(t) is None:
                    raise ValueError(f"prompt {i} has token id {t!r}, which is not an "
                                     "integer") from None
                ids.append(_token_id(t))
        if not ids:
            raise ValueError(f"prompt {i} is empty (no tokens)")
        out.append(ids)
    return out


def decode_programs() -> dict:
    """The compiled decode programs held now: {cache key: its static arguments (cfg, sfi,
    options, ...)}, for tests and reports (which engine options were compiled)."""
    return programs.held("decode_chunk")


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
        m = mesh_lib.make_mesh(mesh) if mesh is not None else mesh_lib.mesh_of(model.params)
        with jax.set_mesh(m):
            return fn(model, *args, mesh=m, **kw)

    return wrapper


@dataclasses.dataclass
class _Run:
    """What one generate call decided before any device work: shapes, policies, placement."""

    cfg: object
    sfi: SFIConfig | None
    sampling: SamplingConfig
    options: EngineOptions
    ids: list
    lens: np.ndarray
    S: int  # cache length
    chunk: int  # prefill chunk
    T: int  # padded prompt length
    plan: object
    params: dict
    sizes: dict
    forced_tokens: np.ndarray | None
    trigger_ids: np.ndarray | None
    window: int = 0  # prompt queries kept per row for the initial selection
    decode_path: Mode = Mode.SFI  # DENSE for mode sfi when every row fits the budget

    @property
    def batch(self) -> int:
        return len(self.ids)

    def put(self, a):
        """A host value on the device(s): replicated over the mesh (every process passes the
        same values)."""
        if self.plan is None:
            return jnp.asarray(a)
        return jax.device_put(np.asarray(a), self.plan.replicated)


def _validate(model, prompts, *, max_new_tokens, mode, sfi, temperature, top_p, top_k,
              tokenizer, chunk_steps, options, impl, forced_tokens, trigger_ids, max_len,
              diagnostics, mesh, prefill_chunk=None) -> _Run:
    """Check every argument, size the cache and the prefill chunks, place the parameters."""
    cfg = model.config
    options = EngineOptions() if options is None else options
    if not isinstance(options, EngineOptions):
        raise ValueError(f"options must be an EngineOptions, got {type(options).__name__}")
    if impl is not None:
        options = dataclasses.replace(options, attention=impl)
    mode = Mode.parse(mode)
    if _token_id(max_new_tokens) is None or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    max_new_tokens = operator.index(max_new_tokens)
    if diagnostics and mode is not Mode.SFI:
        raise ValueError("diagnostics=True needs mode='sfi' (use a budget >= the context for a "
                         "dense reference)")
    if _token_id(chunk_steps) is None or chunk_steps < 1:
        raise ValueError(f"chunk_steps must be an integer >= 1, got {chunk_steps!r}")
    if _token_id(top_k) is None or not 0 <= top_k <= cfg.vocab_size:
        raise ValueError(f"top_k must be an integer in [0, {cfg.vocab_size}] (the vocabulary "
                         f"size; 0 = off), got {top_k!r}")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)) \
                or not np.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    sampling = SamplingConfig(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k))
    sfi = mode.sfi_config(sfi)
    ids = _tokenize(prompts, tokenizer)
    B = len(ids)
    lens = np.array([len(p) for p in ids], np.int32)
    for i, p in enumerate(ids):
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary "
                             f"[0, {cfg.vocab_size})")
    T, S, max_chunk = _lengths(cfg, lens, max_new_tokens, max_len, prefill_chunk)
    decode_path = mode
    if sfi is not None:
        sfi = sfi.capped(S)
        if mode is Mode.SFI and not diagnostics and int(lens.max()) + max_new_tokens <= sfi.budget:
            # every row's sets would cover its whole context: SFI is dense decoding there, so
            # the dense program runs it without the selector and the compact buffers
            sfi, decode_path = None, Mode.DENSE
    params = model.params
    mesh = mesh_lib.make_mesh(mesh) if mesh is not None else mesh_lib.mesh_of(params)
    plan = mesh_lib.plan_for(cfg, mesh, B)
    options = options.resolved(mesh=None if plan is None else plan.mesh)  # once per request
    if plan is not None and mesh_lib.mesh_of(params) != plan.mesh:
        if model.layout.fused_qkv or model.layout.k_major:
            # per-head shardings need q, k, v apart and the weights as the shardings name
            # them: split each layer's fused weight, transpose its K-major ones, on the mesh
            rep = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())
            params["layers"] = [unfuse_qkv_weights(jax.device_put(w, rep), cfg, model.layout)
                                for w in params["layers"]]
        params = jax.device_put(params, mesh_lib.param_shardings(
            cfg, plan.mesh, split_layers=model.layout.split))
    if mode is Mode.EXACT:
        _check_exact(plan, sfi, forced_tokens)
    if plan is not None and sfi is not None and sfi.evidence_window > 1:
        raise ValueError(f"SFIConfig.evidence_window={sfi.evidence_window} is supported on a "
                         "single device only; use evidence_window=1 on a mesh")
    window = sfi.prefill_window if sfi is not None and not sfi.sink_only else 0
    sizes, chunk = _fit_memory(cfg, model.dtype, B, S, T, max_chunk, sfi, window, plan)
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
    return _Run(decode_path=decode_path, cfg=cfg, sfi=sfi, sampling=sampling, options=options,
                ids=ids, lens=lens, S=S,
                chunk=chunk, T=T, plan=plan, params=params, sizes=sizes,
                forced_tokens=forced_tokens, trigger_ids=trigger_ids, window=window)


def _lengths(cfg, lens, max_new_tokens, max_len, prefill_chunk):
    """The padded prompt length T and the cache length S, both bucketed
    (`prefill.bucket`: powers of two from 256 to the chunk size, then multiples of it) so that
    prompts of other lengths reuse the compiled programs; and the largest chunk."""
    max_chunk = prefill.check_max_chunk(prefill.MAX_CHUNK if prefill_chunk is None
                                        else prefill_chunk)
    longest = int(lens.max())
    need = longest + max_new_tokens
    if need > cfg.max_position_embeddings:
        raise ValueError(f"longest prompt ({longest} tokens) + max_new_tokens "
                         f"({max_new_tokens}) = {need} exceeds the model's context "
                         f"({cfg.max_position_embeddings})")
    T = prefill.bucket(longest, max_chunk)
    if max_len is not None:
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < need:
            raise ValueError(f"max_len {max_len!r} is shorter than prompt + max_new_tokens = "
                             f"{need}")
        # the last prefill chunk writes whole chunks into the cache
        return T, max(max_len, T), max_chunk
    return T, max(prefill.bucket(need, max_chunk), T), max_chunk


def _fit_memory(cfg, dtype, B, S, T, max_chunk, sfi, window, plan):
    """The cache + state sizes, and the largest chunk (<= max_chunk, halved down to 256
    tokens) whose activations fit beside them on the device; MemoryError naming the sizes
    when nothing fits. Returns (sizes, chunk)."""
    db = cache_dtype(dtype).itemsize
    sizes = state_bytes(cfg, B, S, db, sfi)
    split = plan.shard_factor if plan is not None else 1
    device = jax.local_devices()[0] if plan is None else \
        next(d for d in plan.mesh.devices.flat if d.process_index == jax.process_index())
    avail = _available_device_bytes(device)
    chunk = prefill.prefill_chunk_size(T, max_chunk)
    act = prefill.activation_bytes(cfg, B, chunk, S, db, window)
    if avail is None:
        return sizes, chunk
    while sum(sizes.values()) + sum(act.values()) > avail * split and chunk > 256:
        chunk //= 2
        act = prefill.activation_bytes(cfg, B, chunk, S, db, window)
    state, work = sum(sizes.values()) / split, sum(act.values()) / split
    if state + work > avail:
        gib = 2 ** 30
        raise MemoryError(
            f"KV cache + SFI state need {state / gib:.2f} GiB per device ({B} rows x {S} "
            f"positions, split {split} ways) and the prefill's activations {work / gib:.2f} GiB "
            f"more (chunks of {chunk} tokens), {(state + work) / gib:.2f} GiB in all, but the "
            f"device has {avail / gib:.2f} GiB free; reduce the batch, the prompt length or "
            "max_new_tokens" + _memory_fraction_hint(device))
    return sizes, chunk


def _allocate(run: _Run, dtype):
    """The empty KV cache and SFI state (on a mesh created in place, each device holding only
    its rows and heads)."""
    cfg, sfi, plan, B, S = run.cfg, run.sfi, run.plan, run.batch, run.S
    if plan is None:
        k, v = empty_cache(cfg, B, S, cache_dtype(dtype))
        sfi_state = empty_sfi_state(cfg, sfi, B, S, cache_dtype(dtype)) if sfi is not None else None
    else:
        k, v = mesh_lib.place(lambda: empty_cache(cfg, B, S, cache_dtype(dtype)),
                              (mesh_lib.cache_sharding(plan),) * 2)
        sfi_state = mesh_lib.place(
            lambda: empty_sfi_state(cfg, sfi, B, S, cache_dtype(dtype)),
            mesh_lib.sfi_state_shardings(plan, sfi.remembers)) if sfi is not None else None
    return k, v, sfi_state


@dataclasses.dataclass
class _Prefilled:
    """The prefill's outputs and timings (seconds; compile_s counts the programs compiled for
    this request: the chunk, the initial selection and the first-token logits)."""

    k: jax.Array
    v: jax.Array
    key_norms: jax.Array
    carry: prefill.PrefillCarry
    compile_s: float = 0.0
    run_s: float = 0.0  # the chunks, device work only (compile excluded)


def _prefill(run: _Run, k, v, sfi_state, dtype, progress=None,
             prefill_fn=prefill.prefill_chunk) -> _Prefilled:
    """Run the prompts through the model in chunks of run.chunk tokens, filling the cache (and
    the key norms), keeping the last residual and the initial selection's window queries.
    progress(chunks_done, chunks, tokens_done) is called after each chunk (tokens counted
    over the real prompt positions); prefill_fn runs a chunk (`prefill.prefill_chunk`'s
    signature)."""
    cfg, B, T, chunk, put = run.cfg, run.batch, run.T, run.chunk, run.put
    tokens = np.zeros((B, T), np.int32)
    for i, p in enumerate(run.ids):
        tokens[i, :len(p)] = p
    key_norms = sfi_state.key_norms if run.sfi is not None else put(np.zeros((0,), np.float32))
    carry = prefill.empty_carry(cfg, B, run.window, jnp.dtype(dtype))
    if run.plan is not None:
        carry = jax.device_put(carry, run.plan.replicated)
    lengths = put(run.lens)
    kw = dict(cfg=cfg, with_norms=run.sfi is not None, options=run.options, plan=run.plan)
    out = _Prefilled(k, v, key_norms, carry)
    out.compile_s = prefill.compile_chunk(run.params, k, v, key_norms, put(tokens[:, :chunk]),
                                          put(np.int32(0)), lengths, carry, **kw)
    t0 = time.perf_counter()
    n = T // chunk
    for i, start in enumerate(range(0, T, chunk)):
        out.k, out.v, out.key_norms, out.carry = prefill_fn(
            run.params, out.k, out.v, out.key_norms, put(tokens[:, start:start + chunk]),
            put(np.int32(start)), lengths, out.carry, **kw)
        if progress is not None:
            jax.block_until_ready(out.carry.last_hidden)
            progress(i + 1, n, int(np.minimum(run.lens, start + chunk).sum()))
    jax.block_until_ready(out.carry.last_hidden)
    out.run_s = time.perf_counter() - t0
    return out


def _aot(pre: _Prefilled, fn, args, statics):
    """fn's compiled program for args, its compile time added to the prefill's."""
    program, seconds = programs.compiled(fn, args, statics)
    pre.compile_s += seconds
    return program


def _initial_selection(run: _Run, pre: _Prefilled, sfi_state):
    """The compact buffers decode starts from: the sink alone (streaming) or the selection from
    the prefill's queries at the last prefill_window prompt positions (SFI_METHOD.md §5)."""
    sfi, lengths = run.sfi, run.put(run.lens)
    sfi_state = sfi_state._replace(key_norms=pre.key_norms)
    if sfi.sink_only:
        args = (sfi_state, pre.k, pre.v, lengths)
        statics = dict(cfg=run.cfg, sfi=sfi, plan=run.plan)
        fn = selection.sink_only_selection
    else:
        args = (sfi_state, pre.k, pre.v, pre.carry.window_q, lengths)
        statics = dict(sfi=sfi, options=run.options, plan=run.plan)
        fn = selection.prefill_selection
    return _aot(pre, fn, args, statics)(*args)


def _first_token(run: _Run, pre: _Prefilled, seed):
    """The first new token of each row, from the prefill's last residual. Returns the tokens
    (host), their logits and the PRNG key decode continues from."""
    plan = run.plan
    args = (run.params, pre.carry.last_hidden)
    first_logits = _aot(pre, prefill.first_logits, args, dict(cfg=run.cfg))(*args)
    if plan is not None:  # readable by the host on every process
        first_logits = jax.device_put(first_logits, plan.replicated)
    if not bool(jnp.all(jnp.isfinite(first_logits))):
        raise FloatingPointError("prefill produced non-finite logits (NaN/inf); check the "
                                 "checkpoint and dtype")
    key = jax.random.key(seed) if plan is None else \
        mesh_lib.place(lambda: jax.random.key(seed), plan.replicated)
    key, sub = jax.random.split(key)
    first = sample(first_logits, sub, run.sampling)
    if run.forced_tokens is not None:
        first = jnp.where(run.forced_tokens[:, 0] >= 0, run.forced_tokens[:, 0], first)
    return np.asarray(jax.block_until_ready(first)), first_logits, key


def _prefill_stats(run: _Run, pre: _Prefilled, t_request: float, t_first: float) -> dict:
    """Time to first token from the request's start (t_request) to the first token on the host
    (t_first), with and without the compiles it waited for; prefill throughput over the real
    prompt tokens; the chunking."""
    ttft_compiled = t_first - t_request
    ttft = ttft_compiled - pre.compile_s
    return {"ttft_s": ttft, "ttft_with_compile_s": ttft_compiled,
            "prefill_compile_s": pre.compile_s,
            "prefill_tokens_per_s": float(run.lens.sum()) / pre.run_s if pre.run_s > 0
            else float("nan"),
            "prefill_chunk": run.chunk, "prefill_chunks": run.T // run.chunk,
            "padded_prompt": run.T}


def _token_masks(run: _Run, tokenizer, stop_at_eos):
    """EOS ids, the EOS mask and the trigger-token mask over the vocabulary."""
    cfg = run.cfg
    eos_ids = [t for t in cfg.eos_token_ids if t is not None]
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos_ids.append(tokenizer.eos_token_id)
    eos_mask = np.zeros((cfg.vocab_size,), bool)
    if stop_at_eos:
        eos_mask[[t for t in eos_ids if 0 <= t < cfg.vocab_size]] = True
    if run.trigger_ids is not None:
        trig = np.zeros((cfg.vocab_size,), bool)
        trig[run.trigger_ids] = True
    else:
        trig = trigger_mask_for(tokenizer, cfg.vocab_size) if run.sfi is not None else \
            np.zeros((cfg.vocab_size,), bool)
    return eos_ids, eos_mask, trig


@dataclasses.dataclass
class _Decoded:
    generated: list
    text: list
    state: DecodeState
    logits: list | None
    slow: list
    diag: list
    steps: int
    decode_s: float
    compile_s: float
    counts: exact.ExactCounts | None = None  # exact mode's per-row bookkeeping
    dense_steps: list | None = None  # per row: decode steps of the dense program
    chunks: dict | None = None  # decode chunks per program: {"dense": n, "sfi": n}


def _decode(run: _Run, state: DecodeState, counts, first, first_logits, eos_ids, eos_mask,
            trig, *, mode, stop_at_eos, tokenizer, max_new_tokens, chunk_steps, return_logits,
            on_tokens, accept_rate) -> _Decoded:
    """Rows 0..B-1 of `state` enter the slots of a `SlotDecoder` (the Engine's decode loop)
    with their first tokens; it runs chunks until every row has ended."""
    dec = SlotDecoder(
        params=run.params, cfg=run.cfg, mode=mode, sfi=run.sfi, options=run.options,
        state=state, counts=counts, eos_mask=run.put(eos_mask), trigger_mask=run.put(trig),
        stop_ids=eos_ids if stop_at_eos else (), hidden_ids=eos_ids, chunk_steps=chunk_steps,
        sampling=run.sampling, plan=run.plan, put=run.put, forced=run.forced_tokens,
        return_logits=return_logits, accept_rate=accept_rate, record=True, strict=True)
    if return_logits:
        dec.logits.append(np.asarray(first_logits)[:, None])
    request = Request(prompt=[], max_tokens=max_new_tokens)
    now = time.perf_counter()
    ended = eos_mask[first] | (mode is Mode.EXACT and max_new_tokens <= 1)  # as state.done
    rows = []
    for b, ids in enumerate(run.ids):
        a = Active(RequestHandle(f"row-{b}", request, ids, None), b, ids,
                   TextStream(tokenizer, []), now, live_text=False)
        dec.enter(a, int(first[b]), device_done=bool(ended[b]))
        rows.append(a)
    if on_tokens:
        on_tokens([[int(t)] for t in first])
    dec.on_chunk = on_tokens
    t1 = time.perf_counter()
    while dec.active():
        if dec.steps >= max_new_tokens:  # each step gives every open row a token: none is left
            raise RuntimeError(f"decode took {dec.steps} steps for max_new_tokens="
                               f"{max_new_tokens} and rows are still open")
        dec.step()
    jax.block_until_ready(dec.state.lengths)
    decode_s = time.perf_counter() - t1 - dec.compile_s
    results = [a.handle.result(0) for a in rows]
    return _Decoded([r.token_ids for r in results], [r.text for r in results], dec.state,
                    dec.logits if return_logits else None, dec.slow, dec.diag, dec.steps,
                    decode_s, dec.compile_s, counts=dec.counts,
                    dense_steps=dec.dense_steps.tolist(),
                    chunks={"dense": dec.tally["dense_chunks"], "sfi": dec.tally["sfi_chunks"]})


def _check_exact(plan, sfi, forced_tokens):
    """What exact mode does not do (yet), refused before any device work."""
    if plan is not None:
        raise ValueError("mode='exact' runs on one device; use mode='sfi' on a mesh")
    if sfi.evidence_window > 1:
        raise ValueError(f"mode='exact' selects from the verify step's own queries; "
                         f"SFIConfig.evidence_window={sfi.evidence_window} needs mode='sfi'")
    if forced_tokens is not None:
        raise ValueError("forced_tokens needs mode 'sfi' or 'dense' (exact mode emits only "
                         "verified tokens)")


def _check_exact_call(mode, return_logits, accept_rate):
    if accept_rate is not None:
        if mode is not Mode.EXACT:
            raise ValueError(f"accept_rate is for mode='exact' only (mode is '{mode}')")
        if isinstance(accept_rate, bool) or not 0.0 <= float(accept_rate) <= 1.0:
            raise ValueError(f"accept_rate must be a number in [0, 1], got {accept_rate!r}")
    if mode is Mode.EXACT and return_logits:
        raise ValueError("return_logits needs mode 'sfi' or 'dense'")


def _exact_stats(counts: exact.ExactCounts) -> dict:
    """Per row: drafted = accepted + rejected draft tokens, verify steps (rounds), accepted
    draft tokens per verify step and per drafted token."""
    drafted, accepted, verify = (np.asarray(x) for x in
                                 (counts.drafted, counts.accepted, counts.verify_steps))
    with np.errstate(divide="ignore", invalid="ignore"):
        return {"drafted": drafted.tolist(), "accepted": accepted.tolist(),
                "rejected": (drafted - accepted).tolist(), "verify_steps": verify.tolist(),
                "mean_accepted_length": np.where(verify > 0, accepted / verify, 0.0).tolist(),
                "acceptance_rate": np.where(drafted > 0, accepted / drafted,
                                            float("nan")).tolist()}


def _decode_path(run: _Run, out: _Decoded, mode) -> Mode | str:
    """Which program decoded, mode "sfi": "dense" (every row fits the SFI budget: the dense
    program alone), "sfi" (the SFI program alone) or "sfi+dense" (the dense program once
    every row still open fit, `SlotDecoder._dense_chunk`); other modes: the mode."""
    if mode is not Mode.SFI or out.chunks is None or not any(out.chunks.values()):
        return run.decode_path
    if out.chunks["sfi"] and out.chunks["dense"]:
        return "sfi+dense"
    return Mode.SFI if out.chunks["sfi"] else Mode.DENSE


def _stats(run: _Run, out: _Decoded, mode, prefill_s, return_logits, diagnostics) -> dict:
    """Timings, per-row slow/fast step counts and the optional logits and diagnostics."""
    B, cfg = run.batch, run.cfg
    n_decoded = sum(len(g) - 1 for g in out.generated)
    decode_s = out.decode_s
    stats = {
        "mode": mode, "batch": B, "prompt_tokens": run.lens.tolist(), "max_len": run.S,
        "prefill_s": prefill_s, "decode_compile_s": out.compile_s, "decode_s": decode_s,
        "decode_steps": out.steps, "decode_tokens": n_decoded,
        "decode_tokens_per_s": n_decoded / decode_s if decode_s > 0 else float("nan"),
        "new_tokens": [len(g) for g in out.generated],
        "memory_bytes": run.sizes,
    }
    if run.sfi is not None:
        st = out.state.sfi
        stats.update(slow_steps=np.asarray(st.slow_steps).tolist(),
                     fast_steps=np.asarray(st.fast_steps).tolist(),
                     slow_timeline=(np.concatenate(out.slow, 1) if out.slow else
                                    np.zeros((B, 0), bool)))
    else:
        stats.update(slow_steps=[0] * B, fast_steps=[0] * B)
        if mode is Mode.SFI:  # every row within the budget ran dense (decode_path)
            stats["slow_timeline"] = np.zeros((B, out.steps), bool)
    stats["dense_steps"] = out.dense_steps
    stats["decode_path"] = _decode_path(run, out, mode)
    if return_logits:
        stats["logits"] = np.concatenate(out.logits, axis=1)
    if diagnostics:
        d = (np.concatenate(out.diag, axis=2) if out.diag else
             np.zeros((2, B, 0, cfg.num_layers, cfg.num_kv_heads), np.float32))
        stats["coverage"], stats["support_jaccard"] = d[0], d[1]
        # the selection in force at the end: [L, B, Hkv, n_sink + k_select], -1 = empty
        stats["selected_positions"] = np.asarray(out.state.sfi.positions)
    return stats


@_on_own_mesh
def generate(model: Model, prompts, *, max_new_tokens: int, mode: Mode | str = Mode.SFI,
             sfi: SFIConfig | None = None, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int = 0, stop_at_eos: bool = True, tokenizer=None,
             chunk_steps: int = 32, options: EngineOptions | None = None,
             impl: str | None = None, trigger_ids=None,
             on_tokens: Callable[[list[list[int]]], None] | None = None,
             forced_tokens=None, return_logits: bool = False, max_len: int | None = None,
             diagnostics: bool = False, mesh=None, prefill_chunk: int | None = None,
             progress: Callable[[int, int, int], None] | None = None,
             accept_rate: float | None = None,
             prefill_fn: Callable | None = None) -> GenerateResult:
    """Generate up to max_new_tokens per prompt; mode "sfi" (default), "dense" or "exact"
    (a `Mode` or its value; stats["mode"] is a Mode, stats["decode_path"] a Mode or
    "sfi+dense").

    mode "exact": SFI fast steps draft `sfi.draft_len` tokens, one dense step verifies them
    (the tokens are dense decoding's; greedy identical, sampled with the same distribution);
    stats add per-row drafted, accepted, rejected, verify_steps, mean_accepted_length and
    acceptance_rate. accept_rate (benchmarks only, exact mode): accept each draft token with
    this probability instead of verifying it; the tokens are then not dense decoding's.

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
    max_len: the cache length at least (default: bucketed prompt + max_new_tokens).
    prefill_chunk: the most tokens per prefill chunk, a power of two (default 8192; smaller
    when the activations would not fit). progress(chunks_done, chunks, prompt_tokens_done) is
    called after each prefill chunk (for a progress bar).
    prefill_fn: what runs a prefill chunk, with `runtime.prefill.prefill_chunk`'s signature
    (None: that function; `eval.prefill_cache.shared_prefill` hands out one that reuses a
    prefill across calls).
    stats: timings in seconds (compiles apart: prefill_compile_s, decode_compile_s,
    compile_s), ttft_s (time to first token, compiles excluded) and ttft_with_compile_s,
    prefill_tokens_per_s, decode_tokens_per_s, per-row slow/fast step counts and dense_steps
    (steps run by the dense program), decode_path (mode "sfi": "dense" when every row fits
    the budget, "sfi", or "sfi+dense"), memory_bytes.
    """
    t_request = time.perf_counter()
    mode = Mode.parse(mode)
    _check_exact_call(mode, return_logits, accept_rate)
    run = _validate(model, prompts, max_new_tokens=max_new_tokens, mode=mode, sfi=sfi,
                    temperature=temperature, top_p=top_p, top_k=top_k, tokenizer=tokenizer,
                    chunk_steps=chunk_steps, options=options, impl=impl,
                    forced_tokens=forced_tokens, trigger_ids=trigger_ids, max_len=max_len,
                    diagnostics=diagnostics, mesh=mesh, prefill_chunk=prefill_chunk)
    cfg, sfi, plan, B, S, dtype = run.cfg, run.sfi, run.plan, run.batch, run.S, model.dtype
    t0 = time.perf_counter()
    k, v, sfi_state = _allocate(run, dtype)
    pre = _prefill(run, k, v, sfi_state, dtype, progress,
                   prefill.prefill_chunk if prefill_fn is None else prefill_fn)
    k, v = pre.k, pre.v
    if sfi is not None:
        sfi_state = _initial_selection(run, pre, sfi_state)
    first, first_logits, key = _first_token(run, pre, seed)
    t_first = time.perf_counter()
    prefill_s = t_first - t0 - pre.compile_s

    eos_ids, eos_mask, trig = _token_masks(run, tokenizer, stop_at_eos)
    # exact mode keeps the rows' budgets on the device (`exact.ExactCounts`)
    done = eos_mask[first] | (mode is Mode.EXACT and max_new_tokens <= 1)
    counts = exact.initial_counts(B, np.where(done, 0, max_new_tokens - 1)) \
        if mode is Mode.EXACT else None
    state = DecodeState(k=k, v=v, lengths=run.put(run.lens), token=run.put(first),
                        done=run.put(done), step=run.put(np.int32(0)), key=key,
                        sfi=sfi_state,
                        diag=jnp.zeros((cfg.num_layers, B, cfg.num_kv_heads, S), bool)
                        if diagnostics else None,
                        q_hist=jnp.zeros((cfg.num_layers, B, cfg.num_q_heads,
                                          sfi.evidence_window, cfg.head_dim), dtype)
                        if sfi is not None and sfi.evidence_window > 1 else None,
                        nonfinite=run.put(np.zeros((B,), bool)))
    if plan is not None:
        state = jax.device_put(state, mesh_lib.decode_state_shardings(plan, state))
    out = _decode(run, state, counts, first, first_logits, eos_ids, eos_mask, trig, mode=mode,
                  stop_at_eos=stop_at_eos, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                  chunk_steps=chunk_steps, return_logits=return_logits, on_tokens=on_tokens,
                  accept_rate=None if accept_rate is None else float(accept_rate))
    stats = _stats(run, out, mode, prefill_s, return_logits, diagnostics)
    if out.counts is not None:
        stats.update(_exact_stats(out.counts))
    stats.update(_prefill_stats(run, pre, t_request, t_first))
    stats["compile_s"] = stats["prefill_compile_s"] + stats["decode_compile_s"]
    return GenerateResult(tokens=out.generated,
                          text=out.text if tokenizer is not None else None, stats=stats)
