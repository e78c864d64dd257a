"""Wall time of the README's quickstart command, cold (empty caches) and warm (a second run).

Runs `python -m sfi_jax.generate --max-new-tokens N` in a subprocess with SFI_JAX_CACHE_DIR
pointing at a fresh directory, first with it empty and then again; records for each run the
time until the answer starts streaming (first byte on stdout), the total wall time, the
child's CPU time, and the stats line (prefill, compile, decode tokens/s, and whether SFI mode
decoded densely: every prompt + new tokens fit its budget). With several --modes each runs
once first (compiling its programs: "cold", then "first"), then the warm runs take turns, and
the summary gives each mode's median warm decode tokens/s and its ratio to dense's. The
machine's load average is recorded too: on a shared machine the wall times move with it.

    python scripts/bench/bench_quickstart.py --out /tmp/quickstart.json
    python scripts/bench/bench_quickstart.py --modes sfi,dense --warm-runs 3 \
        --max-new-tokens 128 --out benchmarks/quickstart_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import selectors
import statistics
import subprocess
import sys
import tempfile
import time

STATS = re.compile(r"prefill \d+ prompt tokens in (?P<prefill_s>[\d.]+) s = [\d.]+ tokens/s \| "
                   r"compile (?P<compile_s>[\d.]+) s \| "
                   r"decode (?P<decode_tokens>\d+) tokens in (?P<decode_s>[\d.]+) s = "
                   r"(?P<decode_tokens_per_s>[\d.]+) tokens/s")


def run_once(cmd: list[str], env: dict) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    out, err, first = b"", b"", None
    while sel.get_map():
        for key, _ in sel.select():
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
            elif key.fileobj is proc.stdout:
                if first is None and chunk.strip():
                    first = time.perf_counter() - start
                out += chunk
            else:
                err += chunk
    rc = proc.wait()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    err_text = err.decode(errors="replace")
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}):\n{err_text[-3000:]}")
    m = STATS.search(err_text)
    stats = {k: float(v) for k, v in m.groupdict().items()} if m else {}
    stats["decoded_densely"] = "decoded densely" in err_text
    return {"wall_s": round(wall, 2), "first_token_s": None if first is None else round(first, 2),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
            "load_avg_1m": round(os.getloadavg()[0], 2), **stats,
            "text": out.decode(errors="replace").strip()}


def summary(runs: list[dict]) -> dict:
    """Per mode: its warm runs' decode tokens/s and their median, and that median over dense's
    (when dense ran)."""
    out = {}
    for r in runs:
        if r["kind"] == "warm" and "decode_tokens_per_s" in r:
            out.setdefault(str(r["mode"]), {"decode_tokens_per_s": []})[
                "decode_tokens_per_s"].append(r["decode_tokens_per_s"])
    for m in out.values():
        m["median"] = statistics.median(m["decode_tokens_per_s"])
    if "dense" in out:
        for m in out.values():
            m["vs_dense"] = round(m["median"] / out["dense"]["median"], 3)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--warm-runs", type=int, default=2, help="runs after the cold one")
    p.add_argument("--modes", default="",
                   help="comma-separated --mode values to run in turn (default: the command's "
                        "own default mode, no --mode flag)")
    args = p.parse_args(argv)
    base = [sys.executable, "-m", "sfi_jax.generate", "--max-new-tokens",
            str(args.max_new_tokens)]
    modes = [m for m in args.modes.split(",") if m] or [None]
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "SFI_JAX_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1"}
        cmds = {mode: base + ([] if mode is None else ["--mode", mode]) for mode in modes}
        for mode in modes:
            runs.append(dict(run_once(cmds[mode], env), kind="cold" if not runs else "first",
                             mode=mode))
        for _ in range(args.warm_runs):  # the modes take turns: the machine's load hits both
            runs += [dict(run_once(cmds[mode], env), kind="warm", mode=mode) for mode in modes]
    result = {"command": " ".join(["python"] + base[1:]), "modes": modes,
              "cpus": os.cpu_count(), "runs": runs, "summary": summary(runs)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in runs:
        print(f"{r['mode']} {r['kind']}: {r.get('decode_tokens_per_s')} tokens/s, "
              f"first token {r['first_token_s']} s, done {r['wall_s']} s, "
              f"cpu {r['cpu_s']} s, compile {r.get('compile_s')} s, prefill "
              f"{r.get('prefill_s')} s, decode {r.get('decode_s')} s, load {r['load_avg_1m']}")
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
