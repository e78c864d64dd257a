"""The server over the real Engine on the embedded SmolLM2, through the official `openai` client:
greedy answers to requests that arrive apart (more than the slots) equal `generate()`'s text
for the same prompts, streamed or not; chat through the tokenizer's template; stop strings;
a disconnect frees its slot; the engine's own 400s; /metrics with the engine's counts."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from serve_support import openai_client, running_server

import sfi_jax
from sfi_jax.serve import create_app

SFI = sfi_jax.SFIConfig(n_sink=4, k_select=32, n_recent=16, t_max=8)
MAX_LEN = 256
PROMPTS = ["The capital of France is",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who",
           "def fibonacci(n):",
           "List three colours:",
           "Water boils at a temperature of",
           "The quick brown fox jumps over the lazy dog. The quick brown fox",
           "Explain in one sentence why the sky is blue.",
           "1, 2, 3, 4, 5,"]
BUDGETS = [16, 8, 12, 16, 5, 10, 14, 6]
CHAT = [{"role": "user", "content": "Name a large animal."}]
CHAT_BUDGET = 10


@pytest.fixture(scope="module")
def served(smol_model, smol_tokenizer):
    engine = sfi_jax.Engine(smol_model, tokenizer=smol_tokenizer, mode="sfi", sfi=SFI,
                            max_slots=2, max_len=MAX_LEN, chunk_steps=8, model_name="smol")
    with running_server(create_app(engine)) as (url, _):
        yield url, engine


@pytest.fixture(scope="module")
def reference(smol_model, smol_tokenizer):
    """generate()'s greedy tokens for every prompt (one batch), the chat's templated prompt
    last."""
    chat = smol_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    out = sfi_jax.generate(smol_model, PROMPTS + [chat], max_new_tokens=max(BUDGETS), mode="sfi",
                           sfi=SFI, tokenizer=smol_tokenizer)
    return out.tokens


def _expected(tok, ref_tokens, n):
    """generate()'s text for a budget of n, and whether it ended on EOS first."""
    ids = ref_tokens[:n]
    eos = tok.eos_token_id
    ended = eos in ids
    if ended:
        ids = ids[:ids.index(eos)]
    return tok.decode(ids, skip_special_tokens=True), ("stop" if ended else "length")


def test_requests_arriving_apart_equal_generate(served, reference, smol_tokenizer):
    url, engine = served
    client = openai_client(url)

    def ask(i):
        time.sleep(0.2 * i)  # arrivals apart, while earlier requests decode
        kw = dict(model="smol", prompt=PROMPTS[i], max_tokens=BUDGETS[i], temperature=0)
        if i % 3 == 0:  # a third of them streamed
            chunks = list(client.completions.create(**kw, stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        r = client.completions.create(**kw)
        assert r.usage.completion_tokens <= BUDGETS[i]
        return r.choices[0].text, r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, range(len(PROMPTS))))
    for i, (text, finish) in enumerate(got):
        assert (text, finish) == _expected(smol_tokenizer, reference[i], BUDGETS[i]), i
    m = engine.metrics()
    assert m["requests_finished"] >= len(PROMPTS) and m["active_slots"] == 0


def test_chat_and_streaming_equal_generate(served, reference, smol_tokenizer):
    url, _ = served
    client = openai_client(url)
    want, finish = _expected(smol_tokenizer, reference[-1], CHAT_BUDGET)
    r = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=CHAT_BUDGET,
                                       temperature=0)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, finish)
    chunks = list(client.chat.completions.create(
        model="smol", messages=CHAT, max_tokens=CHAT_BUDGET, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.model_dump() == r.usage.model_dump()
    prompt_ids = smol_tokenizer(smol_tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
    assert r.usage.prompt_tokens == len(prompt_ids)


def test_stop_strings_end_where_they_should(served, reference, smol_tokenizer):
    url, _ = served
    client = openai_client(url)
    full, _ = _expected(smol_tokenizer, reference[1], BUDGETS[1])
    stop = full[6:9]
    assert stop.strip(), full
    want = full[:full.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model="smol", prompt=PROMPTS[1], max_tokens=BUDGETS[1],
                                      temperature=0, stop=["\u2603never", stop], stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert (text, finish) == (want, "stop"), stream


def test_disconnect_frees_the_slot(served):
    url, engine = served
    before = engine.metrics()["requests_finished"]
    generated = engine.metrics()["tokens_generated"]
    with httpx.Client(base_url=url, timeout=120) as http:
        body = {"model": "smol", "prompt": "Count: 1, 2, 3,", "max_tokens": 200,
                "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 60
    while engine.metrics()["requests_finished"] == before or engine.metrics()["active_slots"]:
        assert time.monotonic() < deadline, engine.metrics()
        time.sleep(0.05)
    # it stopped long before its 200 tokens (all other requests of the module are shorter)
    assert engine.metrics()["tokens_generated"] - generated < 100


def test_engine_refusals_are_400(served):
    url, engine = served
    vocab = engine.cfg.vocab_size
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": MAX_LEN})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_tokens"
        assert str(MAX_LEN) in err["message"] and str(MAX_LEN + 3) in err["message"]
        r = http.post("/v1/completions", json={"prompt": [1, vocab], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert str(vocab) in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": "hi", "top_k": vocab + 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200


def test_metrics_carry_the_engine_counts(served):
    from prometheus_client.parser import text_string_to_metric_families

    url, engine = served
    client = openai_client(url)
    client.completions.create(model="smol", prompt="Hello", max_tokens=3)  # fits the budget
    # does not: slow steps (the warm-up's refreshes) and fast steps between them, on its own
    # (the module's other requests fit the budget, or end at a disconnect's moment)
    client.completions.create(model="smol", prompt="Hello " * 60, max_tokens=16)
    text = httpx.get(url + "/metrics", timeout=30).text
    value = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
             if not s.labels}
    m = engine.metrics()
    assert value["sfi_jax_max_slots"] == 2
    assert value["sfi_jax_engine_slow_steps_total"] == m["slow_steps"] > 0
    assert value["sfi_jax_engine_fast_steps_total"] == m["fast_steps"] > 0
    assert value["sfi_jax_engine_dense_steps_total"] == m["dense_steps"] > 0
    assert value["sfi_jax_time_to_first_token_seconds_count"] >= 1
    assert value["sfi_jax_inter_token_latency_seconds_count"] >= 1
    assert value["sfi_jax_engine_requests_finished_total"] == m["requests_finished"]
