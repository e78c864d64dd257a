"""The HTTP layer over a fake engine (serve_support.FakeEngine, whose output is known in advance:
the prompt's characters again): OpenAI's shapes through the official client, streaming,
stop strings, every bad input's 400, overflow's 429, disconnects and shutdown cancelling their
requests, one failing request leaving the server serving, and /metrics."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from serve_support import FakeEngine, echo_text, openai_client, running_server  # noqa: E402

from sfi_jax.serve import create_app  # noqa: E402



@pytest.fixture(scope="module")
def served():
    engine = FakeEngine(max_slots=2, max_len=256, max_queue=8, chunk_steps=3, step_s=0.005)
    with running_server(create_app(engine, served_model_name="fake")) as (url, server):
        yield url, engine, server


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_completion_text_usage_and_stream(served):
    url, _, _ = served
    client = openai_client(url)
    for prompt, n in (("The sky is blue.", 7), ("ab", 10), ("x" * 30, 1)):
        want = echo_text(prompt, n)
        r = client.completions.create(model="fake", prompt=prompt, max_tokens=n, temperature=0)
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason == "length"
        assert r.object == "text_completion" and r.model == "fake"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
            len(prompt), n, len(prompt) + n)
        chunks = list(client.completions.create(model="fake", prompt=prompt, max_tokens=n,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].usage.completion_tokens == n and not chunks[-1].choices
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompts(served):
    url, _, _ = served
    client = openai_client(url)
    ids = [ord(c) for c in "hello"]
    for prompt in (ids, [ids]):
        r = client.completions.create(model="fake", prompt=prompt, max_tokens=8)
        assert r.choices[0].text == echo_text("hello", 8)
        assert r.usage.prompt_tokens == 5
    r = client.completions.create(model="fake", prompt=["hello"], max_tokens=3)
    assert r.choices[0].text == "hel"


def test_chat_uses_the_template(served):
    url, engine, _ = served
    client = openai_client(url)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    templated = engine.tokenizer.apply_chat_template(messages)
    r = client.chat.completions.create(model="fake", messages=messages, max_tokens=12)
    assert r.choices[0].message.content == echo_text(templated, 12)
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(templated)
    r2 = client.chat.completions.create(model="fake", messages=messages,
                                        max_completion_tokens=5)
    assert r2.choices[0].message.content == echo_text(templated, 5)
    chunks = list(client.chat.completions.create(model="fake", messages=messages, max_tokens=12,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == echo_text(templated, 12)
    # no max_tokens: up to max_len
    r3 = client.chat.completions.create(model="fake", messages=messages)
    assert r3.usage.completion_tokens == engine.max_len - len(templated)


def test_chat_without_a_tokenizer_is_a_400(served):
    """A random-weight model has no tokenizer: chat names the field, the server goes on."""
    url, engine, _ = served
    tokenizer, engine.tokenizer = engine.tokenizer, None
    try:
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    finally:
        engine.tokenizer = tokenizer
    assert r.status_code == 400, r.text
    assert "no tokenizer" in r.text and "messages" in r.text
    assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("stop,want", [("def", "abc"), (["zz", "fg"], "abcde"),
                                       (["h", "cd"], "ab"), ("q", None)])
def test_stop_strings(served, stop, want):
    url, _, _ = served
    client = openai_client(url)
    prompt = "abcdefgh"
    r = client.completions.create(model="fake", prompt=prompt, max_tokens=12, stop=stop)
    expect = want if want is not None else echo_text(prompt, 12)
    assert r.choices[0].text == expect
    assert r.choices[0].finish_reason == ("stop" if want is not None else "length")
    s = client.completions.create(model="fake", prompt=prompt, max_tokens=12, stop=stop,
                                  stream=True)
    assert "".join(c.choices[0].text for c in s) == expect


BAD = [  # (endpoint, body, the field the 400 names)
    ("completions", b"{not json", None),
    ("completions", b"[1, 2]", None),
    ("completions", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ("completions", {"max_tokens": 3}, "prompt"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": [1.5, 2]}, "prompt"),
    ("completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -1}, "top_k"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 300}, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 2}, "n"),
    ("completions", {"prompt": "hi", "logprobs": 1}, "logprobs"),
    ("completions", {"prompt": "hi", "echo": True}, "echo"),
    ("completions", {"prompt": "hi", "stop": ["a", ""]}, "stop"),
    ("completions", {"prompt": "hi", "seed": "x"}, "seed"),
    ("completions", {"prompt": "hi", "stream": True, "stream_options": {"x": 1}},
     "stream_options"),
    ("completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True},
     "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": []},
     "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": -1}, "max_completion_tokens"),
]


def test_bad_inputs_get_400_naming_the_field(served):
    url, engine, _ = served
    with httpx.Client(base_url=url, timeout=30) as http:
        for endpoint, body, field in BAD:
            if isinstance(body, bytes):
                r = http.post(f"/v1/{endpoint}", content=body,
                              headers={"content-type": "application/json"})
            else:
                r = http.post(f"/v1/{endpoint}", json=body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == field, (body, err)
            assert "\n" not in err["message"] and err["message"], err
            if field is not None:
                assert field in err["message"], err
        # the over-long request names both numbers (the engine's RequestError)
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 300})
        assert "300" in r.json()["error"]["message"] and "256" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": "hi", "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        # accepted and ignored: user; the server still serves
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "user": "u"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hihi"
        # max_tokens null or absent: OpenAI's 16
        for body in ({"prompt": "hi", "max_tokens": None}, {"prompt": "hi"}):
            assert http.post("/v1/completions", json=body).json()["usage"][
                "completion_tokens"] == 16
    assert engine.metrics()["queue_length"] == 0


def test_a_failing_request_fails_alone(served):
    url, _, _ = served
    client = openai_client(url)
    with pytest.raises(openai.InternalServerError, match="non-finite"):
        client.completions.create(model="fake", prompt="FAIL here", max_tokens=20)
    with pytest.raises(openai.APIError, match="non-finite"):
        list(client.completions.create(model="fake", prompt="FAIL here", max_tokens=20,
                                       stream=True))
    with pytest.raises(openai.InternalServerError, match="KeyError"):
        client.completions.create(model="fake", prompt="RAISE", max_tokens=2)
    r = client.completions.create(model="fake", prompt="still here", max_tokens=4)
    assert r.choices[0].text == "stil"


def test_disconnects_cancel_their_requests():
    engine = FakeEngine(max_slots=1, max_len=10_000, max_queue=4, chunk_steps=1, step_s=0.02)
    with running_server(create_app(engine)) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as http:
            body = {"prompt": "long", "max_tokens": 5000, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["text"]
            # the client closed the stream: the server cancels the request, the slot frees
            wait_until(lambda: len(engine.cancelled_ids) == 1)
            wait_until(lambda: engine.metrics()["active_slots"] == 0)
            # a non-streamed request whose client gives up
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json={**body, "stream": False}, timeout=0.3)
            wait_until(lambda: len(engine.cancelled_ids) == 2)
            wait_until(lambda: engine.metrics()["active_slots"] == 0)
            r = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
            assert r.json()["choices"][0]["text"] == "ok"


def test_full_queue_gets_429_with_retry_after():
    engine = FakeEngine(max_slots=1, max_len=10_000, max_queue=1, chunk_steps=1, step_s=0.02)
    with running_server(create_app(engine)) as (url, _):
        body = {"prompt": "wait", "max_tokens": 5000, "stream": True}
        with httpx.Client(base_url=url, timeout=30) as a, httpx.Client(base_url=url,
                                                                       timeout=30) as b:
            with a.stream("POST", "/v1/completions", json=body) as running:
                wait_until(lambda: engine.metrics()["active_slots"] == 1)
                with b.stream("POST", "/v1/completions", json=body) as queued:
                    wait_until(lambda: engine.metrics()["queue_length"] == 1)
                    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
                    assert r.status_code == 429, r.text
                    assert r.headers["retry-after"] == "3"  # 2.5 s, whole seconds up
                    assert r.json()["error"]["type"] == "rate_limit_error"
                    with pytest.raises(openai.RateLimitError):
                        openai_client(url).completions.create(model="fake", prompt="x",
                                                              max_tokens=1)
                    assert queued.status_code == 200
                assert running.status_code == 200
            wait_until(lambda: engine.metrics()["active_slots"] == 0)
            wait_until(lambda: engine.metrics()["queue_length"] == 0)
            r = httpx.post(url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2})
            assert r.status_code == 200


def test_shutdown_stops_admitting_and_cancels_what_runs():
    engine = FakeEngine(max_slots=1, max_len=10_000, max_queue=4, chunk_steps=1, step_s=0.02)
    app = create_app(engine)
    got = {}

    with running_server(app) as (url, server):
        server.config.timeout_graceful_shutdown = 0.5

        def read_stream():
            with httpx.stream("POST", url + "/v1/completions", timeout=30,
                              json={"prompt": "run", "max_tokens": 5000, "stream": True}) as r:
                got["lines"] = [line for line in r.iter_lines() if line]

        reader = threading.Thread(target=read_stream)
        reader.start()
        wait_until(lambda: engine.metrics()["active_slots"] == 1)
        app.state.server.accepting = False  # what the server's shutdown does first
        r = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503
    reader.join(timeout=30)
    assert not reader.is_alive()
    assert engine.stopping.is_set() and len(engine.cancelled_ids) == 1
    # the cancelled stream ended cleanly: its chunks, an error event, then [DONE]
    assert got["lines"][0].startswith("data: ") and got["lines"][-1] == "data: [DONE]"
    assert "shutting down" in json.loads(got["lines"][-2][6:])["error"]["message"]


def test_models_health_and_metrics(served):
    from prometheus_client.parser import text_string_to_metric_families

    url, engine, _ = served
    client = openai_client(url)
    assert [m.id for m in client.models.list()] == ["fake"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    client.completions.create(model="fake", prompt="count me", max_tokens=6)
    httpx.post(url + "/v1/completions", json={"prompt": "hi", "n": 3})
    text = httpx.get(url + "/metrics").text
    fam = {f.name: f for f in text_string_to_metric_families(text)}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in fam.values() for s in f.samples}
    for gauge in ("sfi_jax_queue_length", "sfi_jax_active_slots", "sfi_jax_max_slots",
                  "sfi_jax_decode_tokens_per_s"):
        assert fam[gauge].type == "gauge", gauge
    assert value[("sfi_jax_max_slots", ())] == engine.max_slots
    assert fam["sfi_jax_engine_slow_steps"].type == "counter"
    assert value[("sfi_jax_engine_tokens_generated_total", ())] == engine.generated
    ok = value[("sfi_jax_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))]
    bad = value[("sfi_jax_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))]
    assert ok >= 1 and bad >= 1
    finished = value[("sfi_jax_engine_requests_finished_total", ())]
    assert value[("sfi_jax_time_to_first_token_seconds_count", ())] == finished
    assert value[("sfi_jax_e2e_request_latency_seconds_count", ())] == finished
    assert value[("sfi_jax_inter_token_latency_seconds_count", ())] > 0
    assert value[("sfi_jax_completion_tokens_total", ())] >= 6
