"""Where a decode chunk's device memory goes: compile `engine.decode_chunk` from shapes alone
(nothing allocated) for each (model, context, batch, arm) and print XLA's memory analysis
(arguments, outputs, aliased, temporaries) beside the KV cache size, plus the largest
temporary buffers of the buffer assignment. For finding why a row runs out of memory when
its cache fits (bench_e2e reports such rows).

    python scripts/diag_memory.py --rows qwen3-30b-a3b:65536:5:dense,qwen3-30b-a3b:32768:16:sfi
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_e2e  # noqa: E402  (sets the memory fraction and the checkout's import path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from sfi_jax.config import SFIConfig  # noqa: E402
from sfi_jax.models.config import PRESETS  # noqa: E402
from sfi_jax.models.modeling import fuse_qkv_weights  # noqa: E402
from sfi_jax.models.params import random_params  # noqa: E402
from sfi_jax.runtime import engine  # noqa: E402
from sfi_jax.runtime.sampling import SamplingConfig  # noqa: E402

GIB = 1 << 30


def largest_temps(dump_dir: str, n: int = 10):
    """The n largest values living in non-argument allocations (temporaries, outputs) of the
    newest decode_chunk buffer assignment, one per shape: (GiB, line)."""
    files = sorted(glob.glob(os.path.join(dump_dir, "*decode_chunk*buffer-assignment.txt")),
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", required=True, help="model:context:batch:arm (arm dense|sfi), ...")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    dump = tempfile.mkdtemp()  # read when the backend starts: set before any device work
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump} --xla_dump_hlo_as_text")
    results = []
    for spec in args.rows.split(","):
        name, ctx, B, arm = spec.split(":")
        ctx, B = int(ctx), int(B)
        cfg = PRESETS[name]
        ns = argparse.Namespace(chunk_steps=64, new_tokens=256)
        n, _, S = bench_e2e._steps(ctx, ns)
        sfi = SFIConfig(refresh_rows=min(B, max(2, B // 4))) if arm == "sfi" else None

        # one weight dict per layer with fused QKV, as bench_e2e and load_model run on GPU
        params = jax.eval_shape(lambda: random_params(cfg, "bfloat16", 0))
        layer = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in params["layers"].items()}
        layer = jax.eval_shape(fuse_qkv_weights, layer)
        params["layers"] = [layer] * cfg.num_layers
        state = jax.eval_shape(lambda: bench_e2e.make_state(cfg, B, S, ctx, sfi))
        vocab = jax.ShapeDtypeStruct((cfg.vocab_size,), jnp.bool_)
        forced = jax.ShapeDtypeStruct((B, n), jnp.int32)
        kw = dict(cfg=cfg, sfi=sfi, sampling=SamplingConfig(), n_steps=n, impl="auto")
        rec = dict(model=name, context=ctx, batch=B, arm=arm,
                   kv_cache_gib=cfg.kv_cache_bytes(B, S, 2) / GIB)
        try:
            compiled = engine.decode_chunk.lower(params, state, vocab, vocab, forced,
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
