"""Where a decode chunk's device memory goes: compile `runtime.decode.decode_chunk` from shapes
(nothing allocated) for each (model, context, batch, arm) and print XLA's memory analysis
(arguments, outputs, aliased, temporaries) beside the KV cache size, plus the largest
temporary buffers of the buffer assignment. For finding why a row runs out of memory when
its cache fits (bench_e2e reports such rows).

    python scripts/diag/diag_memory.py --rows qwen3-30b-a3b:65536:5:dense,qwen3-30b-a3b:32768:16:sfi

--fit MODEL:CONTEXT:BATCH instead creates the model's random weights, splits them per layer
(`--split host` or `device`: `modeling.split_layers`' two paths), prints the allocator's
statistics (largest free block) and tries to allocate that row's K and V caches.

    python scripts/diag/diag_memory.py --fit qwen3-30b-a3b:65536:10 --split device

--engine MODEL:SLOTS:MAX_LEN:MODE instead builds `sfi_jax.Engine` as the server does (random
weights of a preset, or the embedded model), serves a few prompts up to MAX_LEN - 64 tokens and
prints XLA's memory analysis of every program it compiled, largest temporaries first (which
program holds a second copy of the slots' cache).

    python scripts/diag/diag_memory.py --engine qwen3-4b:7:40960:sfi
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
import time

# as the benchmark runs: JAX may take most of the device
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
from _common import chunk_plan, make_state  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from sfi_jax.config import SFIConfig  # noqa: E402
from sfi_jax.models.config import PRESETS  # noqa: E402
from sfi_jax.models.modeling import fuse_qkv_weights, split_layers  # noqa: E402
from sfi_jax.models.params import random_params  # noqa: E402
from sfi_jax.options import EngineOptions  # noqa: E402
from sfi_jax.runtime import decode  # noqa: E402
from sfi_jax.runtime.sampling import SamplingConfig  # noqa: E402

GIB = 1 << 30


def largest_temps(dump_dir: str, n: int = 10, path: str | None = None):
    """The n largest values living in non-argument allocations (temporaries, outputs) of the
    newest decode_chunk buffer assignment (or of the file `path`), one per shape:
    (GiB, line)."""
    files = [path] if path else sorted(
        glob.glob(os.path.join(dump_dir, "*decode_chunk*buffer-assignment.txt")),
        key=os.path.getmtime)  # the newest: this row's compile
    if not files:
        return []
    best, in_arg = {}, False
    for line in open(files[-1]):
        if line.startswith("allocation "):
            in_arg = "parameter" in line
        m = re.match(r"\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (.*)", line)
        if m and not in_arg:
            size, shape = int(m.group(2)), m.group(3)[:120]
            if size > best.get(shape, (0,))[0]:
                best[shape] = (size, m.group(1))
    top = sorted(((size, name, shape) for shape, (size, name) in best.items()), reverse=True)
    return [(size / GIB, f"{name}: {shape}") for size, name, shape in top[:n]]


def fit(spec: str, split: str, out: str | None):
    """Random weights split per layer one way, then the row's K and V caches: do they fit?"""
    name, ctx, B = spec.split(":")
    cfg, ctx, B = PRESETS[name], int(ctx), int(B)
    S = chunk_plan(ctx, 64, 256)[2]  # bench_e2e's default run
    params = random_params(cfg, "bfloat16", 0)
    params["layers"] = split_layers(params["layers"], fuse_qkv=True, via_host=split == "host")
    jax.block_until_ready(params)
    stats = jax.devices()[0].memory_stats() or {}
    rec = dict(model=name, context=ctx, batch=B, split=split, device=jax.devices()[0].device_kind,
               cache_gib_each=cfg.kv_cache_bytes(B, S, 2) / 2 / GIB,
               memory_stats_after_split={k: v / GIB for k, v in stats.items()
                                         if isinstance(v, (int, float)) and "bytes" in k})
    shape = (cfg.num_layers, B, cfg.num_kv_heads, S, cfg.head_dim)
    try:
        k = jnp.zeros(shape, jnp.bfloat16).block_until_ready()
        v = jnp.zeros(shape, jnp.bfloat16).block_until_ready()
        rec["fits"] = True
        del k, v
    except Exception as e:  # noqa: BLE001 - out of memory is the answer here
        rec["fits"], rec["error"] = False, str(e).splitlines()[0][:300]
    print(json.dumps(rec, indent=1), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(rec, f, indent=1)


def engine_programs(spec: str, out: str | None):
    """An Engine as the server builds it; every program it compiled while serving a short,
    a middle and a longest prompt: arguments, outputs, aliased and temporary GiB, and the
    largest temporaries of each module's buffer assignment."""
    import sfi_jax
    from sfi_jax.runtime import programs

    dump = _dump_buffer_assignments()

    name, slots, max_len, mode = spec.split(":")
    slots, max_len = int(slots), int(max_len)
    model = sfi_jax.load_model(name)
    eng = sfi_jax.Engine(model, max_slots=slots, max_len=max_len, mode=mode).start()
    try:
        lens = sorted({16, max_len // 2, max_len - 64})
        for n in lens + lens[-1:]:  # the longest twice: its second run is compiled already
            t = time.perf_counter()
            eng.submit(sfi_jax.Request(prompt=[100 + i % 1000 for i in range(n)],
                                       max_tokens=32)).result(timeout=1800)
            print(f"prompt {n} + 32 new tokens alone: {time.perf_counter() - t:.2f} s",
                  flush=True)
    finally:
        eng.stop()
    from sfi_jax.runtime.state import cache_dtype

    itemsize = jnp.dtype(cache_dtype(model.dtype)).itemsize  # (float32 on a CPU)
    cache = model.config.kv_cache_bytes(slots, eng.cache_len, itemsize) / GIB
    rows = []
    for key, prog in programs._PROGRAMS.items():
        m = prog.memory_analysis()
        statics = {k: v for k, v in dict(key[3]).items() if k not in ("cfg", "options")}
        rows.append(dict(program=key[0], statics=str(statics)[:200],
                         args_gib=m.argument_size_in_bytes / GIB,
                         out_gib=m.output_size_in_bytes / GIB,
                         alias_gib=m.alias_size_in_bytes / GIB,
                         temp_gib=m.temp_size_in_bytes / GIB))
    rows.sort(key=lambda r: -r["temp_gib"])
    print(f"slots' KV cache: {cache:.2f} GiB")
    print("| program | args | out | alias | temp | statics |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['program']} | {r['args_gib']:.2f} | {r['out_gib']:.2f} | "
              f"{r['alias_gib']:.2f} | {r['temp_gib']:.2f} | {r['statics']} |")
    # the largest temporaries of every compiled module that holds over 0.5 GiB of them
    temps = {}
    for path in sorted(glob.glob(os.path.join(dump, "*buffer-assignment.txt"))):
        top = largest_temps(dump, 6, path)
        if top and top[0][0] > 0.5:
            temps[os.path.basename(path)] = top
            print(os.path.basename(path))
            for gib, line in top:
                print(f"  {gib:8.2f} GiB  {line}")
    if out:
        with open(out, "w") as f:
            json.dump(dict(engine=spec, cache_gib=cache, programs=rows, largest_temps=temps),
                      f, indent=1)


def _dump_buffer_assignments() -> str:
    """A directory where XLA dumps every compiled module (its buffer assignment included)."""
    dump = tempfile.mkdtemp()  # read when the backend starts: set before any device work
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump} --xla_dump_hlo_as_text")
    # the buffer assignment is dumped by a compile: a program read from a persistent
    # compilation cache (JAX_COMPILATION_CACHE_DIR) would leave none
    jax.config.update("jax_enable_compilation_cache", False)
    return dump


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", help="model:context:batch:arm (arm dense|sfi), ...")
    ap.add_argument("--fit", help="model:context:batch: split random weights, then allocate K, V")
    ap.add_argument("--split", choices=("host", "device"), default="host")
    ap.add_argument("--engine", help="model:slots:max_len:mode: every program of an Engine")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args(argv)
    if args.fit:
        fit(args.fit, args.split, args.out)
        return
    if args.engine:
        engine_programs(args.engine, args.out)
        return
    if not args.rows:
        ap.error("give --rows or --fit")
    dump = _dump_buffer_assignments()
    results = []
    for spec in args.rows.split(","):
        name, ctx, B, arm = spec.split(":")
        ctx, B = int(ctx), int(B)
        cfg = PRESETS[name]
        n, _, S = chunk_plan(ctx, 64, 256)  # bench_e2e's default run
        sfi = SFIConfig(refresh_rows=min(B, max(2, B // 4))) if arm == "sfi" else None

        # one weight dict per layer with fused QKV, as bench_e2e and load_model run on GPU
        params = jax.eval_shape(lambda: random_params(cfg, "bfloat16", 0))
        layer = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in params["layers"].items()}
        layer = jax.eval_shape(fuse_qkv_weights, layer)
        params["layers"] = [layer] * cfg.num_layers
        state = jax.eval_shape(lambda: make_state(cfg, B, S, ctx, sfi))
        vocab = jax.ShapeDtypeStruct((cfg.vocab_size,), jnp.bool_)
        forced = jax.ShapeDtypeStruct((B, n), jnp.int32)
        kw = dict(cfg=cfg, sfi=sfi, sampling=SamplingConfig(), n_steps=n,
                  options=EngineOptions().resolved())
        rec = dict(model=name, context=ctx, batch=B, arm=arm,
                   kv_cache_gib=cfg.kv_cache_bytes(B, S, 2) / GIB)
        try:
            compiled = decode.decode_chunk.lower(params, state, vocab, vocab, forced,
                                                 **kw).compile()
            m = compiled.memory_analysis()
            rec.update({k: getattr(m, k) / GIB for k in (
                "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                "temp_size_in_bytes") if hasattr(m, k)})
        except Exception as e:  # noqa: BLE001 - the point is to see the failure
            rec["error"] = str(e).splitlines()[0][:300]
        rec["largest_buffers"] = largest_temps(dump)
        results.append(rec)
        print(json.dumps(rec, indent=1), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print("| model | ctx | batch | arm | cache GiB | args | out | alias | temp |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['context']} | {r['batch']} | {r['arm']} | "
              f"{r['kv_cache_gib']:.1f} | " + " | ".join(
                  f"{r.get(k, float('nan')):.1f}" for k in (
                      "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                      "temp_size_in_bytes")) + " |")


if __name__ == "__main__":
    main()
