"""What a caller hands the engine and gets back: a `Request`, its `RequestHandle` (events and
result), the `TokenEvent`s it streams, its `RequestResult`; the errors that refuse one; and the
incremental detokenisation that streams text (`TextStream`)."""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
from typing import Callable

class RequestError(ValueError):
    """A request the engine refuses; `field` names the offending parameter."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class QueueFull(RuntimeError):
    """Too many requests wait already; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


@dataclasses.dataclass
class Request:
    """One generation request. prompt: text (needs the engine's tokenizer) or token ids.
    seed None: a fresh seed per request. stop: strings that end the text (not included);
    stop_token_ids: ids that end it (not included)."""

    prompt: str | list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None


@dataclasses.dataclass
class TokenEvent:
    """New tokens of one request: ids and the text they complete (never a partial character,
    and never text that may still turn out to start a stop string). The last event of a
    request has its finish_reason ("stop", "length", "cancelled" or "error", with `error`)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None


@dataclasses.dataclass
class RequestResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    ttft_s: float | None = None
    stats: dict = dataclasses.field(default_factory=dict)


class RequestHandle:
    """A submitted request: iterate it for its `TokenEvent`s, or wait for `result()`."""

    def __init__(self, request_id: str, request: Request, prompt_tokens: list[int],
                 on_event: Callable[[TokenEvent], None] | None):
        self.id = request_id
        self.request = request
        self.prompt_tokens = prompt_tokens
        self.on_event = on_event
        self._events: queue.Queue = queue.Queue()
        self._finished = threading.Event()
        self._result: RequestResult | None = None
        self.cancelled = False

    def _emit(self, event: TokenEvent):
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception as e:  # a broken listener fails its own request only
                print(f"sfi_jax.Engine: request {self.id}'s event callback raised {e!r}",
                      file=sys.stderr)
        self._events.put(event)

    def __iter__(self):
        while True:
            event = self._events.get()
            yield event
            if event.finish_reason is not None:
                return

    def result(self, timeout: float | None = None) -> RequestResult:
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        return self._result

    @property
    def done(self) -> bool:
        return self._finished.is_set()


class TextStream:
    """Incremental detokenisation with stop strings: the text of all ids so far, released up to
    the last complete character and short of any text that could still begin a stop string."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0
        self.text = ""

    def update(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """(new text to send, whether a stop string ended the text)."""
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stopped = False
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                text, stopped = text[:at], True
        self.text = text
        end = len(text)
        if not (final or stopped):
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1  # a character whose bytes have not all arrived
            end = max(self.sent, end - self.hold)
        new = text[self.sent:end]
        self.sent = end
        return new, stopped
