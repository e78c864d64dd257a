"""scripts/bench/bench_serve.py against a server over the fake engine, whose timing is known:
each slot gets `chunk_steps` tokens every `step_s` seconds, so the measured inter-token
latency, first-token time and output token counts can be checked against it."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from serve_support import FakeEngine, running_server

from sfi_jax.serve import create_app

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_serve", os.path.join(ROOT, "scripts", "bench", "bench_serve.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_serve_measures_what_the_engine_does(tmp_path):
    pytest.importorskip("matplotlib")
    bench = _bench()
    step_s, chunk = 0.05, 4
    engine = FakeEngine(max_slots=4, max_len=10_000, max_queue=16, chunk_steps=chunk,
                        step_s=step_s)
    out = str(tmp_path / "serve")
    with running_server(create_app(engine)) as (url, _):
        report = bench.main(["--url", url, "--label", "fake", "--prompt-lens", "16",
                             "--output-lens", "12", "--rates", "20", "--requests", "3",
                             "--out", out])
    rows = report["results"]["fake"]
    assert len(rows) == 1
    r = rows[0]
    assert (r["requests"], r["completed"], r["failed"]) == (3, 3, 0)
    assert r["output_tokens"] == 3 * 12 == engine.generated
    # tokens arrive `chunk` at a time every step_s: g/k per token is about step_s / chunk
    assert 0.8 * step_s / chunk < r["itl_p50_s"] < 3 * step_s / chunk, r
    assert step_s * 0.8 < r["ttft_p50_s"] < 20 * step_s, r
    # 12 tokens per request come in 3 chunks: the rate is about 3 * 12 tokens / (3 steps + ...)
    assert 0 < r["output_tokens_per_s"] <= 3 * 12 / (3 * step_s)
    assert json.load(open(out + ".json"))["results"]["fake"][0] == r
    md = open(out + ".md").read()
    assert "| fake | 20 | 3/3 |" in md
    assert os.path.getsize(out + ".png") > 1000


def test_bench_serve_refuses_remote_urls():
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.main(["--url", "http://example.com:8000", "--smoke"])


def test_bench_serve_busy_counts_every_stream_and_times_probes_beside_them(tmp_path):
    pytest.importorskip("matplotlib")
    bench = _bench()
    step_s, chunk, slots = 0.05, 4, 3
    engine = FakeEngine(max_slots=slots, max_len=100_000, max_queue=16, chunk_steps=chunk,
                        step_s=step_s)
    out = str(tmp_path / "busy")
    with running_server(create_app(engine)) as (url, _):
        report = bench.main(["--url", url, "--label", "fake", "--prompt-lens", "16",
                             "--rates", "", "--busy", str(slots), "--busy-tokens", "5000",
                             "--busy-seconds", "1.0", "--probes", "2", "--out", out])
    b = report["busy"]["fake"]
    assert b["streams"] == slots and b["all_streams_started"], b
    # every slot gets `chunk` tokens per step: about slots * chunk / step_s tokens/s
    want = slots * chunk / step_s
    assert 0.5 * want < b["busy_tokens_per_s"] < 1.5 * want, (b["busy_tokens_per_s"], want)
    assert len(b["ttft_alone_s"]) == 2 and len(b["ttft_beside_s"]) == 2, b
    assert b["probes_failed"] == 0
    assert all(0 < t < 20 * step_s for t in b["ttft_alone_s"] + b["ttft_beside_s"]), b
    # the streams were bounded: each ended long before its 5000 tokens
    assert all(r["completion_tokens"] < 5000 for r in b["records"]["streams"])
    assert "| fake | 3 | 16 |" in open(out + ".md").read()
