"""`python -m sfi_jax.serve`'s main: bad flags fail before the model loads; it prints its ready
line, answers, and on SIGTERM ends a running stream cleanly and exits with status 0 (in this
process over the fake engine; as a process on a tiny random checkpoint in the slow suite)."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_support import openai_client

import sfi_jax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _serve(*args):
    return subprocess.Popen([sys.executable, "-m", "sfi_jax.serve", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.parametrize("flags,says", [
    (["--max-slots", "0"], "--max-slots must be >= 1, got 0"),
    (["--max-len", "1"], "--max-len must be >= 2, got 1"),
    (["--max-queue", "0"], "--max-queue must be >= 1, got 0"),
    (["--chunk-steps", "0"], "--chunk-steps must be >= 1, got 0"),
    (["--port", "70000"], "--port must be in 0..65535, got 70000"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0, got -1"),
    (["--memory-fraction", "0"], "--memory-fraction must be in (0, 1], got 0.0"),
    (["--memory-fraction", "1.5"], "--memory-fraction must be in (0, 1], got 1.5"),
    (["--k-select", "0"], "k_select must be >= 1, got 0"),
    (["--t-max", "0"], "t_max must be >= 1, got 0"),
    (["--successor-radius", "-1"], "successor_radius must be >= 0, got -1"),
    (["--selection-memory", "-0.5"], "selection_memory must be a finite number in [0, inf)"),
    (["--mode", "fast"], "invalid choice: 'fast'"),
])
def test_bad_flags_fail_before_loading(flags, says, capsys):
    from sfi_jax.serve.cli import main

    # the model does not exist: an error about the flag shows the flags were checked first
    with pytest.raises(SystemExit) as e:
        main(["--model", "/no/such/model", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err, err


@pytest.mark.parametrize("flag,env,want", [
    (None, {}, {"XLA_CLIENT_MEM_FRACTION": "0.9"}),  # the server's default
    (None, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.7"}, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.7"}),
    (None, {"XLA_CLIENT_MEM_FRACTION": "0.6"}, {"XLA_CLIENT_MEM_FRACTION": "0.6"}),
    (0.95, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.7"}, {"XLA_CLIENT_MEM_FRACTION": "0.95"}),
])
def test_memory_fraction_reaches_jax_once(flag, env, want, monkeypatch):
    """--memory-fraction, else the variable as set, else 0.9; never both of JAX's names (JAX
    refuses to start with both set)."""
    from sfi_jax.serve.cli import MEMORY_FRACTION_VARS, apply_memory_fraction, build_parser

    for name in MEMORY_FRACTION_VARS:  # (setenv first: teardown restores what was there)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = [] if flag is None else ["--memory-fraction", str(flag)]
    in_force = apply_memory_fraction(build_parser().parse_args(argv))
    got = {n: os.environ[n] for n in MEMORY_FRACTION_VARS if n in os.environ}
    assert got == want and in_force == next(iter(want.values()))


def test_taken_port_fails_before_loading(capsys):
    from sfi_jax.serve.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(SystemExit) as e:
            main(["--model", "/no/such/model", "--port", str(s.getsockname()[1])])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "cannot listen on 127.0.0.1" in err, err


def test_main_serves_then_exits_cleanly_on_sigterm(monkeypatch, capsys):
    """main() in this process over the fake engine: the ready line, an answer, and a SIGTERM
    (to this process, handled by uvicorn in the main thread) that ends a running stream with
    [DONE] and returns 0 without raising the signal again."""
    from serve_support import FakeEngine

    from sfi_jax.serve import cli

    import uvicorn

    engine = FakeEngine(max_slots=1, max_len=10_000, chunk_steps=1, step_s=0.02)
    monkeypatch.setattr(cli, "build_engine", lambda args, sfi: engine)
    for name in cli.MEMORY_FRACTION_VARS:  # main() sets one; teardown takes it back
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    # uvicorn's logging set-up (dictConfig) would close pytest's capturing log handlers
    monkeypatch.setattr(uvicorn.Config, "configure_logging", lambda self: None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    seen, got = [], {}
    old = signal.signal(signal.SIGTERM, lambda *a: seen.append(a[0]))

    def client():
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            got["text"] = openai_client(url).completions.create(
                model="fake", prompt="abc", max_tokens=5).choices[0].text
            body = {"prompt": "abc", "max_tokens": 5000, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                it = (x for x in r.iter_lines() if x)
                next(it)
                os.kill(os.getpid(), signal.SIGTERM)
                got["rest"] = list(it)
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            got["error"] = e
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        code = cli.main(["--port", str(port), "--served-model-name", "fake",
                         "--shutdown-timeout", "0.3", "--no-warmup"])
    finally:
        signal.signal(signal.SIGTERM, old)
    thread.join(timeout=30)
    assert "error" not in got, got.get("error")
    assert code == 0 and not seen  # the handled SIGTERM was not raised again
    assert got["text"] == "abcab" and got["rest"][-1] == "data: [DONE]"
    assert f"serving fake on {url}\n" in capsys.readouterr().out
    assert engine.stopping.is_set()


@pytest.mark.slow
def test_serves_then_exits_cleanly_on_sigterm(tiny_qwen3, smol_tokenizer):
    prompt = [5, 17, 42, 7, 99, 3]
    want = sfi_jax.generate(tiny_qwen3.model, [prompt], max_new_tokens=8, mode="dense").tokens[0]
    p = _serve("--model", tiny_qwen3.dir, "--tokenizer", "smollm2-135m", "--port", "0",
               "--max-slots", "2", "--max-len", "128", "--mode", "dense", "--chunk-steps", "2",
               "--served-model-name", "tiny", "--shutdown-timeout", "0.5", "--no-compile-cache")
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in p.stdout], daemon=True).start()
    try:
        try:
            ready = lines.get(timeout=240)
        except queue.Empty:
            pytest.fail("no ready line: " + p.stderr.read() if p.poll() is not None else "")
        m = re.fullmatch(r"serving tiny on (http://127\.0\.0\.1:\d+)\n", ready)
        assert m, ready
        url = m.group(1)
        client = openai_client(url)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        ids = want[:want.index(255)] if 255 in want else want
        assert r.choices[0].text == smol_tokenizer.decode(ids, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(prompt)
        # a long stream is running when SIGTERM comes: it ends with an error event and [DONE]
        body = {"prompt": prompt, "max_tokens": 100, "stream": True, "stop_token_ids": [],
                "temperature": 1.0, "seed": 1}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
            it = (x for x in s.iter_lines() if x)
            assert next(it).startswith("data: {")
            p.send_signal(signal.SIGTERM)
            rest = list(it)
        assert rest[-1] == "data: [DONE]", rest[-3:]
        assert p.wait(timeout=60) == 0, p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
