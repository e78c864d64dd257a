"""The one decode loop: requests in the rows ("slots") of one `DecodeState`, decoded together.

`SlotDecoder.step()` runs every slot for one chunk of decode steps in one device call
(`decode.decode_chunk`, or exact mode's `exact.exact_chunk`), hands each request its new
tokens, ends a request on EOS, a stop token id or string, its token budget, a cancel or a
non-finite row, and keeps the counts. The Engine fills the slots one request at a time (its
scheduler prefills and inserts them); `generate` fills slots 0..B-1 with one batched prefill
and steps until every row has ended. Both decode here, and nowhere else.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sfi_jax.runtime import decode, exact, prefill, programs
from sfi_jax.runtime.mode import Mode
from sfi_jax.runtime.requests import RequestHandle, RequestResult, TextStream, TokenEvent
from sfi_jax.runtime.sampling import SamplingConfig
from sfi_jax.runtime.state import DecodeState


@dataclasses.dataclass
class Active:
    """A request in a slot (or on its way into one). live_text: stream text with every event
    (else the text is decoded once, when the request ends)."""

    handle: RequestHandle
    slot: int
    ids: list[int]
    stream: TextStream
    t_submit: float
    live_text: bool = True
    generated: list = dataclasses.field(default_factory=list)
    t_first: float | None = None
    t_last: float | None = None
    # the Engine's prefill progress
    tokens: np.ndarray | None = None
    start: int = 0
    carry: prefill.PrefillCarry | None = None
    chunk: int = 0


@functools.partial(jax.jit, donate_argnames=("state", "counts"))
def _release(state: DecodeState, counts, free, length):
    """Rows in `free` (bool [B]) end: done, no budget, at length `length` (each decode step
    writes an idle row's key there: 0, or a parked row's last position)."""
    rows = state.rows
    if rows is not None:
        rows = rows._replace(remaining=jnp.where(free, 0, rows.remaining))
    if counts is not None:
        counts = counts._replace(remaining=jnp.where(free, 0, counts.remaining))
    return state._replace(done=state.done | free,
                          lengths=jnp.where(free, length, state.lengths), rows=rows), counts


class SlotDecoder:
    """Requests in the slots of `state` (a `DecodeState` over B rows), decoded chunk by chunk.

    mode "sfi"/"dense" runs `decode_chunk` (n = chunk_steps steps; state.rows None: one
    static `sampling` for every row and the host caps a chunk at the rows' budget), mode
    "exact" runs `exact_chunk` (a budget of chunk_steps // (draft_len + 1) rounds' worth of
    steps, a plain dense step counting one; `counts` holds its
    per-row bookkeeping and budgets). In mode "sfi" a chunk runs the dense program instead
    when every active request fits the SFI budget until its end (`fits`): SFI reads every
    position of such a row, so it is dense decoding (dense_within_budget=False: always the SFI
    program). eos_mask, trigger_mask: bool [vocab] on the device.
    stop_ids: token ids that end a request (kept in its tokens); hidden_ids: ids never in its
    text. forced: [B, max tokens] teacher-forced ids (-1 = sample). record: keep the per-chunk
    slow flags, logits (return_logits) and diagnostics (when state.diag is set) for the
    caller's stats. strict: a non-finite row raises FloatingPointError (else that request
    alone ends with an error). on_chunk(new ids per slot) is called after each chunk.
    """

    def __init__(self, *, params, cfg, mode: Mode, sfi, options, state: DecodeState, counts,
                 eos_mask, trigger_mask, stop_ids, hidden_ids, chunk_steps: int,
                 sampling: SamplingConfig = SamplingConfig(), plan=None, put=jnp.asarray,
                 forced=None, return_logits: bool = False, accept_rate: float | None = None,
                 record: bool = False, strict: bool = False,
                 lock: threading.Condition | None = None,
                 observe: Callable[[str, float], None] | None = None,
                 on_chunk: Callable[[list[list[int]]], None] | None = None):
        self.params, self.cfg, self.mode, self.sfi, self.options = params, cfg, mode, sfi, options
        self.state, self.counts = state, counts
        self.eos_mask, self.trigger_mask = eos_mask, trigger_mask
        self.stop_ids, self.hidden_ids = set(stop_ids), set(hidden_ids)
        self.chunk_steps, self.sampling, self.plan, self.put = chunk_steps, sampling, plan, put
        self.forced, self.return_logits, self.accept_rate = forced, return_logits, accept_rate
        self.record, self.strict = record, strict
        self.lock = lock if lock is not None else threading.Condition()
        self.observe = observe or (lambda kind, value: None)
        self.on_chunk = on_chunk
        B = state.token.shape[0]
        self.slots: list[Active | None] = [None] * B
        self.released = np.ones((B,), bool)  # the device row is idle (done, no budget)
        self.tally = collections.Counter()
        self.rate = collections.deque(maxlen=32)  # (tokens, seconds) of recent decode calls
        self.steps = 0  # decode steps (exact mode: rounds) taken
        self.compile_s = 0.0
        self.slow, self.logits, self.diag = [], [], []  # per chunk, with record
        self.dense_within_budget = True  # False: mode sfi runs the SFI program alone, as before
        self.dense_steps = np.zeros((B,), np.int64)  # per slot: steps of the dense program
        # the mode the rows decode in (sfi within its budget decodes densely)
        self.label = str(Mode.DENSE if sfi is None else mode)

    @property
    def batch(self) -> int:
        return len(self.slots)

    def active(self) -> bool:
        return any(a is not None for a in self.slots)

    def enter(self, a: Active, token: int, device_done: bool):
        """Request `a`, its row already on the device in slot a.slot, starts with its first
        token (device_done: the device row has ended already)."""
        a.t_first = time.perf_counter()
        self.observe("ttft_s", a.t_first - a.t_submit)
        self.released[a.slot] = False
        self.dense_steps[a.slot] = 0
        with self.lock:
            self.slots[a.slot] = a
        self.deliver(a, [token], device_done=device_done)

    def release_ended(self):
        """Cancelled requests end; the device rows of slots freed since the last call (ended
        on the host: stop strings, budgets, cancels) go idle."""
        free = np.zeros((self.batch,), bool)
        for slot, a in enumerate(self.slots):
            if a is not None and a.handle.cancelled:
                self.finish(a, "cancelled")
            free[slot] = self.slots[slot] is None
        free &= ~self.released
        if np.any(free):
            self.state, self.counts = _release(self.state, self.counts, self.put(free),
                                               jnp.int32(0))
            self.released |= free

    def park(self, slot: int, position: int):
        """Slot `slot`'s row idles at `position` (done, no budget) while a request is
        prefilled into the row: every decode step writes each row's key at its length, an
        idle row's too, so the row must idle where the prompt's cache is not."""
        free = np.zeros((self.batch,), bool)
        free[slot] = True
        self.state, self.counts = _release(self.state, self.counts, self.put(free),
                                           jnp.int32(position))
        self.released[slot] = True

    # ------------------------------------------------------------------ one chunk

    def step(self):
        """One device call for every slot; each request gets its new tokens."""
        dense = False
        if self.mode is Mode.EXACT:
            fn, statics = exact.exact_chunk, dict(
                cfg=self.cfg, sfi=self.sfi, sampling=self.sampling,
                n_rounds=max(1, self.chunk_steps // (self.sfi.draft_len + 1)),
                options=self.options)
            args = (self.params, self.state, self.counts, self.eos_mask, self.trigger_mask)
            if self.accept_rate is not None:  # (benchmarks) data, not a new program per rate
                args += (jnp.float32(self.accept_rate),)
        else:
            n = self._n_steps()
            dense = self.sfi is None or self._dense_chunk()
            self.tally["dense_chunks" if dense else "sfi_chunks"] += 1
            fn, statics = decode.decode_chunk, dict(
                cfg=self.cfg, sfi=None if dense else self.sfi, sampling=self.sampling,
                n_steps=n,
                options=self.options, return_logits=self.return_logits, plan=self.plan)
            args = (self.params, self.state, self.eos_mask, self.trigger_mask,
                    self.put(self._forced(n)))
        program, seconds = programs.compiled(fn, args, statics)
        self.compile_s += seconds
        t0 = time.perf_counter()
        if self.mode is Mode.EXACT:
            self.state, self.counts, toks, n_out, taken = program(*args)
            toks, n_out, taken = np.asarray(toks), np.asarray(n_out), int(taken)
            new = [toks[b, :n_out[b]].tolist() for b in range(self.batch)]
            slow = None
        else:
            self.state, toks, taken, slow, logits, diag = program(*args)
            toks, taken = np.asarray(toks), int(taken)
            new = [[int(t) for t in row[:taken] if t >= 0] for row in toks]
            slow = np.asarray(slow)[:, :taken]
            if self.record:
                self.slow.append(slow)
                if self.return_logits:
                    self.logits.append(np.asarray(logits)[:, :taken])
                if self.state.diag is not None:
                    self.diag.append(np.asarray(diag)[:, :, :taken])
        done, bad = np.asarray(self.state.done), np.asarray(self.state.nonfinite)
        dt = time.perf_counter() - t0
        self.steps += taken
        if self.strict and bad.any():
            row = int(np.flatnonzero(bad)[0])
            a = self.slots[row]
            step = (len(a.generated) if a is not None else 0) + len(new[row]) - 1
            raise FloatingPointError(
                f"row {row}: non-finite logits (NaN/inf) by decode step {step} in mode "
                f"{self.label!r} ({int(bad.sum())} row(s) affected); check the checkpoint and "
                "dtype")
        produced = 0
        for slot, a in enumerate(self.slots):
            if a is None:
                continue
            produced += len(new[slot])
            if slow is not None and dense:
                self.tally["dense_steps"] += len(new[slot])
                self.dense_steps[slot] += len(new[slot])
            elif slow is not None:
                n_slow = int(slow[slot].sum())
                self.tally["slow_steps"] += n_slow
                self.tally["fast_steps"] += len(new[slot]) - n_slow
            if bad[slot]:
                self.finish(a, "error", f"request {a.handle.id}: non-finite logits (NaN/inf) by "
                            f"decode step {len(a.generated) + len(new[slot]) - 1} (mode "
                            f"{self.label}); check the checkpoint and dtype")
                continue
            self.deliver(a, new[slot], device_done=bool(done[slot]))
        if taken:
            self.rate.append((produced, dt))
            if produced:
                self.observe("itl_s", dt / taken if self.mode is not Mode.EXACT
                             else dt * self.batch / produced)
        if self.on_chunk is not None:
            self.on_chunk(new)

    def fits(self, a: Active) -> bool:
        """Whether request `a` stays inside the SFI budget until its end: its last decode step
        feeds position prompt + max_tokens - 2, so its sink + selected + recent sets cover
        every position at every step (SFI_METHOD.md section 2) and it is dense decoding."""
        return len(a.ids) + a.handle.request.max_tokens <= self.sfi.budget

    def _dense_chunk(self) -> bool:
        """Mode "sfi": whether this chunk runs the dense program. Only when every active
        request fits, so that every row the SFI program ever runs for is still dense there:
        a fitting row reads no compact buffer in the SFI program (its c_len is hidden) and
        never reaches the budget's refresh, so what dense chunks leave out (compact buffers,
        selections, refresh bookkeeping) is never read for it; its key norms the dense
        program writes. A row that does not fit runs only in SFI chunks, from its insert on.
        Not with diagnostics (they measure the SFI program), nor on a mesh (there `generate`
        decides for the whole batch)."""
        if not self.dense_within_budget or self.state.diag is not None or \
                self.plan is not None:
            return False
        active = [a for a in self.slots if a is not None]
        return bool(active) and all(self.fits(a) for a in active)

    def _n_steps(self) -> int:
        """chunk_steps; without per-row budgets on the device (state.rows None), no more than
        the largest budget left, so that no row decodes past it."""
        if self.state.rows is not None:
            return self.chunk_steps
        left = max((a.handle.request.max_tokens - len(a.generated) for a in self.slots
                    if a is not None), default=1)
        return max(1, min(self.chunk_steps, left))

    def _forced(self, n: int) -> np.ndarray:
        forced = np.full((self.batch, n), -1, np.int32)
        if self.forced is not None:  # column 0 was the first token (from the prefill)
            got = self.forced[:, 1 + self.steps: 1 + self.steps + n]
            forced[:, :got.shape[1]] = got
        return forced

    # ------------------------------------------------------------------ ending requests

    def deliver(self, a: Active, new: list[int], device_done: bool):
        """Stream a request's new tokens; finish it on EOS, a stop token or string, or its
        budget."""
        request = a.handle.request
        finish = None
        stops = set(request.stop_token_ids or [])
        for i, t in enumerate(new):
            if t in stops:
                new, finish = new[:i], "stop"
                break
            if t in self.stop_ids:
                new, finish = new[:i + 1], "stop"
                break
        a.generated.extend(new)
        self.tally["tokens_generated"] += len(new)
        if finish is None and len(a.generated) >= request.max_tokens:
            a.generated, finish = a.generated[:request.max_tokens], "length"
        if finish is None and device_done:
            finish = "stop" if a.generated and a.generated[-1] in self.stop_ids else "length"
        text = ""
        if a.live_text or finish is not None:
            text_ids = [t for t in a.generated if t not in self.hidden_ids]
            text, stopped = a.stream.update(text_ids, final=finish is not None)
            if stopped:
                finish = "stop"
        a.t_last = time.perf_counter()
        if finish is None:
            if new or text:
                a.handle._emit(TokenEvent(new, text))
            return
        self.finish(a, finish, new_ids=new, text=text)

    def finish(self, a: Active, reason: str, error: str | None = None, new_ids=(), text=""):
        """End a request: its last event, its result, its slot freed."""
        if a.handle.done:
            return
        if reason != "error" and a.stream.tokenizer is not None and not text:
            text, _ = a.stream.update([t for t in a.generated if t not in self.hidden_ids],
                                      final=True)
        if a.slot >= 0 and self.slots[a.slot] is a:
            with self.lock:
                self.slots[a.slot] = None
        now = time.perf_counter()
        h = a.handle
        h._result = RequestResult(
            token_ids=list(a.generated), text=a.stream.text, finish_reason=reason,
            prompt_tokens=len(a.ids), completion_tokens=len(a.generated), error=error,
            ttft_s=None if a.t_first is None else a.t_first - a.t_submit,
            stats={"e2e_s": now - a.t_submit})
        self.tally["requests_finished"] += 1
        self.observe("e2e_s", now - a.t_submit)
        h._emit(TokenEvent(list(new_ids), text, reason, error))
        h._finished.set()
