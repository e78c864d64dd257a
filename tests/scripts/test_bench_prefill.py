"""bench_prefill.py's smoke mode: every part (warm, cold processes, requests, the transformers
peer) on a tiny config on the CPU writes its JSON, Markdown and plot."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench", "bench_prefill.py")


def _load():
    spec = importlib.util.spec_from_file_location("bench_prefill", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flop_floor_and_bytes_model():
    mod = _load()
    from sfi_jax.models.config import PRESETS

    c = PRESETS["qwen3-4b"]
    n = 32768
    attn = 2 * 36 * 32 * 128 * n * n
    assert mod.prefill_flops(c, 1, n) == pytest.approx(2 * mod.active_params(c) * n + attn)
    assert 3.5e9 < mod.active_params(c) < 4.1e9
    moe = PRESETS["qwen3-30b-a3b"]
    assert 2.5e9 < mod.active_params(moe) < 3.5e9  # 3B active of 30B
    import sfi_jax

    sfi = sfi_jax.SFIConfig()
    dense = mod.decode_bytes_model(c, 1, n, 256, [0], None)["decode_bytes"]
    sparse = mod.decode_bytes_model(c, 1, n, 256, [5], sfi)["decode_bytes"]
    assert sparse < dense


@pytest.mark.parametrize("parts", ["warm", "requests", "cold,hf"])
def test_smoke(tmp_path, parts, monkeypatch):
    """Each part of --smoke (split in three calls to keep each test short) writes its rows; a
    new prompt length in the bucket compiles nothing; the second cold process reads the
    compilation cache the first one filled. The child processes compile with XLA's slower
    optimisations off (their timings are only compared with each other, both sides compiled
    the same way)."""
    pytest.importorskip("matplotlib")
    if "hf" in parts and not _has_torch():
        parts = "cold"
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # the children's environment
    mod = _load()
    assert mod.main(["--smoke", "--parts", parts, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "prefill.json").read_text())
    assert {r["part"] for r in data["rows"]} == set(parts.split(","))
    assert data["runs"][-1]["device"] == "cpu"  # named by a child: the parent imports no jax
    md = (tmp_path / "prefill.md").read_text()
    assert (tmp_path / "prefill.png").stat().st_size > 0
    if "warm" in parts:
        warm = [r for r in data["rows"] if r["part"] == "warm"][0]
        assert warm["other_length_compile_s"] == 0.0 and warm["ttft_s"] > 0
        assert 0 < warm["flop_floor_s"] < warm["ttft_s"]
        assert "Time to first token, warm" in md
    elif "requests" in parts:
        req = {r["mode"]: r for r in data["rows"] if r["part"] == "requests"}
        assert set(req) == {"dense", "sfi"} and req["sfi"]["slow_steps"][0] >= 1
        assert req["sfi"]["decode_bytes"] < req["dense"]["decode_bytes"]
        assert "Whole requests" in md
    else:
        cold = {r["cache"]: r for r in data["rows"] if r["part"] == "cold"}
        # the second process reads what the first wrote (counted by jax, not raced in time)
        assert cold["empty"]["cache_hits"] == 0 and cold["empty"]["cache_misses"] > 0
        assert cold["filled"]["cache_hits"] > 0
        assert "Cold start" in md


def _has_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True
