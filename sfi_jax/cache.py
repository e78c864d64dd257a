"""On-disk caches: JAX's compiled programs and dequantised GGUF checkpoints.

A second run of the same command then skips most of the first one's start-up: compiling the
prefill and decode programs, and parsing and dequantising the GGUF file. Everything lives under
one root: `$SFI_JAX_CACHE_DIR`, else `$XDG_CACHE_HOME/sfi_jax`, else `~/.cache/sfi_jax`;
`SFI_JAX_CACHE_DIR=off` (or empty) turns both off.

What is loaded from a cache runs in this process (compiled programs are native code), so a
cache directory must belong to the user and be writable by nobody else (`private_dir`).
Files are written under temporary names made by `tempfile` in their directory and renamed
into place when complete; the temporary files of killed runs are removed (`remove_stale`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import tempfile
import time

_OFF = ("", "off", "none", "0", "false")


def cache_root() -> str | None:
    """The cache root directory, or None when `SFI_JAX_CACHE_DIR` turns caching off."""
    root = os.environ.get("SFI_JAX_CACHE_DIR")
    if root is not None:
        return None if root.strip().lower() in _OFF else os.path.expanduser(root.strip())
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sfi_jax")


def default_compilation_cache_dir() -> str | None:
    """Where the CLI keeps JAX's persistent compilation cache unless told otherwise."""
    root = cache_root()
    return None if root is None else os.path.join(root, "jax")


def enable_compilation_cache(directory: str) -> None:
    """Turn on JAX's persistent compilation cache in `directory`, for every program.

    JAX by default caches only programs that took over a second to compile; the CPU's many
    small programs add up too, so every size and compile time is kept. Call it before the
    first jitted call (what the CLI does); the API user writes the same three updates.
    The directory is refused unless private (`check_private`), and entries that cannot be
    read back are removed first (`remove_unreadable_entries`).
    """
    import jax

    directory = os.path.expanduser(directory)
    private_dir(directory)
    remove_stale(directory)
    remove_unreadable_entries(directory)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


CHECKED_ENTRIES = "sfi_jax-checked.json"


def remove_unreadable_entries(directory: str) -> list[str]:
    """Remove the entries of JAX's compilation cache in `directory` that do not decompress.

    JAX warns about an entry it cannot read, compiles the program again, and keeps the bad
    entry (it never overwrites one), so every later run compiles again. An entry is JAX's
    compressed executable (zlib, whose checksum catches any damage; zstd where installed,
    which catches damaged headers and lengths); entries already checked (by size and
    modification time, listed in CHECKED_ENTRIES) are not read again. Returns the names
    removed; nothing is checked when JAX's format functions are not where expected.
    """
    try:
        from jax._src.compilation_cache import decompress_executable
    except ImportError:
        return []
    record_path = os.path.join(directory, CHECKED_ENTRIES)
    try:
        with open(record_path, encoding="utf-8") as f:
            checked = dict(json.load(f))
    except (OSError, ValueError, TypeError):
        checked = {}
    removed, now = [], {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith("-cache"):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)
            if checked.get(name) != [st.st_size, st.st_mtime_ns]:
                with open(path, "rb") as f:
                    decompress_executable(f.read())
            now[name] = [st.st_size, st.st_mtime_ns]
        except OSError:
            continue
        except Exception:  # zlib.error, zstd errors: not an entry JAX can read
            for p in (path, path[:-len("-cache")] + "-atime"):
                if os.path.exists(p):
                    os.remove(p)
            removed.append(name)
    if now != checked:
        tmp = temp_path(directory, ".json")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(now, f)
            os.replace(tmp, record_path)
        except OSError:
            if os.path.exists(tmp):
                os.remove(tmp)
    if removed:
        print(f"sfi_jax: removed {len(removed)} unreadable entries from the compilation cache "
              f"{directory}; their programs are compiled and cached again", file=sys.stderr)
    return removed


# ---- directories, temporary files, checksums ----

TMP_PREFIX = ".tmp-"
STALE_AFTER_S = 24 * 3600  # a temporary file this old is stale whatever its process


def check_private(directory: str) -> None:
    """Refuse a cache directory that another user owns or that group or others may write."""
    st = os.stat(directory)
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise ValueError(f"cache directory {directory} belongs to another user (uid "
                         f"{st.st_uid}); use a directory of your own (SFI_JAX_CACHE_DIR) or "
                         "turn caching off (SFI_JAX_CACHE_DIR=off)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"cache directory {directory} is writable by group or others (mode "
                         f"{stat.S_IMODE(st.st_mode):o}); make it private (chmod go-w "
                         f"{directory}) or use another (SFI_JAX_CACHE_DIR, or 'off')")


def private_dir(directory: str, root: str | None = None) -> str:
    """Create `directory` (mode 700) if needed and check it and every directory between it
    and `root` (default: the cache root) with `check_private`."""
    root = os.path.abspath(root or cache_root() or directory)
    chain = [os.path.abspath(directory)]
    while chain[-1].startswith(root + os.sep):
        chain.append(os.path.dirname(chain[-1]))
    for d in reversed(chain):  # from the root down: nothing is made inside a refused one
        os.makedirs(d, mode=0o700, exist_ok=True)
        check_private(d)
    return directory


def temp_path(directory: str, suffix: str = "", folder: bool = False) -> str:
    """A new temporary file (or folder) in `directory`, created by `tempfile` (a fresh name,
    opened exclusively, mode 600/700); its name carries the process id for `remove_stale`."""
    prefix = f"{TMP_PREFIX}{os.getpid()}-"
    if folder:
        return tempfile.mkdtemp(suffix, prefix, directory)
    fd, path = tempfile.mkstemp(suffix, prefix, directory)
    os.close(fd)
    return path


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def remove_stale(directory: str) -> list[str]:
    """Remove the temporary files and folders that killed runs left in `directory`: those of
    processes that no longer exist, and any older than a day. Returns the names removed."""
    import re
    import shutil

    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = re.match(re.escape(TMP_PREFIX) + r"(\d+)-", name) or re.search(r"\.tmp(\d+)$", name)
        if not m:
            continue
        path = os.path.join(directory, name)
        try:
            old = time.time() - os.lstat(path).st_mtime > STALE_AFTER_S
        except OSError:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() and not old:
            continue
        if old or not _process_alive(pid):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.remove(path)
                except OSError:
                    continue
            removed.append(name)
    return removed


def file_digest(path: str) -> str:
    """sha256 of a file's bytes (hex)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files_under(path: str) -> list[str]:
    if not os.path.isdir(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, files in os.walk(path) for f in files)


def _digests(path: str, base: str) -> dict[str, str]:
    return {os.path.relpath(f, base): file_digest(f) for f in _files_under(path)}


def _sidecar(path: str) -> str:
    return path.rstrip(os.sep) + ".sha256.json"


def publish(tmp: str, dest: str, source_digest: str) -> None:
    """Move the finished temporary file or folder `tmp` to `dest` and record the checksums of
    what it holds and of the source it was made from beside it (`verified` checks them)."""
    import shutil

    base = os.path.dirname(dest)
    record = {"source": source_digest,
              "files": {os.path.join(os.path.basename(dest), os.path.relpath(f, tmp))
                        if os.path.isdir(tmp) else os.path.basename(dest): digest
                        for f, digest in ((f, file_digest(f)) for f in _files_under(tmp))}}
    if os.path.isdir(dest):
        shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    side = temp_path(base, ".json")
    try:
        with open(side, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(side, _sidecar(dest))
    except BaseException:
        discard(side)
        raise


def discard(path: str) -> None:
    """Remove a file or folder (and its checksum record), if there."""
    import shutil

    for p in (path, _sidecar(path)):
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            try:
                os.remove(p)
            except OSError:
                pass


def verified(dest: str, source_digest: str) -> bool:
    """Whether `dest` (a file or folder written by `publish`) holds exactly the files and bytes
    recorded beside it, made from the source with this digest."""
    try:
        with open(_sidecar(dest), encoding="utf-8") as f:
            record = json.load(f)
        if record.get("source") != source_digest:
            return False
        return _digests(dest, os.path.dirname(dest)) == record["files"]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False


def say_rebuilding(what: str, dest: str, why: str) -> None:
    """One line on stderr: a cache entry failed its check and is made again."""
    print(f"sfi_jax: the cached {what} {dest} {why}; rebuilding it", file=sys.stderr)
