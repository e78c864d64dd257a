"""Damaged caches heal or are refused: the GGUF weights cache after same-size corruption or
random bytes is rebuilt (said once), killed runs' temporary files are removed, a failed write
leaves nothing, a cache directory others may write or that another user owns is refused, and
unreadable entries of JAX's compilation cache are removed so that they are written again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import zlib

import jax
import numpy as np
import pytest

import sfi_jax
from gguf_files import synthetic_tokenizer, write_gguf
from sfi_jax import cache, cli
from sfi_jax.models import gguf_loader

WEIGHTS = "weights-f32-q2-kv1.safetensors"


@pytest.fixture()
def tiny_gguf(tmp_path):
    return write_gguf(tmp_path / "tiny.gguf", tokenizer=synthetic_tokenizer("smollm"),
                      weights=True)


@pytest.fixture()
def reference(tiny_gguf, monkeypatch):
    """The weights loaded with the cache off (straight from the file)."""
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", "off")
    ref = jax.tree.map(np.asarray, sfi_jax.load_model(tiny_gguf, dtype="float32").params)
    return ref


def _load(path):
    return jax.tree.map(np.asarray, sfi_jax.load_model(path, dtype="float32").params)


def _equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def _entry(tmp_path):
    (entry,) = (tmp_path / "cache" / "gguf").iterdir()
    return entry


@pytest.mark.parametrize("damage", ["zeros", "random"])
def test_same_size_damage_is_rebuilt_once(tiny_gguf, reference, tmp_path, monkeypatch, capsys,
                                          damage):
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    _equal(_load(tiny_gguf), reference)
    weights = _entry(tmp_path) / WEIGHTS
    size, data = weights.stat().st_size, weights.read_bytes()
    start = size // 2  # inside the tensor data, past the header
    n = 4096
    junk = bytes(n) if damage == "zeros" else np.random.default_rng(0).bytes(n)
    with open(weights, "r+b") as f:
        f.seek(start)
        f.write(junk)
    assert weights.stat().st_size == size and weights.read_bytes() != data
    capsys.readouterr()
    _equal(_load(tiny_gguf), reference)
    err = capsys.readouterr().err
    assert err.count("rebuilding it") == 1 and WEIGHTS in err, err
    assert weights.read_bytes() == data  # rewritten
    _equal(_load(tiny_gguf), reference)
    assert "rebuilding" not in capsys.readouterr().err


def test_damaged_config_and_tokenizer_are_rebuilt(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    cfg = gguf_loader.gguf_config(tiny_gguf)
    ids = sfi_jax.load_tokenizer(tiny_gguf)("the 123")["input_ids"]
    entry = _entry(tmp_path)
    raw = (entry / "config.json").read_text()
    (entry / "config.json").write_text(raw.replace('"num_layers": 2', '"num_layers": 3'))
    (entry / "tokenizer" / "settings.json").write_text("{}")
    gguf_loader._reader_at.cache_clear()
    assert gguf_loader.gguf_config(tiny_gguf) == cfg
    assert sfi_jax.load_tokenizer(tiny_gguf)("the 123")["input_ids"] == ids
    assert capsys.readouterr().err.count("rebuilding it") == 2
    assert (entry / "config.json").read_text() == raw


def test_stale_temporary_files_are_removed(tiny_gguf, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    _load(tiny_gguf)
    entry = _entry(tmp_path)
    dead = 2 ** 22 + 12345  # above the kernel's pid_max default: no such process
    stale = [entry / f".tmp-{dead}-abc.safetensors", entry / f"{WEIGHTS}.tmp{dead}"]
    (entry / f".tmp-{dead}-dir").mkdir()
    (entry / f".tmp-{dead}-dir" / "tokenizer.json").write_text("x")
    old = entry / f".tmp-{os.getpid()}-old"
    live = entry / f".tmp-{os.getpid()}-live"
    for p in stale + [old, live]:
        p.write_bytes(b"\0" * 100)
    day_ago = time.time() - 2 * cache.STALE_AFTER_S
    os.utime(old, (day_ago, day_ago))
    _equal(_load(tiny_gguf), reference)
    left = sorted(p.name for p in entry.iterdir() if ".tmp" in p.name)
    assert left == [live.name]


def test_failed_write_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    """A run stopped while it writes the weights (here Ctrl-C inside save_file) leaves no
    temporary file and no entry behind."""
    import safetensors.numpy

    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    real = safetensors.numpy.save_file

    def interrupted(tensors, path, *a, **k):
        real(tensors, path, *a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.numpy, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sfi_jax.load_model(tiny_gguf, dtype="float32")
    assert sorted(p.name for p in _entry(tmp_path).iterdir()) == [
        "config.json", "config.json.sha256.json"]  # written before the weights


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_writable_by_others_is_refused(tiny_gguf, tmp_path, monkeypatch, mode):
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, mode)
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(root))
    with pytest.raises(ValueError, match=rf"cache directory {root} is writable by group or "
                                         rf"others \(mode {mode:o}\)"):
        sfi_jax.load_model(tiny_gguf, dtype="float32")
    with pytest.raises(ValueError, match=rf"cache directory {root} is writable by group"):
        cache.enable_compilation_cache(str(root))
    with pytest.raises(SystemExit) as e:
        cli.main(["--compile-cache", str(root), "--prompt", "x"])
    assert str(e.value.code).startswith(f"error: --compile-cache: cache directory {root} is "
                                        "writable by group or others")


def test_inner_directory_writable_by_others_is_refused(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    _load(tiny_gguf)
    os.chmod(_entry(tmp_path), 0o777)
    with pytest.raises(ValueError, match=f"cache directory {_entry(tmp_path)} is writable"):
        sfi_jax.load_model(tiny_gguf, dtype="float32")


def test_directory_of_another_user_is_refused(tiny_gguf, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("SFI_JAX_CACHE_DIR", str(root))
    monkeypatch.setattr(os, "geteuid", lambda: root.stat().st_uid + 1)
    with pytest.raises(ValueError, match=rf"cache directory {root} belongs to another user"):
        sfi_jax.load_model(tiny_gguf, dtype="float32")


def test_unreadable_compile_cache_entries_are_removed(tmp_path, capsys):
    from jax._src.compilation_cache import compress_executable

    d = tmp_path / "jax"
    d.mkdir(mode=0o700)
    good = compress_executable(b"\0\0\0\7" + b"an executable")
    (d / "good-cache").write_bytes(good)
    (d / "good-atime").write_bytes(b"12345678")
    (d / "bad-cache").write_bytes(np.random.default_rng(0).bytes(200))
    (d / "bad-atime").write_bytes(b"12345678")
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0xFF
    (d / "flipped-cache").write_bytes(bytes(flipped))
    if isinstance(good, bytes) and zlib.decompress(good):  # JAX uses zlib here: checksummed
        expected = ["bad-cache", "flipped-cache"]
    else:
        expected = ["bad-cache"]
    assert cache.remove_unreadable_entries(str(d)) == expected
    assert sorted(p.name for p in d.iterdir()) == ["good-atime", "good-cache",
                                                   cache.CHECKED_ENTRIES]
    assert f"removed {len(expected)} unreadable entries" in capsys.readouterr().err
    assert cache.remove_unreadable_entries(str(d)) == []


RUN = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("always")
    from sfi_jax.cache import enable_compilation_cache
    enable_compilation_cache(sys.argv[1])
    import jax, jax.numpy as jnp
    print(float(jax.jit(lambda x: jnp.sin(x) * 3)(jnp.float32(0.5))))
""")


@pytest.mark.slow  # three processes (~25 s); remove_unreadable_entries is tested above
def test_garbage_compile_cache_entry_is_written_again(tmp_path):
    """The next run after an entry was damaged compiles once and writes the entry again; the
    run after that reads it without a warning."""
    d = tmp_path / "jax"

    def run():
        res = subprocess.run([sys.executable, "-c", RUN, str(d)], capture_output=True,
                             text=True, timeout=120,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert res.returncode == 0, res.stderr[-2000:]
        return res

    first = run()
    entries = sorted(p for p in d.iterdir() if p.name.endswith("-cache"))
    written = [p.read_bytes() for p in entries]
    garbage = [np.random.default_rng(i).bytes(len(w)) for i, w in enumerate(written)]
    for p, g in zip(entries, garbage):
        p.write_bytes(g)
    second = run()
    assert f"removed {len(entries)} unreadable entries" in second.stderr
    assert "Error reading persistent compilation cache" not in second.stderr
    assert all(p.read_bytes() != g for p, g in zip(entries, garbage))  # written again
    third = run()
    assert third.stdout == first.stdout == second.stdout
    assert "Error reading" not in third.stderr and "unreadable" not in third.stderr
