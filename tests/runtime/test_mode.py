"""`Mode`: one type for the decoding mode, checked once at the API's edge (generate, Engine,
both CLIs), with an error naming the bad value."""

from __future__ import annotations

import json

import pytest

import sfi_jax
from sfi_jax import cli
from sfi_jax.runtime.mode import Mode
from sfi_jax.serve import cli as serve_cli


@pytest.mark.parametrize("value, mode", [("sfi", Mode.SFI), ("dense", Mode.DENSE),
                                         ("exact", Mode.EXACT), (Mode.EXACT, Mode.EXACT)])
def test_parse(value, mode):
    assert Mode.parse(value) is mode


@pytest.mark.parametrize("bad", ["fast", "SFI", "", None, 1, True])
def test_parse_names_the_bad_value(bad):
    with pytest.raises(ValueError, match=r"mode must be one of \['sfi', 'dense', 'exact'\], "
                                         rf"got {bad!r}$"):
        Mode.parse(bad)


def test_a_mode_reads_as_its_value():
    assert Mode.SFI == "sfi" and f"{Mode.DENSE}" == "dense" and str(Mode.EXACT) == "exact"
    assert json.dumps({"mode": Mode.EXACT}) == '{"mode": "exact"}'
    assert {"sfi": 1}[Mode.SFI] == 1


def test_sfi_config_by_mode():
    cfg = sfi_jax.SFIConfig(k_select=64)
    assert Mode.DENSE.sfi_config(cfg) is None
    assert Mode.SFI.sfi_config(cfg) is cfg and Mode.EXACT.sfi_config(cfg) is cfg
    assert Mode.SFI.sfi_config(None) == sfi_jax.SFIConfig()
    with pytest.raises(ValueError, match="sfi must be an SFIConfig, got str"):
        Mode.EXACT.sfi_config("small")


@pytest.mark.parametrize("build", [cli.build_parser, serve_cli.build_parser])
def test_cli_mode_flag(build, capsys):
    assert build().parse_args(["--mode", "exact"]).mode is Mode.EXACT
    assert build().parse_args([]).mode is Mode.SFI
    with pytest.raises(SystemExit):
        build().parse_args(["--mode", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def test_stats_mode_is_a_mode(tiny_qwen3):
    """generate's stats hold the Mode it ran, and the decode path it took: a prompt within
    the SFI budget decodes densely."""
    out = sfi_jax.generate(tiny_qwen3.model, [[1, 2, 3]], max_new_tokens=2, mode="sfi")
    assert out.stats["mode"] is Mode.SFI and out.stats["decode_path"] is Mode.DENSE
    line = cli.stats_line("sfi", {**out.stats, "first_token_from_start_s": 0.0})
    assert line.endswith("fit the SFI budget")
    engine = sfi_jax.Engine(tiny_qwen3.model, mode="dense", max_slots=1, max_len=64)
    assert engine.mode is Mode.DENSE and engine.sfi is None


def test_the_server_command_names_its_missing_extra(monkeypatch):
    """Without the serve extra, `python -m sfi_jax.serve` parses its flags and then says which
    extra to install (the package imports its application lazily)."""
    import builtins

    real = builtins.__import__

    def without_extra(name, *args, **kw):
        if name.split(".")[0] in ("fastapi", "uvicorn"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", without_extra)
    with pytest.raises(SystemExit, match=r"serve extra \(pip install 'sfi_jax\[serve\]'\)"):
        serve_cli.main(["--host", "127.0.0.1", "--port", "0"])
