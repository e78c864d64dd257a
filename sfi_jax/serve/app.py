"""The FastAPI application over one `sfi_jax.Engine`: OpenAI's completions and chat completions
(whole or as server-sent events), models, health and Prometheus metrics.

The Engine runs its own scheduler thread. Each request gets an asyncio.Queue; the Engine's
per-request callback hands events over with `loop.call_soon_threadsafe` (no thread per
request). A client that goes away cancels its request, which frees its slot."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sfi_jax import QueueFull, RequestError
from sfi_jax import Request as EngineRequest
from sfi_jax.runtime.mode import Mode
from sfi_jax.serve.metrics import ServerMetrics
from sfi_jax.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse

log = logging.getLogger("sfi_jax.serve")
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
# how often a non-streamed request looks whether its client is still there, seconds
DISCONNECT_POLL_S = 0.25


class _CountRequests:
    """ASGI middleware: requests answered, by route and status (counts streamed answers too)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def _fails_alone(route):
    """A fault while answering one request is that request's 500 (logged), never the
    server's: the connection and the other requests go on."""

    @functools.wraps(route)
    async def guarded(request: Request):
        try:
            return await route(request)
        except APIError:
            raise
        except Exception as e:
            log.exception("request failed")
            raise APIError(500, f"internal error: {type(e).__name__}: {e}") from None

    return guarded


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Server:
    """What the routes share: the engine, its metrics and whether new requests are admitted."""

    def __init__(self, engine, served_model_name: str):
        self.engine, self.name = engine, served_model_name
        self.metrics = ServerMetrics(engine)
        self.accepting = True
        self.live: dict = {}  # the handles of the requests being answered
        self.created = int(time.time())

    async def drain(self, timeout: float) -> None:
        """Stop admitting (503); let the running requests finish for up to `timeout` seconds,
        then cancel the rest, whose answers end with an error (a stream's last event)."""
        self.accepting = False
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.live and loop.time() < end:
            await asyncio.sleep(0.05)
        for handle in list(self.live.values()):
            if handle is not None:
                self.engine.cancel(handle)
        end = loop.time() + 10.0  # a cancel takes effect within one decode chunk
        while self.live and loop.time() < end:
            await asyncio.sleep(0.05)

    # --- submitting and following one request ---------------------------------------------

    async def submit(self, body, prompt, max_tokens: int):
        """Submit to the engine; returns (handle, queue of its events). The engine validates
        and tokenises in a worker thread, so that a long prompt does not hold up the streams
        of the other requests."""
        if not self.accepting:
            raise APIError(503, "the server is shutting down and admits no new requests")
        if body.model is not None and body.model != self.name:
            raise APIError(404, f"model '{body.model}' does not exist; this server serves "
                                f"'{self.name}'", "model")
        temperature = body.temperature
        if temperature is None:  # OpenAI's default, except where the engine serves greedy only
            temperature = 0.0 if getattr(self.engine, "mode", None) == Mode.EXACT else 1.0
        req = EngineRequest(prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                            top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                            stop=body.stop_list(), stop_token_ids=body.stop_token_ids)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        key = object()  # this request in self.live, before its handle exists

        def deliver(event):  # the event loop's thread
            queue.put_nowait(event)
            if event.finish_reason is not None:
                self.live.pop(key, None)

        def on_event(event):  # the engine's thread
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                loop.call_soon_threadsafe(deliver, event)

        self.live[key] = None
        try:
            handle = await asyncio.to_thread(self.engine.submit, req, on_event=on_event)
        except BaseException as e:
            self.live.pop(key, None)
            if isinstance(e, RequestError):
                raise APIError(400, str(e), getattr(e, "field", None)) from None
            if isinstance(e, QueueFull):
                wait = max(1, math.ceil(getattr(e, "retry_after", 1) or 1))
                raise APIError(429, f"{e}; retry after {wait} s",
                               headers={"Retry-After": str(wait)}) from None
            if isinstance(e, RuntimeError):  # the engine stopped
                raise APIError(503, f"the engine is not running: {e}") from None
            raise
        if key in self.live:  # (not finished already)
            self.live[key] = handle
        self.metrics.prompt_tokens.inc(len(handle.prompt_tokens))
        return handle, queue

    async def events(self, handle, queue, request: Request | None):
        """The request's events until it finishes. With `request` (a non-streamed answer), a
        client that went away cancels it; a streamed answer is cancelled by its generator's
        exit instead."""
        loop = asyncio.get_running_loop()
        look = loop.time() + DISCONNECT_POLL_S
        get = None  # one pending queue.get() at a time: a cancelled get could lose an event
        try:
            while True:
                if get is None:
                    get = asyncio.ensure_future(queue.get())
                if request is None:
                    await asyncio.wait({get})
                else:
                    await asyncio.wait({get}, timeout=max(0.0, look - loop.time()))
                    if loop.time() >= look:
                        look = loop.time() + DISCONNECT_POLL_S
                        if await request.is_disconnected():
                            self.engine.cancel(handle)
                            request = None  # the cancelled event ends the loop
                if not get.done():
                    continue
                event, get = get.result(), None
                self.metrics.completion_tokens.inc(len(event.token_ids))
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if get is not None:
                get.cancel()

    @staticmethod
    def failure(event) -> APIError | None:
        """The error a finished request's last event stands for, if any."""
        if event.finish_reason == "error":
            return APIError(500, f"the request failed: {event.error or 'unknown error'}")
        if event.finish_reason == "cancelled":
            return APIError(503, "the request was cancelled (the client went away or the "
                                 "server is shutting down)")
        return None

    @staticmethod
    def usage(handle, completion_tokens: int) -> dict:
        n = len(handle.prompt_tokens)
        return {"prompt_tokens": n, "completion_tokens": completion_tokens,
                "total_tokens": n + completion_tokens}

    # --- the two endpoints' answers -----------------------------------------------------

    async def answer(self, request: Request, body, prompt, max_tokens: int, chat: bool):
        handle, queue = await self.submit(body, prompt, max_tokens)
        kind = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + str(handle.id)
        head = {"id": rid, "object": kind, "created": int(time.time()), "model": self.name}
        if body.stream:
            return StreamingResponse(self.stream(handle, queue, body, head, chat),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        parts, n = [], 0
        try:
            async for event in self.events(handle, queue, request):
                parts.append(event.text)
                n += len(event.token_ids)
        except BaseException:  # cancelled (the server stops) or a fault here: free the slot
            self.engine.cancel(handle)
            raise
        err = self.failure(event)
        if err is not None:
            raise err
        text = "".join(parts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "logprobs": None, "finish_reason": event.finish_reason} if chat else
                  {"index": 0, "text": text, "logprobs": None,
                   "finish_reason": event.finish_reason})
        return JSONResponse({**head, "choices": [choice], "usage": self.usage(handle, n)})

    async def stream(self, handle, queue, body, head, chat: bool):
        """Server-sent events in OpenAI's format: chunks, [usage], then [DONE]. An exit before
        the request finished (the client went away) cancels it."""
        opts = body.stream_options
        every = bool(opts and opts.continuous_usage_stats)
        final_usage = bool(opts and (opts.include_usage or opts.continuous_usage_stats))
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {**head, "object": kind}
        n, finished = 0, False

        def chunk(text, finish_reason=None, first=False):
            if chat:
                delta = {"role": "assistant", "content": text} if first else (
                    {"content": text} if text or finish_reason is None else {})
                choice = {"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": None,
                          "finish_reason": finish_reason}
            out = {**head, "choices": [choice]}
            if every:
                out["usage"] = self.usage(handle, n)
            return _sse(out)

        try:
            if chat:
                yield chunk("", first=True)
            async for event in self.events(handle, queue, None):
                n += len(event.token_ids)
                if event.finish_reason is None:
                    if event.text or (every and event.token_ids):
                        yield chunk(event.text)
                    continue
                finished = True
                err = self.failure(event)
                if err is not None:
                    yield _sse(err.body())
                    break
                yield chunk(event.text, event.finish_reason)
                if final_usage:
                    yield _sse({**head, "choices": [], "usage": self.usage(handle, n)})
            yield "data: [DONE]\n\n"
        except Exception as e:  # a fault in this request only: its stream says so and ends
            log.exception("request %s failed", handle.id)
            if not finished:
                self.engine.cancel(handle)
                finished = True
            yield _sse(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the server is stopping)
                self.engine.cancel(handle)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "messages: this model has no tokenizer (random weights); use "
                           "/v1/completions with the prompt as token ids", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # no template, or one that rejects this conversation
            raise APIError(400, f"messages: the chat template cannot format them: {e}",
                           "messages") from None
        return list(tok(text, add_special_tokens=False)["input_ids"])


def warm_up(engine, lengths="all", timeout: float = 600.0) -> None:
    """Requests through the engine before the server says it is ready, so that their programs
    are compiled: one of each prompt length in `engine.warmup_lengths()` ("all": no request
    meets a compile later), or only the shortest ("first": a quicker start; a longer prompt
    compiles its prefill when it first comes)."""
    every = getattr(engine, "warmup_lengths", lambda: [1])()
    for n in every if lengths == "all" else every[:1]:
        handle = engine.submit(EngineRequest(prompt=[0] * n, max_tokens=2, temperature=0.0))
        result = handle.result(timeout=timeout)
        if result.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"the warm-up request of {n} tokens ended with "
                               f"{result.finish_reason}: {result.error}")


def create_app(engine, *, served_model_name: str | None = None, warmup: str | None = None
               ) -> FastAPI:
    """The application over `engine` (an `sfi_jax.Engine` or an object with its interface).
    Its lifespan starts the engine (and with `warmup`, "all" or "first", compiles its
    programs: `warm_up`), and at shutdown
    stops admitting and cancels what is still running (uvicorn waits for running requests
    first, up to its graceful-shutdown timeout)."""
    server = _Server(engine, served_model_name or engine.model_name)
    warm_lengths = {True: "all", False: None, "none": None}.get(warmup, warmup)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        if warm_lengths:
            await asyncio.to_thread(warm_up, engine, warm_lengths)
        yield
        server.accepting = False
        await asyncio.to_thread(engine.stop, drain=False)

    app = FastAPI(title="sfi_jax", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    app.add_middleware(_CountRequests, metrics=server.metrics)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _error_response(e)

    @app.post("/v1/completions")
    @_fails_alone
    async def completions(request: Request):
        body = parse(await request.body(), CompletionRequest)
        budget = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        return await server.answer(request, body, body.prompt, budget, chat=False)

    @app.post("/v1/chat/completions")
    @_fails_alone
    async def chat_completions(request: Request):
        body = parse(await request.body(), ChatCompletionRequest)
        ids = await asyncio.to_thread(server.chat_prompt, body)  # (tokenising takes a while)
        budget = body.token_budget() or max(1, engine.max_len - len(ids))
        return await server.answer(request, body, ids, budget, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": server.name, "object": "model", "created": server.created,
             "owned_by": "sfi_jax", "max_model_len": engine.max_len}]}

    @app.get("/health")
    async def health():
        if not server.accepting:
            raise APIError(503, "the server is shutting down")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app
