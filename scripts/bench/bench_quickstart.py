"""Wall time of the README's quickstart command, cold (empty caches) and warm (a second run).

Runs `python -m sfi_jax.generate --max-new-tokens N` in a subprocess with SFI_JAX_CACHE_DIR
pointing at a fresh directory, first with it empty and then again; records for each run the
time until the answer starts streaming (first byte on stdout), the total wall time, the
child's CPU time, and the stats line (prefill, compile, decode). The machine's load average is
recorded too: on a shared machine the wall times move with it.

    python scripts/bench/bench_quickstart.py --out /tmp/quickstart.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import selectors
import subprocess
import sys
import tempfile
import time

STATS = re.compile(r"prefill \d+ prompt tokens in (?P<prefill_s>[\d.]+) s = [\d.]+ tokens/s \| "
                   r"compile (?P<compile_s>[\d.]+) s \| "
                   r"decode (?P<decode_tokens>\d+) tokens in (?P<decode_s>[\d.]+) s")


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
    return {"wall_s": round(wall, 2), "first_token_s": None if first is None else round(first, 2),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
            "load_avg_1m": round(os.getloadavg()[0], 2), **stats,
            "text": out.decode(errors="replace").strip()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--warm-runs", type=int, default=2, help="runs after the cold one")
    args = p.parse_args(argv)
    cmd = [sys.executable, "-m", "sfi_jax.generate", "--max-new-tokens", str(args.max_new_tokens)]
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "SFI_JAX_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1"}
        runs = [dict(run_once(cmd, env), kind="cold")]
        runs += [dict(run_once(cmd, env), kind="warm") for _ in range(args.warm_runs)]
    result = {"command": " ".join(["python"] + cmd[1:]), "cpus": os.cpu_count(), "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in runs:
        print(f"{r['kind']}: first token {r['first_token_s']} s, done {r['wall_s']} s, "
              f"cpu {r['cpu_s']} s, compile {r.get('compile_s')} s, prefill "
              f"{r.get('prefill_s')} s, decode {r.get('decode_s')} s, load {r['load_avg_1m']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
