"""The Engine: requests that arrive one by one, decoded together in a fixed set of slots.

Each slot is one row of the KV cache, the SFI state and the per-row controls (`RowControls`:
sampling parameters, PRNG key, token budget), all allocated once. A scheduler thread admits
waiting requests into free slots: a request's prompt is prefilled alone (batch 1, in chunks of
up to `prefill_chunk` tokens, one chunk per scheduler iteration so that running streams wait at
most one chunk) straight into its slot's row of the slots' cache (no cache of its own, so a
request of the full context costs one slot's memory), its initial selection made and its first
token sampled, then its SFI state and controls are inserted into the slot. Every iteration
runs all active slots for `chunk_steps` decode steps in one device call and streams each
request's new tokens, freeing slots on EOS, a stop string or token id, the token budget or a
cancel: `decoder.SlotDecoder`, the decode loop `generate` runs too. A request's prompt
length, budget and sampling are data: programs depend only on the slots, the cache length
and the prompt's length bucket.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import operator
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sfi_jax.config import SFIConfig
from sfi_jax.models.modeling import Model
from sfi_jax.options import EngineOptions
from sfi_jax.runtime import exact, prefill, programs, selection
from sfi_jax.runtime.decoder import Active, SlotDecoder
from sfi_jax.runtime.mode import Mode
from sfi_jax.runtime.requests import (QueueFull, Request, RequestError, RequestHandle,
                                      RequestResult, TextStream, TokenEvent)
from sfi_jax.runtime.sampling import sample_rows
from sfi_jax.runtime.state import (DecodeState, RowControls, cache_dtype, empty_cache,
                                   empty_sfi_state, row_controls, state_bytes)

FINISH_REASONS = ("stop", "length", "cancelled", "error")
MAX_SLOTS = 16  # the default slot count at most (fewer when the memory holds fewer)
CPU_MAX_SLOTS, CPU_MAX_LEN = 2, 2048  # CPU defaults (a laptop serves its first answer in ~12 s)


def _as_int(value, field, lo=None, hi=None, what="an integer"):
    if isinstance(value, bool):
        raise RequestError(field, f"{field} must be {what}, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise RequestError(field, f"{field} must be {what}, got {value!r}") from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(field, f"{field} must be {what}, got {value}")
    return value


def _as_float(value, field, ok, what):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise RequestError(field, f"{field} must be {what}, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or not ok(value):
        raise RequestError(field, f"{field} must be {what}, got {value}")
    return value


@functools.partial(jax.jit, donate_argnames=("state",))
def _insert(state: DecodeState, slot, sfi_row, length, token, controls: RowControls, done):
    """Slot `slot` <- one request prefilled into the slot's cache row (its keys and key norms
    are there already): its SFI state (batch 1; its key norms unused), length, first token
    and controls."""
    st = state.sfi
    if st is not None:
        put = lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, slot, axis=1)  # noqa
        st = st._replace(ck=put(st.ck, sfi_row.ck), cv=put(st.cv, sfi_row.cv),
                         c_len=put(st.c_len, sfi_row.c_len),
                         positions=put(st.positions, sfi_row.positions),
                         since_slow=st.since_slow.at[slot].set(0),
                         pending=st.pending.at[slot].set(True),
                         slow_steps=st.slow_steps.at[slot].set(0),
                         fast_steps=st.fast_steps.at[slot].set(0))
        if st.scores is not None:
            st = st._replace(scores=put(st.scores, sfi_row.scores))
    rows = state.rows if state.rows is None else \
        jax.tree.map(lambda a, b: a.at[slot].set(b[0]), state.rows, controls)
    q_hist = state.q_hist
    if q_hist is not None:
        q_hist = q_hist.at[:, slot].set(0)
    return state._replace(
        lengths=state.lengths.at[slot].set(length), token=state.token.at[slot].set(token),
        done=state.done.at[slot].set(done), sfi=st, rows=rows, q_hist=q_hist,
        nonfinite=state.nonfinite.at[slot].set(False))


@functools.partial(jax.jit, static_argnames=("length",))
def _row_norms(key_norms, slot, length):
    """Slot `slot`'s key norms [L, 1, Hkv, length] (the prefill wrote them in place)."""
    L, _, Hkv, _ = key_norms.shape
    return jax.lax.dynamic_slice(key_norms, (0, slot, 0, 0), (L, 1, Hkv, length))


@functools.partial(jax.jit, donate_argnames=("counts",))
def _insert_counts(counts, slot, remaining):
    """Exact mode's bookkeeping of a new request in `slot`."""
    fresh = exact.initial_counts(1, jnp.reshape(remaining, (1,)))
    return jax.tree.map(lambda c, f: c.at[slot].set(f[0]), counts, fresh)


@jax.jit
def _first_token(logits, controls: RowControls):
    """The first new token from the prefill's logits [1, V], with the request's own sampling;
    whether the logits were finite; the controls with the key advanced."""
    token, keys = sample_rows(logits, controls)
    return token, jnp.all(jnp.isfinite(logits)), controls._replace(keys=keys)


class Engine:
    """Continuous batching over `max_slots` rows of a `max_len`-position cache (allocated at
    `cache_len` positions: max_len rounded up to the prefill's padded length, so that a
    prompt's chunks fit the slot's row).

    mode: a `Mode` or its value, "sfi", "dense" or "exact" (exact: greedy requests only:
    dense decoding's tokens, drafted by SFI's fast steps and verified by a dense step; its
    sampling is one setting for all rows, which `generate` offers for a batch). sfi: the
    SFIConfig (default SFIConfig()). chunk_steps: decode steps per device call (the streaming granularity and
    the most steps a finished or cancelled request's slot stays busy). prefill_chunk: the most
    prompt tokens per prefill call (a power of two, default 8192). max_queue: requests that may
    wait for a slot before `submit` raises QueueFull. Use it as a context manager, or call
    `start()` and `stop()`."""

    def __init__(self, model: Model, *, tokenizer=None, mode: Mode | str = Mode.SFI,
                 sfi: SFIConfig | None = None, max_slots: int | None = None,
                 max_len: int | None = None, chunk_steps: int = 16,
                 prefill_chunk: int | None = None, max_queue: int = 64,
                 options: EngineOptions | None = None, trigger_ids=None,
                 model_name: str | None = None):
        mode = Mode.parse(mode)
        sfi = mode.sfi_config(sfi)
        if sfi is not None and sfi.policy == "oracle":
            raise ValueError("the oracle policy is an evaluation baseline; it is not served")
        if mode is Mode.EXACT and sfi.evidence_window > 1:
            raise ValueError("mode='exact' selects from the verify step's own queries; "
                             f"SFIConfig.evidence_window={sfi.evidence_window} needs "
                             "mode='sfi'")
        from sfi_jax.runtime import mesh as mesh_lib

        if mesh_lib.mesh_of(model.params) is not None:
            raise ValueError("the Engine runs on one device; load the model without a mesh")
        self.model, self.cfg, self.tokenizer, self.mode, self.sfi = \
            model, model.config, tokenizer, mode, sfi
        self.params = model.params  # (a pure pytree, built once: the property rebuilds it)
        self.options = (options or EngineOptions()).resolved()
        self.chunk_steps = _as_int(chunk_steps, "chunk_steps", 1, what="an integer >= 1")
        self.max_chunk = prefill.check_max_chunk(prefill.MAX_CHUNK if prefill_chunk is None
                                                 else prefill_chunk)
        self.max_queue = _as_int(max_queue, "max_queue", 1, what="an integer >= 1")
        self.model_name = model_name or getattr(model, "source", None) or "sfi_jax"
        self.window = sfi.prefill_window if sfi is not None and not sfi.sink_only else 0
        self.max_len, self.cache_len, self.max_slots = self._size(max_len, max_slots)
        self._masks(trigger_ids)
        self._prefilling: collections.deque[Active] = collections.deque()
        self._waiting: collections.deque[Active] = collections.deque()
        self._lock = threading.Condition()
        self.observers: list[Callable[[str, float], None]] = []
        state, counts = self._empty_state()
        self.decoder = SlotDecoder(
            params=self.params, cfg=self.cfg, mode=mode, sfi=self.sfi, options=self.options,
            state=state, counts=counts, eos_mask=self._eos, trigger_mask=self._trig,
            stop_ids=self.eos_ids, hidden_ids=self.eos_ids, chunk_steps=self.chunk_steps,
            lock=self._lock, observe=self._observe)
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._running = False
        self._drain = True
        self._ids = itertools.count()
        self._seeds = np.random.default_rng()

    # ------------------------------------------------------------------ setup

    def _size(self, max_len, max_slots):
        cfg = self.cfg
        ctx = cfg.max_position_embeddings
        on_cpu = jax.default_backend() == "cpu"
        if max_len is None:  # a CPU reads whole caches in dense steps: keep them short there
            max_len = min(ctx, CPU_MAX_LEN) if on_cpu else ctx
        max_len = _as_int(max_len, "max_len", 2, ctx, f"an integer in [2, {ctx}]")
        if self.sfi is not None:  # (k_select beyond the cache length selects nothing more)
            self.sfi = self.sfi.capped(max_len)
        db = cache_dtype(self.model.dtype).itemsize
        cache_len = prefill.bucket(max_len, self.max_chunk)
        per_slot = sum(state_bytes(cfg, 1, cache_len, db, self.sfi).values())
        from sfi_jax.runtime.generation import _available_device_bytes

        avail = _available_device_bytes(jax.local_devices()[0])
        # one request's prefill: its activations (it writes the slot's own cache row)
        work = sum(prefill.activation_bytes(cfg, 1, min(self.max_chunk, cache_len), cache_len,
                                            db, self.window).values())
        if max_slots is None:
            fit = 16 if avail is None else int((0.9 * avail - work) // per_slot)
            max_slots = min(CPU_MAX_SLOTS if on_cpu else MAX_SLOTS, fit)
            if max_slots < 1:
                raise MemoryError(self._memory_message(1, cache_len, per_slot, work, avail))
        max_slots = _as_int(max_slots, "max_slots", 1, what="an integer >= 1")
        if avail is not None and max_slots * per_slot + work > avail:
            raise MemoryError(self._memory_message(max_slots, cache_len, per_slot, work, avail))
        return max_len, cache_len, max_slots

    @staticmethod
    def _memory_message(slots, cache_len, per_slot, work, avail):
        from sfi_jax.runtime.generation import _memory_fraction_hint

        gib = 2 ** 30
        return (f"{slots} slots x {cache_len} positions need {slots * per_slot / gib:.2f} GiB "
                f"(KV cache + SFI state, {per_slot / gib:.3f} GiB per slot) and a prefill "
                f"{work / gib:.2f} GiB more, but the device has {avail / gib:.2f} GiB free; "
                "lower max_slots or max_len" + _memory_fraction_hint(jax.local_devices()[0]))

    def _masks(self, trigger_ids):
        from sfi_jax.runtime.generation import trigger_mask_for

        cfg, tok = self.cfg, self.tokenizer
        self.eos_ids = {t for t in cfg.eos_token_ids if t is not None}
        if tok is not None and tok.eos_token_id is not None:
            self.eos_ids.add(tok.eos_token_id)
        eos = np.zeros((cfg.vocab_size,), bool)
        eos[[t for t in self.eos_ids if 0 <= t < cfg.vocab_size]] = True
        if trigger_ids is not None:
            trig = np.zeros((cfg.vocab_size,), bool)
            trig[np.asarray(trigger_ids, np.int64)] = True
        else:
            trig = trigger_mask_for(tok, cfg.vocab_size) if self.sfi is not None else \
                np.zeros((cfg.vocab_size,), bool)
        self._eos, self._trig = jnp.asarray(eos), jnp.asarray(trig)

    def _empty_state(self) -> DecodeState:
        cfg, B, S, dtype = self.cfg, self.max_slots, self.cache_len, self.model.dtype
        k, v = empty_cache(cfg, B, S, cache_dtype(dtype))
        sfi_state = empty_sfi_state(cfg, self.sfi, B, S, cache_dtype(dtype)) if self.sfi else None
        q_hist = None
        if self.sfi is not None and self.sfi.evidence_window > 1:
            q_hist = jnp.zeros((cfg.num_layers, B, cfg.num_q_heads, self.sfi.evidence_window,
                                cfg.head_dim), dtype)
        exact_mode = self.mode is Mode.EXACT
        state = DecodeState(k=k, v=v, lengths=jnp.zeros((B,), jnp.int32),
                            token=jnp.zeros((B,), jnp.int32), done=jnp.ones((B,), bool),
                            step=jnp.int32(0), key=jax.random.key(0), sfi=sfi_state,
                            q_hist=q_hist, rows=None if exact_mode else row_controls(B),
                            nonfinite=jnp.zeros((B,), bool))
        # exact mode: greedy verification; its row budgets are `exact.ExactCounts.remaining`
        return state, exact.initial_counts(B, np.zeros(B, np.int32)) if exact_mode else None

    # ------------------------------------------------------------------ requests

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt", "a text prompt needs the engine's tokenizer; pass "
                                   "token ids or Engine(..., tokenizer=...)")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            V, ids = self.cfg.vocab_size, []
            for i, t in enumerate(prompt):
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)) \
                        or not 0 <= t < V:
                    raise RequestError("prompt", f"prompt token {i} is {t!r}: token ids are "
                                       f"integers in [0, {V})")
                ids.append(int(t))
        else:
            raise RequestError("prompt", "prompt must be a string or a list of token ids, got "
                               f"{type(prompt).__name__}")
        if not ids:
            raise RequestError("prompt", "prompt is empty (no tokens)")
        return ids

    def validate(self, request: Request) -> list[int]:
        """The request's prompt ids; RequestError naming the first bad field."""
        if not isinstance(request, Request):
            raise RequestError("request", f"expected a Request, got {type(request).__name__}")
        ids = self._prompt_ids(request.prompt)
        _as_int(request.max_tokens, "max_tokens", 1, what="an integer >= 1")
        _as_float(request.temperature, "temperature", lambda x: x >= 0, "a finite number >= 0")
        _as_float(request.top_p, "top_p", lambda x: 0 < x <= 1, "a number in (0, 1]")
        V = self.cfg.vocab_size
        _as_int(request.top_k, "top_k", 0, V, f"an integer in [0, {V}] (0 = off)")
        if self.mode is Mode.EXACT and request.temperature > 0:
            raise RequestError("temperature", "this engine runs exact mode, which serves greedy "
                               f"requests (temperature 0); got temperature "
                               f"{request.temperature}")
        if request.seed is not None:
            _as_int(request.seed, "seed", 0, 2 ** 63 - 1, "an integer >= 0")
        stop = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop", f"stop must be a non-empty string or a list of them, got "
                               f"{request.stop!r}")
        if stop and self.tokenizer is None:
            raise RequestError("stop", "stop strings need the engine's tokenizer")
        for t in request.stop_token_ids or []:
            _as_int(t, "stop_token_ids", 0, V - 1, f"token ids in [0, {V})")
        need = len(ids) + request.max_tokens
        if need > self.max_len:
            raise RequestError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens "
                               f"({request.max_tokens}) = {need} exceeds the engine's max_len "
                               f"({self.max_len})")
        return ids

    def submit(self, request: Request, on_event: Callable[[TokenEvent], None] | None = None
               ) -> RequestHandle:
        """Queue a request (validated first: RequestError, QueueFull) and return its handle."""
        ids = self.validate(request)
        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        with self._lock:
            if not self._accepting:
                raise RuntimeError("the engine is not running (start() it, or it is stopping)")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests wait already (max_queue="
                                f"{self.max_queue})", retry_after=1.0)
            handle = RequestHandle(f"req-{next(self._ids)}", request, ids, on_event)
            self._waiting.append(Active(handle, -1, ids, TextStream(self.tokenizer, stop),
                                         time.perf_counter()))
            self.decoder.tally["requests_total"] += 1
            self._lock.notify_all()
        return handle

    def cancel(self, handle: RequestHandle):
        """End a request: its slot is free again within one decode chunk."""
        with self._lock:
            handle.cancelled = True
            self._lock.notify_all()

    def generate(self, request: Request, **kw) -> RequestResult:
        """Submit and wait (a convenience for scripts)."""
        return self.submit(request, **kw).result()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "Engine":
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return self
            self._accepting = self._running = True
            self._thread = threading.Thread(target=self._loop, name="sfi_jax-engine",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None):
        """Stop admitting requests; drain=True finishes the running and waiting ones,
        drain=False cancels them. Joins the scheduler thread."""
        with self._lock:
            self._accepting = False
            self._drain = drain
            if not drain:
                for a in self._all_requests():
                    a.handle.cancelled = True
            self._running = False
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop(drain=exc[0] is None)

    def _all_requests(self):
        return [a for a in self.decoder.slots if a is not None] + list(self._prefilling) + \
            list(self._waiting)

    def metrics(self) -> dict:
        with self._lock:
            dec = self.decoder
            active = sum(a is not None and a.t_first is not None for a in dec.slots)
            tokens = sum(n for n, _ in dec.rate)
            seconds = sum(s for _, s in dec.rate)
            return {"queue_length": len(self._waiting), "prefilling": len(self._prefilling),
                    "active_slots": active, "max_slots": self.max_slots,
                    "requests_total": dec.tally["requests_total"],
                    "requests_finished": dec.tally["requests_finished"],
                    "tokens_generated": dec.tally["tokens_generated"],
                    "slow_steps": dec.tally["slow_steps"],
                    "fast_steps": dec.tally["fast_steps"],
                    "dense_steps": dec.tally["dense_steps"],
                    "dense_chunks": dec.tally["dense_chunks"],
                    "sfi_chunks": dec.tally["sfi_chunks"],
                    "decode_tokens_per_s": tokens / seconds if seconds > 0 else 0.0}

    def _observe(self, kind, value):
        for f in self.observers:
            try:
                f(kind, value)
            except Exception:  # a metrics hook never stops the engine
                pass

    # ------------------------------------------------------------------ the scheduler

    def _loop(self):
        while True:
            with self._lock:
                while self._running and not self._all_requests():
                    self._lock.wait()
                if not self._all_requests() and not self._running:
                    return
                self._admit()  # (after stop(drain=False) the cancelled flags end them)
            try:
                self._step()
            except Exception as e:  # a decode error ends the requests in flight, not the engine
                dec = self.decoder
                for a in [a for a in dec.slots if a is not None] + list(self._prefilling):
                    dec.finish(a, "error", f"{type(e).__name__}: {e}")
                self._prefilling.clear()
                dec.state, dec.counts = self._empty_state()
                dec.released[:] = True

    def _admit(self):
        """Waiting requests -> free slots (called with the lock held)."""
        for a in list(self._waiting):
            if a.handle.cancelled:
                self._waiting.remove(a)
                self.decoder.finish(a, "cancelled")
        taken = {a.slot for a in self._prefilling}
        for slot in range(self.max_slots):
            if not self._waiting:
                break
            if self.decoder.slots[slot] is None and slot not in taken:
                a = self._waiting.popleft()
                a.slot = slot
                self._prefilling.append(a)

    def _step(self):
        if self._prefilling:
            a = self._prefilling[0]
            try:
                if a.handle.cancelled:
                    self._prefilling.popleft()
                    self._unpark(a)
                    self.decoder.finish(a, "cancelled")
                elif self._prefill_chunk(a):
                    self._prefilling.popleft()
                    self._enter_slot(a)
            except Exception as e:  # a prefill that fails ends its own request only
                if self._prefilling and self._prefilling[0] is a:
                    self._prefilling.popleft()
                if not self._state_intact():
                    raise
                self._unpark(a)
                self.decoder.finish(a, "error", f"{type(e).__name__}: {e}")
        self.decoder.release_ended()
        if self.decoder.active():
            self.decoder.step()

    def _unpark(self, a: Active):
        """A request that ends before its slot's row holds it: the row idles at length 0
        again (a parked row would cost a dense step its whole length)."""
        if a.tokens is not None and self.decoder.slots[a.slot] is None:
            self.decoder.park(a.slot, 0)
            a.carry = a.tokens = None

    def _state_intact(self) -> bool:
        """Whether the slots' state survived a failed call (a donated buffer may not have)."""
        return not any(x.is_deleted() for x in jax.tree.leaves(self.decoder.state))

    def prefill_length(self, n: int) -> int:
        """The padded length a prompt of n tokens is prefilled at: a power of two up to one
        chunk, and the slots' own padded length above that, so that prompts of any length
        share a few programs (`warmup_lengths`) instead of one per multiple of the chunk."""
        if n <= self.max_chunk:
            return prefill.bucket(n, self.max_chunk)
        return prefill.bucket(self.max_len, self.max_chunk)

    def warmup_lengths(self) -> list[int]:
        """A prompt length for each padded prefill length a request can meet (each leaves room
        for two new tokens): requests of these lengths compile every program."""
        out, seen = [], set()
        for n in sorted({1, *(prefill.MIN_BUCKET << i for i in range(24)), self.max_chunk + 1}):
            n = min(n, self.max_len - 2)
            if n >= 1 and self.prefill_length(n) not in seen:
                seen.add(self.prefill_length(n))
                out.append(n)
        return out

    def _prefill_chunk(self, a: Active) -> bool:
        """One prefill chunk of request `a`, written into its slot's row of the slots' cache;
        True when its prompt is done: after the chunk that holds its last token (a long
        prompt's padded length is the slots' cache length, and chunks past the prompt would
        only write padding that every reader masks)."""
        cfg, dtype, dec = self.cfg, self.model.dtype, self.decoder
        if a.tokens is None:
            T = self.prefill_length(len(a.ids))
            a.chunk = prefill.prefill_chunk_size(T, self.max_chunk)
            a.tokens = np.zeros((1, T), np.int32)
            a.tokens[0, :len(a.ids)] = a.ids
            a.carry = prefill.empty_carry(cfg, 1, self.window, jnp.dtype(dtype))
            # the slot's row idles where no request writes while decode steps run beside
            # this prefill: its last position (a request's tokens end by max_len - 2)
            dec.park(a.slot, self.cache_len - 1)
        s, st = a.start, dec.state
        norms = st.sfi.key_norms if st.sfi is not None else jnp.zeros((0,), jnp.float32)
        k, v, norms, a.carry = prefill.prefill_chunk(
            self.params, st.k, st.v, norms, jnp.asarray(a.tokens[:, s:s + a.chunk]),
            jnp.int32(s), jnp.asarray([len(a.ids)], jnp.int32), a.carry, cfg=cfg,
            with_norms=self.sfi is not None, options=self.options, row=jnp.int32(a.slot))
        dec.state = st._replace(k=k, v=v, sfi=None if st.sfi is None else
                                st.sfi._replace(key_norms=norms))
        a.start += a.chunk
        return a.start >= min(len(a.ids), a.tokens.shape[1])

    def _controls(self, r: Request) -> RowControls:
        seed = r.seed if r.seed is not None else int(self._seeds.integers(2 ** 63 - 1))
        return RowControls(temperature=jnp.asarray([r.temperature], jnp.float32),
                           top_p=jnp.asarray([r.top_p], jnp.float32),
                           top_k=jnp.asarray([r.top_k], jnp.int32),
                           keys=jax.random.key(seed)[None],
                           remaining=jnp.asarray([r.max_tokens - 1], jnp.int32))

    def _enter_slot(self, a: Active):
        """The prefilled request's selection (from its slot's cache row) and first token; then
        its SFI state and controls go into its slot."""
        cfg, sfi, n, dec = self.cfg, self.sfi, len(a.ids), self.decoder
        T = a.tokens.shape[1]
        lengths = jnp.asarray([n], jnp.int32)
        sfi_row = None
        if sfi is not None:
            st = empty_sfi_state(cfg, sfi, 1, T, cache_dtype(self.model.dtype))._replace(
                key_norms=_row_norms(dec.state.sfi.key_norms, jnp.int32(a.slot), T))
            state, row = dec.state, jnp.int32(a.slot)
            if sfi.sink_only:
                args = (st, state.k, state.v, lengths, row)
                sfi_row = programs.compiled(selection.sink_only_selection, args,
                                            dict(cfg=cfg, sfi=sfi, plan=None))[0](*args)
            else:
                args = (st, state.k, state.v, a.carry.window_q, lengths, row)
                sfi_row = programs.compiled(selection.prefill_selection, args,
                                            dict(sfi=sfi, options=self.options,
                                                 plan=None))[0](*args)
        logits = prefill.first_logits(self.params, a.carry.last_hidden, cfg=cfg)
        token, finite, controls = _first_token(logits, self._controls(a.handle.request))
        token = int(token[0])
        if not bool(finite):
            self._unpark(a)
            self.decoder.finish(a, "error", f"request {a.handle.id}: the prefill's logits are not "
                         "finite (NaN/inf); check the checkpoint and dtype")
            return
        max_tokens = a.handle.request.max_tokens
        ended = max_tokens <= 1 or token in self.eos_ids
        dec.state = _insert(dec.state, jnp.int32(a.slot), sfi_row, jnp.int32(n),
                            jnp.int32(token), controls, jnp.bool_(ended))
        if dec.counts is not None:
            dec.counts = _insert_counts(dec.counts, jnp.int32(a.slot),
                                        jnp.int32(0 if ended else max_tokens - 1))
        a.carry = a.tokens = None
        dec.enter(a, token, device_done=ended)

