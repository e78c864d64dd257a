"""Helpers of the server tests. The server under test runs in this process (uvicorn in a
thread, on a free port of 127.0.0.1). `FakeEngine` follows the Engine's contract with
controllable timing and no model: its tokens are the prompt's characters again, cyclically, one
character per token; it tests the HTTP layer alone (queue overflow, disconnects, a failing
request)."""

from __future__ import annotations

import collections
import contextlib
import itertools
import socket
import threading
import time

import pytest

import sfi_jax

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from sfi_jax.serve.cli import make_server  # noqa: E402


class CharTokenizer:
    """One token per character (id = code point); a chat template that tags each role."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def echo_text(prompt: str, n: int) -> str:
    """What FakeEngine generates for `prompt` in n tokens: its characters again, cyclically."""
    return "".join(itertools.islice(itertools.cycle(prompt), n))


class FakeHandle:
    def __init__(self, hid, req, prompt_tokens, on_event):
        self.id, self.request, self.prompt_tokens = hid, req, prompt_tokens
        self.on_event = on_event
        self.produced = 0
        self.text = ""  # all text so far (sent + held back)
        self.sent = 0  # characters of .text sent
        self.cancelled = False
        self.finish_reason = None
        self.done = threading.Event()


class FakeEngine:
    """The Engine contract without a model: `max_slots` slots, a queue of `max_queue`, one
    decode chunk of `chunk_steps` tokens per slot every `step_s` seconds. A prompt with FAIL
    in it finishes with an error after its first chunk; one with RAISE makes submit raise a
    plain exception (a fault of the server's own)."""

    def __init__(self, *, max_slots=2, max_len=256, max_queue=4, chunk_steps=4, step_s=0.01):
        self.tokenizer = CharTokenizer()
        self.model_name = "fake"
        self.mode = "sfi"
        self.max_slots, self.max_len, self.max_queue = max_slots, max_len, max_queue
        self.chunk_steps, self.step_s = chunk_steps, step_s
        self.observers = []
        self.waiting = collections.deque()
        self.active = []
        self.cancelled_ids = []
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.thread = None
        self.stopping = threading.Event()
        self.finished = 0
        self.generated = 0

    # --- the contract ---
    def start(self):
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, daemon=True)
            self.thread.start()

    def stop(self, drain=True):
        self.stopping.set()
        if not drain:
            with self.lock:
                for h in list(self.waiting) + self.active:
                    h.cancelled = True
        if self.thread is not None:
            self.thread.join(timeout=30)

    def submit(self, req, on_event=None):
        if self.stopping.is_set():
            raise RuntimeError("the engine is stopped")
        prompt = req.prompt
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        if "RAISE" in self.tokenizer.decode(ids):
            raise KeyError("a fault inside submit")
        if not ids:
            raise sfi_jax.RequestError("prompt", "prompt is empty")
        if len(ids) + req.max_tokens > self.max_len:
            raise sfi_jax.RequestError(
                "max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) = "
                              f"{len(ids) + req.max_tokens} is over max_len {self.max_len}")
        with self.lock:
            if len(self.waiting) >= self.max_queue:
                raise sfi_jax.QueueFull(f"{len(self.waiting)} requests wait already",
                                        retry_after=2.5)
            h = FakeHandle(str(next(self.ids)), req, ids, on_event)
            h.t0 = time.perf_counter()
            self.waiting.append(h)
        return h

    def cancel(self, handle):
        handle.cancelled = True

    def metrics(self):
        with self.lock:
            return {"queue_length": len(self.waiting), "active_slots": len(self.active),
                    "max_slots": self.max_slots, "requests_finished": self.finished,
                    "tokens_generated": self.generated, "slow_steps": 0, "fast_steps": 0,
                    "decode_tokens_per_s": 0.0}

    # --- the scheduler ---
    def _emit(self, h, ids, text, finish=None, error=None):
        ev = sfi_jax.TokenEvent(ids, text, finish, error)
        if h.on_event is not None:
            h.on_event(ev)
        if finish is not None:
            h.finish_reason = finish
            h.done.set()

    def _step(self, h):
        req = h.request
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        new = []
        for _ in range(self.chunk_steps):
            tok = h.prompt_tokens[h.produced % len(h.prompt_tokens)]
            h.produced += 1
            new.append(tok)
            h.text += chr(tok)
            hit = [h.text.find(s, max(0, h.sent - len(s))) for s in stops]
            hit = [i for i in hit if i >= 0]
            if hit:
                h.text = h.text[:min(hit)]
                return new, "stop"
            if h.produced >= req.max_tokens:
                return new, "length"
        return new, None

    def _loop(self):
        while True:
            with self.lock:
                if self.stopping.is_set() and not self.waiting and not self.active:
                    return
                while self.waiting and len(self.active) < self.max_slots:
                    self.active.append(self.waiting.popleft())
                batch = list(self.active)
            time.sleep(self.step_s)
            for h in batch:
                if h.cancelled:
                    self.cancelled_ids.append(h.id)
                    self._emit(h, [], "", "cancelled")
                elif "FAIL" in self.tokenizer.decode(h.prompt_tokens) and h.produced:
                    self._emit(h, [], "", "error", "non-finite logits in this row")
                else:
                    first = h.produced == 0
                    new, finish = self._step(h)
                    stops = h.request.stop or []
                    hold = 0 if finish else max([len(s) for s in
                                                 ([stops] if isinstance(stops, str) else stops)],
                                                default=1) - 1
                    upto = max(h.sent, len(h.text) - hold)
                    text, h.sent = h.text[h.sent:upto], upto
                    self.generated += len(new)
                    if first:
                        for f in self.observers:
                            f("ttft_s", time.perf_counter() - h.t0)
                    else:
                        for f in self.observers:
                            f("itl_s", self.step_s / len(new))
                    self._emit(h, new, text, finish)
                if h.finish_reason is not None:
                    with self.lock:
                        self.active.remove(h)
                        self.finished += 1
                    for f in self.observers:
                        f("e2e_s", time.perf_counter() - h.t0)


def free_port() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


@contextlib.contextmanager
def running_server(app, start_timeout=300.0):
    """Serve `app` on a free port of 127.0.0.1 from a thread; yields the base URL. Stopped (and
    joined) when the block ends."""
    sock = free_port()
    port = sock.getsockname()[1]
    server = make_server(app, log_level="warning", timeout_graceful_shutdown=5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        assert thread.is_alive(), "the server thread ended during start-up"
        assert time.monotonic() < deadline, "the server did not start in time"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def openai_client(url):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
