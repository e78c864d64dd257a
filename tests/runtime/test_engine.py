"""The Engine: requests arriving one by one into a fixed set of slots give what `generate` gives
for each prompt alone; per-request sampling, budgets, stops, cancels, a full queue, bad input
and a faulty row, each without disturbing the other requests; no compile per request."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

import sfi_jax
from conftest import TINY_EOS, make_hf_checkpoint
from sfi_jax.runtime.requests import TextStream

pytestmark = pytest.mark.usefixtures("xla_fast_compile")

SMALL = sfi_jax.SFIConfig(n_sink=2, k_select=8, n_recent=8, t_max=8)
ENGINE = dict(sfi=SMALL, max_slots=2, max_len=128, chunk_steps=4)
TIMEOUT = 300


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY_EOS, n).tolist() for n in lengths]


# the selection memory with a warm-up (its refreshes every 4 steps) exercises the held scores
MEMORY = sfi_jax.SFIConfig(n_sink=2, k_select=8, n_recent=8, t_max=8, warmup_steps=8,
                           selection_memory=0.5)


@pytest.mark.parametrize("mode, sfi", [("dense", SMALL), ("sfi", SMALL), ("sfi", MEMORY),
                                       pytest.param("exact", SMALL, marks=pytest.mark.slow)],
                         ids=["dense", "sfi", "sfi-memory", "exact"])
def test_requests_arriving_apart_equal_generate(tiny_qwen3, mode, sfi):
    """Five requests of different lengths and budgets over two slots (slots reused), arriving
    at different times while others decode, give generate()'s greedy tokens for each prompt
    alone (EOS ends a request as it ends a generate row; exact mode's are dense decoding's)."""
    model = tiny_qwen3.model
    prompts = _prompts([5, 17, 40, 9, 33], seed=1)
    budgets = [16, 9, 16, 3, 12]
    with sfi_jax.Engine(model, mode=mode, **{**ENGINE, "sfi": sfi}) as engine:
        handles = []
        for p, n in zip(prompts, budgets):
            handles.append(engine.submit(sfi_jax.Request(prompt=p, max_tokens=n)))
            time.sleep(0.05)
        results = [h.result(timeout=TIMEOUT) for h in handles]
        assert engine.metrics()["requests_finished"] == 5
    for p, n, r in zip(prompts, budgets, results):
        ref = sfi_jax.generate(model, [p], max_new_tokens=n, mode=mode, sfi=sfi)
        assert r.token_ids == ref.tokens[0], (mode, len(p))
        ended_on_eos = ref.tokens[0][-1] == TINY_EOS
        assert r.finish_reason == ("stop" if ended_on_eos else "length")
        assert r.prompt_tokens == len(p) and r.completion_tokens == len(ref.tokens[0])


@pytest.mark.parametrize("mode", ["dense", "sfi", pytest.param("exact", marks=pytest.mark.slow)])
def test_prefill_into_a_slot_row_while_others_decode(tiny_qwen3, mode):
    """A prompt of five chunks is prefilled into its slot's row of the shared cache between
    the decode chunks of a running request (whose steps write every row's key at the row's
    length, an idle row's too), in a slot another request used before: both give
    generate()'s greedy tokens."""
    model = tiny_qwen3.model
    long_run, short, chunked = _prompts([6, 11, 70], seed=21)
    with sfi_jax.Engine(model, mode=mode, prefill_chunk=16, **{**ENGINE, "chunk_steps": 2}) \
            as engine:
        running = engine.submit(sfi_jax.Request(prompt=long_run, max_tokens=40))
        engine.submit(sfi_jax.Request(prompt=short, max_tokens=3)).result(TIMEOUT)
        late = engine.submit(sfi_jax.Request(prompt=chunked, max_tokens=12))
        first, second = running.result(TIMEOUT), late.result(TIMEOUT)
    assert engine.prefill_length(len(chunked)) == 128  # five chunks of 16, then the slot enters
    for p, n, r in ((long_run, 40, first), (chunked, 12, second)):
        ref = sfi_jax.generate(model, [p], max_new_tokens=n, mode=mode, sfi=SMALL)
        assert r.token_ids == ref.tokens[0], (mode, len(p))
    assert len(first.token_ids) > 12  # (it decoded beside the prefill, not after it)


def test_a_request_cancelled_while_it_prefills_leaves_its_slot_idle(tiny_qwen3, monkeypatch):
    """A cancel between prefill chunks ends the request; its slot's row, parked at its last
    position while it prefilled, idles at length 0 again, and the slot serves the next
    request as generate() does."""
    from sfi_jax.runtime import prefill

    model = tiny_qwen3.model
    long_prompt, short = _prompts([70, 9], seed=23)
    handles, real = [], prefill.prefill_chunk

    def cancelling(*args, **kw):
        out = real(*args, **kw)
        if handles:
            engine.cancel(handles[0])
        return out

    monkeypatch.setattr(prefill, "prefill_chunk", cancelling)
    with sfi_jax.Engine(model, mode="dense", prefill_chunk=16,
                        **{**ENGINE, "max_slots": 1}) as engine:
        handles.append(engine.submit(sfi_jax.Request(prompt=long_prompt, max_tokens=5)))
        assert handles[0].result(TIMEOUT).finish_reason == "cancelled"
        assert int(engine.decoder.state.lengths[0]) == 0
        handles.clear()
        after = engine.submit(sfi_jax.Request(prompt=short, max_tokens=6)).result(TIMEOUT)
    assert after.token_ids == sfi_jax.generate(model, [short], max_new_tokens=6,
                                               mode="dense").tokens[0]


def test_streamed_events_and_stop_token(tiny_qwen3):
    """Events carry every token once, in order; a stop token id ends the request before it."""
    model = tiny_qwen3.model
    p = _prompts([11], seed=3)[0]
    ref = sfi_jax.generate(model, [p], max_new_tokens=12, mode="dense").tokens[0]
    stop_at = 6
    assert ref[stop_at] not in ref[:stop_at]
    with sfi_jax.Engine(model, mode="dense", **ENGINE) as engine:
        events = list(engine.submit(sfi_jax.Request(prompt=p, max_tokens=12)))
        stopped = engine.submit(sfi_jax.Request(prompt=p, max_tokens=12,
                                                stop_token_ids=[ref[stop_at]])).result(TIMEOUT)
    assert [t for e in events for t in e.token_ids] == ref
    assert [e.finish_reason for e in events][-1] == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    assert stopped.token_ids == ref[:stop_at] and stopped.finish_reason == "stop"


def test_sampling_per_request(tiny_qwen3):
    """A request's seed fixes its tokens whatever runs beside it; greedy rows beside sampled
    rows stay greedy."""
    model = tiny_qwen3.model
    p, q = _prompts([13, 21], seed=4)
    sampled = dict(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=123)
    greedy = sfi_jax.generate(model, [q], max_new_tokens=10, mode="sfi", sfi=SMALL).tokens[0]
    with sfi_jax.Engine(model, mode="sfi", **ENGINE) as engine:
        alone = engine.submit(sfi_jax.Request(prompt=p, **sampled)).result(TIMEOUT)
        h1 = engine.submit(sfi_jax.Request(prompt=p, **sampled))
        h2 = engine.submit(sfi_jax.Request(prompt=q, max_tokens=10))
        other_seed = engine.submit(sfi_jax.Request(prompt=p, **dict(sampled, seed=7)))
        beside, g, other = h1.result(TIMEOUT), h2.result(TIMEOUT), other_seed.result(TIMEOUT)
    assert beside.token_ids == alone.token_ids
    assert g.token_ids == greedy
    assert other.token_ids != alone.token_ids


def test_sample_rows_distribution():
    """Each row samples from its own temperature / top-k / top-p distribution."""
    from sfi_jax.runtime.sampling import sample_rows
    from sfi_jax.runtime.state import RowControls
    from test_generate import _expected_probs

    rng = np.random.default_rng(0)
    base = rng.normal(size=(3, 12)).astype(np.float32) * 2
    params = [(0.7, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.6)]
    n = 4000
    logits = np.repeat(base, n, axis=0)
    temp = np.repeat([t for t, _, _ in params], n).astype(np.float32)
    top_k = np.repeat([k for _, k, _ in params], n).astype(np.int32)
    top_p = np.repeat([p for _, _, p in params], n).astype(np.float32)
    rows = RowControls(temperature=temp, top_p=top_p, top_k=top_k,
                       keys=jax.random.split(jax.random.key(1), 3 * n),
                       remaining=np.zeros(3 * n, np.int32))
    tokens, _ = jax.jit(sample_rows)(logits, rows)
    tokens = np.asarray(tokens).reshape(3, n)
    for i, (t, k, p) in enumerate(params):
        want = _expected_probs(base[i], t, top_k=k, top_p=p)
        got = np.bincount(tokens[i], minlength=12) / n
        assert np.abs(got - want).max() < 0.03, (i, got, want)
        assert got[want == 0].sum() == 0, i
    greedy = rows._replace(temperature=np.zeros(3 * n, np.float32))
    np.testing.assert_array_equal(jax.jit(sample_rows)(logits, greedy)[0],
                                  np.argmax(logits, -1))


def test_new_lengths_budgets_and_sampling_compile_nothing(tiny_qwen3):
    model = tiny_qwen3.model
    compiles = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    with sfi_jax.Engine(model, mode="sfi", **ENGINE) as engine:
        warm = _prompts([6, 20], seed=5)
        engine.submit(sfi_jax.Request(prompt=warm[0], max_tokens=5)).result(TIMEOUT)
        engine.submit(sfi_jax.Request(prompt=warm[1], max_tokens=7, temperature=0.8,
                                      seed=1)).result(TIMEOUT)
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            handles = [engine.submit(sfi_jax.Request(prompt=p, max_tokens=n, **kw))
                       for p, n, kw in zip(_prompts([3, 31, 57], seed=6), [2, 11, 4],
                                           [{}, dict(temperature=0.5, top_k=3, seed=9),
                                            dict(temperature=1.2, top_p=0.5)])]
            for h in handles:
                assert h.result(TIMEOUT).finish_reason in ("length", "stop")
        finally:
            jax.monitoring.clear_event_listeners()
    assert compiles == []


def test_prompts_longer_than_a_chunk_share_one_prefill_shape(tiny_qwen3, monkeypatch):
    """After one request of each `warmup_lengths()` length, prompts of new lengths longer than
    a prefill chunk compile nothing (they prefill at the slots' padded length), run only the
    chunks that hold prompt tokens (not the padding after them), and give generate()'s
    tokens."""
    from sfi_jax.runtime import prefill

    model = tiny_qwen3.model
    compiles, chunks = [], []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    real = prefill.prefill_chunk

    def counting(params, k, v, key_norms, tokens, start, lengths, carry, **kw):
        chunks.append(int(np.asarray(lengths)[0]))
        return real(params, k, v, key_norms, tokens, start, lengths, carry, **kw)

    monkeypatch.setattr(prefill, "prefill_chunk", counting)
    prompts = _prompts([17, 45, 90, 120], seed=8)
    with sfi_jax.Engine(model, mode="sfi", prefill_chunk=16, **ENGINE) as engine:
        lengths = engine.warmup_lengths()
        assert {engine.prefill_length(n) for n in lengths} == {16, 128}, lengths
        for n in lengths:
            engine.submit(sfi_jax.Request(prompt=[1] * n, max_tokens=2)).result(TIMEOUT)
        chunks.clear()
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            results = [engine.submit(sfi_jax.Request(prompt=p, max_tokens=5)).result(TIMEOUT)
                       for p in prompts]
        finally:
            jax.monitoring.clear_event_listeners()
    assert compiles == []
    for p in prompts:  # a 128-position cache in chunks of 16: ceil(n / 16) chunks, not 8
        assert chunks.count(len(p)) == -(-len(p) // 16), (len(p), chunks)
    for p, r in zip(prompts, results):
        ref = sfi_jax.generate(model, [p], max_new_tokens=5, mode="sfi", sfi=SMALL)
        assert r.token_ids == ref.tokens[0], len(p)


def test_cancel_frees_the_slot_and_full_queue_is_refused(tiny_qwen3):
    model = tiny_qwen3.model
    p = _prompts([8], seed=7)[0]
    with sfi_jax.Engine(model, mode="dense", sfi=SMALL, max_slots=1, max_len=128,
                        chunk_steps=2, max_queue=2) as engine:
        first_event = threading.Event()
        long = engine.submit(sfi_jax.Request(prompt=p, max_tokens=110),
                             on_event=lambda e: first_event.set())
        assert first_event.wait(TIMEOUT)
        waiting = [engine.submit(sfi_jax.Request(prompt=p, max_tokens=3)) for _ in range(2)]
        with pytest.raises(sfi_jax.QueueFull, match="max_queue=2") as err:
            engine.submit(sfi_jax.Request(prompt=p, max_tokens=3))
        assert err.value.retry_after > 0
        engine.cancel(long)
        assert long.result(TIMEOUT).finish_reason == "cancelled"
        assert len(long.result().token_ids) < 110
        for h in waiting:  # the freed slot serves the waiting requests
            assert h.result(TIMEOUT).finish_reason == "length"
            assert len(h.result().token_ids) == 3


@pytest.mark.parametrize("kw, field, match", [
    (dict(prompt=[]), "prompt", "empty"),
    (dict(prompt=[1, 256]), "prompt", r"256.*\[0, 256\)"),
    (dict(prompt=[1, True]), "prompt", "True"),
    (dict(prompt=5), "prompt", "int"),
    (dict(prompt="text"), "prompt", "tokenizer"),
    (dict(max_tokens=0), "max_tokens", "0"),
    (dict(max_tokens=2.5), "max_tokens", "2.5"),
    (dict(max_tokens=120), "max_tokens", r"10 tokens.*120.*130.*128"),
    (dict(temperature=-1), "temperature", "-1"),
    (dict(temperature=float("inf")), "temperature", "inf"),
    (dict(top_p=0.0), "top_p", "0.0"),
    (dict(top_k=1000), "top_k", "1000"),
    (dict(seed=-2), "seed", "-2"),
    (dict(stop=[""]), "stop", "stop"),
    (dict(stop_token_ids=[999]), "stop_token_ids", "999"),
])
def test_bad_requests_name_the_field(tiny_qwen3, kw, field, match):
    engine = sfi_jax.Engine(tiny_qwen3.model, mode="dense", **ENGINE)
    request = sfi_jax.Request(**{"prompt": list(range(10)), **kw})
    with pytest.raises(sfi_jax.RequestError, match=match) as err:
        engine.validate(request)
    assert err.value.field == field


def test_bad_engine_settings(tiny_qwen3):
    with pytest.raises(ValueError, match="mode"):
        sfi_jax.Engine(tiny_qwen3.model, mode="fast")
    exact = sfi_jax.Engine(tiny_qwen3.model, mode="exact", **ENGINE)
    with pytest.raises(sfi_jax.RequestError, match="greedy"):
        exact.validate(sfi_jax.Request(prompt=[1, 2], temperature=0.7))
    with pytest.raises(ValueError, match="max_len"):
        sfi_jax.Engine(tiny_qwen3.model, mode="dense", max_len=10 ** 9)
    with pytest.raises(MemoryError, match="slots"):
        sfi_jax.Engine(tiny_qwen3.model, mode="dense", max_slots=10 ** 7, max_len=512)
    with pytest.raises(RuntimeError, match="not running"):
        sfi_jax.Engine(tiny_qwen3.model, mode="dense", **ENGINE).submit(
            sfi_jax.Request(prompt=[1, 2]))


@pytest.fixture(scope="module")
def untied_qwen3(tmp_path_factory):
    _, d = make_hf_checkpoint(tmp_path_factory.mktemp("untied"), "qwen3", seed=11,
                              eos_token_id=TINY_EOS, tie_word_embeddings=False)
    return sfi_jax.load_model(d, dtype="float32")


@pytest.mark.parametrize("mode", ["dense", "sfi", "exact"])
def test_generate_stops_on_non_finite_decode_logits(untied_qwen3, mode):
    """NaN in the embedding of the first generated token: the prefill is clean, the first
    decode step is not; generate names the row, the step and the mode instead of returning
    tokens drawn from NaN."""
    import jax.numpy as jnp

    model = untied_qwen3
    p, q = _prompts([9, 14], seed=8)
    ref = sfi_jax.generate(model, [p, q], max_new_tokens=6, mode="dense", sfi=SMALL).tokens
    bad = ref[0][0]
    if bad in p or bad in q or bad == ref[1][0]:
        pytest.skip("the probe token occurs in the other row")
    embed = model.embed[...]
    model.embed[...] = embed.at[bad].set(jnp.nan)
    try:
        step = r"\d" if mode == "exact" else "1"  # (a round's drafts come out together)
        with pytest.raises(FloatingPointError, match=rf"row 0: non-finite.*step {step} .*'{mode}'"):
            sfi_jax.generate(model, [p, q], max_new_tokens=6, mode=mode, sfi=SMALL)
    finally:
        model.embed[...] = embed


@pytest.mark.parametrize("mode", ["dense", "sfi", "exact"])
def test_nan_in_one_layers_query_weight_is_reported(untied_qwen3, mode):
    """NaN in one layer's wq: forward gives NaN, and so generate's first logits (the attention
    guard for rows without a valid key no longer turns NaN rows into zeros)."""
    import jax.numpy as jnp

    model = untied_qwen3
    wq = model.layers.wq[...]
    model.layers.wq[...] = wq.at[1, 0, 0].set(jnp.nan)
    try:
        assert np.isnan(np.asarray(sfi_jax.forward(model, [[1, 2, 3]]))).all()
        with pytest.raises(FloatingPointError, match="non-finite"):
            sfi_jax.generate(model, [[1, 2, 3]], max_new_tokens=3, mode=mode, sfi=SMALL)
    finally:
        model.layers.wq[...] = wq


def test_a_row_that_turns_non_finite_fails_alone(untied_qwen3):
    """NaN in the embedding of the token one request generates first: that request ends with an
    error at its first decode step; the request beside it finishes with the clean tokens."""
    import jax.numpy as jnp

    model = untied_qwen3
    p, q = _prompts([9, 14], seed=8)
    ref_p = sfi_jax.generate(model, [p], max_new_tokens=8, mode="dense").tokens[0]
    ref_q = sfi_jax.generate(model, [q], max_new_tokens=8, mode="dense").tokens[0]
    bad = ref_p[0]
    if bad in p or bad in q or bad in ref_q:
        pytest.skip("the probe token occurs in the other request")
    engine = sfi_jax.Engine(model, mode="dense", **ENGINE)
    engine.params["embed"] = engine.params["embed"].at[bad].set(jnp.nan)
    with engine:
        hp = engine.submit(sfi_jax.Request(prompt=p, max_tokens=8))
        hq = engine.submit(sfi_jax.Request(prompt=q, max_tokens=8))
        rp, rq = hp.result(TIMEOUT), hq.result(TIMEOUT)
        after = engine.submit(sfi_jax.Request(prompt=q, max_tokens=8)).result(TIMEOUT)
    assert rp.finish_reason == "error" and "non-finite" in rp.error
    assert rq.token_ids == ref_q and rq.finish_reason == "length"
    assert after.token_ids == ref_q


def test_stop_requests_and_drain(tiny_qwen3):
    model = tiny_qwen3.model
    p = _prompts([8], seed=9)[0]
    engine = sfi_jax.Engine(model, mode="dense", **ENGINE).start()
    h = engine.submit(sfi_jax.Request(prompt=p, max_tokens=6))
    engine.stop(drain=True, timeout=TIMEOUT)
    assert h.result(0).finish_reason == "length"
    with pytest.raises(RuntimeError, match="not running"):
        engine.submit(sfi_jax.Request(prompt=p))
    engine = sfi_jax.Engine(model, mode="dense", **ENGINE).start()
    h = engine.submit(sfi_jax.Request(prompt=p, max_tokens=100))
    engine.stop(drain=False, timeout=TIMEOUT)
    assert h.result(0).finish_reason == "cancelled"


# ---------------------------------------------------------------- text streaming

@pytest.mark.parametrize("text", ["巴黎是哪个国家的首都？", "🔥🔥 fire 🔥", "e\u0301te\u0301 cafe\u0301"])
def test_streamed_text_is_the_final_text(smol_tokenizer, text):
    """Text released token by token never holds a partial character, and adds up to the whole
    text; multi-byte characters split over several tokens included."""
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    stream, parts = TextStream(smol_tokenizer, []), []
    for i in range(1, len(ids) + 1):
        new, stopped = stream.update(ids[:i], final=i == len(ids))
        assert "\ufffd" not in new and not stopped
        parts.append(new)
    assert "".join(parts) == smol_tokenizer.decode(ids) == text


def test_stop_strings_end_the_text(smol_tokenizer):
    text = "The answer is 42. The next line\nmore text"
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    for stop, want in [([". The"], "The answer is 42"), (["\n", "42"], "The answer is "),
                       (["absent"], text)]:
        stream, parts, stopped = TextStream(smol_tokenizer, stop), [], False
        for i in range(1, len(ids) + 1):
            new, stopped = stream.update(ids[:i], final=i == len(ids))
            parts.append(new)
            if stopped:
                break
        assert "".join(parts) == want == stream.text
        assert stopped == (want != text)


def test_sfi_within_its_budget_runs_the_dense_program(tiny_qwen3):
    """Rows whose prompt + new tokens fit the budget are dense under SFI: generate runs the
    dense program for them (no selector, no compact buffers) and says so."""
    model = tiny_qwen3.model
    prompts = _prompts([5, 9], seed=10)
    wide = sfi_jax.SFIConfig(n_sink=2, k_select=16, n_recent=8)  # budget 26 >= 9 + 12
    sfi = sfi_jax.generate(model, prompts, max_new_tokens=12, mode="sfi", sfi=wide,
                           stop_at_eos=False, return_logits=True)
    dense = sfi_jax.generate(model, prompts, max_new_tokens=12, mode="dense",
                             stop_at_eos=False, return_logits=True)
    assert sfi.stats["decode_path"] == "dense" and dense.stats["decode_path"] == "dense"
    assert sfi.tokens == dense.tokens
    np.testing.assert_array_equal(sfi.stats["logits"], dense.stats["logits"])
    assert "sfi_compact" not in sfi.stats["memory_bytes"]
    assert sfi.stats["slow_timeline"].shape == (2, 11) and not sfi.stats["slow_timeline"].any()
    over = sfi_jax.generate(model, prompts, max_new_tokens=18, mode="sfi", sfi=wide,
                            stop_at_eos=False)  # 9 + 18 > 26: the SFI program
    assert over.stats["decode_path"] == "sfi" and over.stats["slow_timeline"][:, 0].all()


def test_a_request_whose_prefill_fails_fails_alone(tiny_qwen3, monkeypatch):
    from sfi_jax.runtime import prefill

    model = tiny_qwen3.model
    bad, good = _prompts([13, 9], seed=12)
    real = prefill.prefill_chunk

    def failing(params, k, v, key_norms, tokens, start, lengths, carry, **kw):
        if int(np.asarray(lengths)[0]) == len(bad):
            raise MemoryError("out of device memory (injected)")
        return real(params, k, v, key_norms, tokens, start, lengths, carry, **kw)

    monkeypatch.setattr(prefill, "prefill_chunk", failing)
    ref = sfi_jax.generate(model, [good], max_new_tokens=6, mode="dense").tokens[0]
    with sfi_jax.Engine(model, mode="dense", **ENGINE) as engine:
        hb = engine.submit(sfi_jax.Request(prompt=bad, max_tokens=6))
        hg = engine.submit(sfi_jax.Request(prompt=good, max_tokens=6))
        rb, rg = hb.result(TIMEOUT), hg.result(TIMEOUT)
        after = engine.submit(sfi_jax.Request(prompt=good, max_tokens=6)).result(TIMEOUT)
    assert rb.finish_reason == "error" and "injected" in rb.error
    assert rg.token_ids == ref and after.token_ids == ref


def test_generate_decodes_through_the_engines_loop(tiny_qwen3, monkeypatch):
    """generate's rows are slots of the Engine's decode loop (`SlotDecoder`): the tokens that
    loop hands each slot, the first token and then one delivery per chunk, are generate's
    tokens, and a chunk never runs past the budget."""
    from sfi_jax.runtime import decoder

    deliveries = []
    real = decoder.SlotDecoder.deliver

    def spy(self, a, new, device_done):
        deliveries.append((a.slot, list(new)))
        return real(self, a, new, device_done)

    monkeypatch.setattr(decoder.SlotDecoder, "deliver", spy)
    prompts = _prompts([5, 12], seed=13)
    out = sfi_jax.generate(tiny_qwen3.model, prompts, max_new_tokens=10, mode="dense",
                           chunk_steps=4, stop_at_eos=False)
    rows = [[t for slot, new in deliveries if slot == b for t in new] for b in range(2)]
    assert rows == out.tokens and [len(r) for r in rows] == [10, 10]
    assert [len(new) for slot, new in deliveries if slot == 0] == [1, 4, 4, 1]
    assert out.stats["decode_steps"] == 9


def test_sfi_within_its_budget_is_the_sfi_programs_output(tiny_qwen3):
    """The dense program that SFI mode runs within its budget gives the SFI program's tokens
    (diagnostics keep the SFI program) and dense decoding's."""
    model = tiny_qwen3.model
    prompts = _prompts([7, 12], seed=13)
    kw = dict(max_new_tokens=6, mode="sfi", sfi=SMALL, stop_at_eos=False)  # 12 + 6 <= 18
    fast = sfi_jax.generate(model, prompts, **kw)
    program = sfi_jax.generate(model, prompts, diagnostics=True, **kw)
    dense = sfi_jax.generate(model, prompts, max_new_tokens=6, mode="dense", stop_at_eos=False)
    assert fast.stats["decode_path"] == "dense" and program.stats["decode_path"] == "sfi"
    assert fast.tokens == program.tokens == dense.tokens
    assert fast.stats["dense_steps"] == [5, 5] and program.stats["dense_steps"] == [0, 0]


def test_generate_goes_dense_once_the_open_rows_fit(tiny_qwen3):
    """A batch whose long row ends early (a forced EOS) decodes its fitting row with the dense
    program from then on: each row gives its tokens alone (the long row the SFI program's,
    the fitting row dense decoding's), and the stats count the steps of each program."""
    model = tiny_qwen3.model
    fit, long = _prompts([5, 14], seed=14)  # 5 + 12 <= 18 < 14 + 12
    forced = np.full((2, 12), -1, np.int32)
    forced[1, 3] = TINY_EOS
    kw = dict(max_new_tokens=12, sfi=SMALL, chunk_steps=2)
    both = sfi_jax.generate(model, [fit, long], mode="sfi", forced_tokens=forced, **kw)
    # the references: the SFI program alone (diagnostics keep it) and dense decoding
    alone = sfi_jax.generate(model, [long], mode="sfi", forced_tokens=forced[1:],
                             diagnostics=True, **kw)
    dense = sfi_jax.generate(model, [fit], mode="dense", forced_tokens=forced[:1], **kw)
    assert both.tokens == [dense.tokens[0], alone.tokens[0]]
    assert len(both.tokens[0]) == 12 and both.tokens[1][-1] == TINY_EOS
    s = both.stats
    assert s["decode_path"] == "sfi+dense" and alone.stats["decode_path"] == "sfi"
    assert s["dense_steps"][1] == 0 and 0 < s["dense_steps"][0] < 11
    assert [a + b + c for a, b, c in zip(s["slow_steps"], s["fast_steps"], s["dense_steps"])] \
        == [11, 3]
    assert alone.stats["slow_steps"][0] >= 1


def test_engine_runs_the_dense_program_while_every_request_fits(tiny_qwen3):
    """A request that fits the budget decodes alone in dense chunks; one that does not fit
    arrives and the chunks run the SFI program for both. Each gives its tokens alone: the
    fitting one dense decoding's, the other the SFI program's (which differ from dense here);
    the metrics count both programs. With dense_within_budget off, the same tokens."""
    model = tiny_qwen3.model
    fit, long = _prompts([5, 12], seed=15)
    want_fit = sfi_jax.generate(model, [fit], max_new_tokens=13, mode="dense").tokens[0]
    want_long = sfi_jax.generate(model, [long], max_new_tokens=24, mode="sfi", sfi=SMALL,
                                 diagnostics=True).tokens[0]  # (the SFI program alone)
    dense_long = sfi_jax.generate(model, [long], max_new_tokens=24, mode="dense").tokens[0]
    assert want_long != dense_long  # the long request needs the SFI program
    for switch in (True, False):
        with sfi_jax.Engine(model, mode="sfi", **ENGINE) as engine:
            engine.decoder.dense_within_budget = switch
            first = threading.Event()
            h_fit = engine.submit(sfi_jax.Request(prompt=fit, max_tokens=13),  # 5 + 13 <= 18
                                  on_event=lambda e: first.set())
            assert first.wait(TIMEOUT)  # (its first chunk runs before `long` is admitted)
            h_long = engine.submit(sfi_jax.Request(prompt=long, max_tokens=24))
            got_fit, got_long = h_fit.result(TIMEOUT), h_long.result(TIMEOUT)
            m = engine.metrics()
        assert got_fit.token_ids == want_fit, switch
        assert got_long.token_ids == want_long, switch
        if switch:
            assert m["dense_chunks"] >= 1 and m["sfi_chunks"] >= 1, m
            assert 0 < m["dense_steps"] < 12, m
        else:
            assert m["dense_chunks"] == 0 and m["dense_steps"] == 0, m
        assert m["slow_steps"] + m["fast_steps"] + m["dense_steps"] == 12 + 23, m
