"""Does the fused matmuls' L2 prefetch (`skinny_matmul_fused(prefetch=...)`) reach the next
kernel, and where does a batch-1 layer's time go between kernels?

Chains of the decode step's fused matmuls at one row on distinct random weights (so no weight
stays in L2 from call to call), each with one small XLA fusion making the next input:

- `o_same`: 36 output projections on one weight (L2-resident after the first: the bound a
  prefetch could reach); `o`: on 36 weights; `o_pf`: each asking L2 for the next one's whole
  weight.
- `layer`: o -> gate/up -> down, 36 layers; `layer_pf`: each kernel prefetching about --mb MiB of
  the next one's first rows (the output projection after down: all of it).

Per chain: us per link (wall), and from one profiled run per kernel name its mean duration,
the gaps between consecutive kernels on the stream, and the launch's grid, block, registers
and shared memory as the profiler records them.

    python scripts/diag/diag_l2_prefetch.py --out /tmp/l2_prefetch.json          # GPU
    python scripts/diag/diag_l2_prefetch.py --smoke --out /tmp/l2_prefetch.json  # CPU
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def trace_summary(trace_dir, calls):
    """Per kernel name over a trace: launches per call, mean us, the launch's recorded stats;
    and the gaps (us) between one kernel's end and the next one's start on each stream."""
    import jax

    paths = [os.path.join(r, f) for r, _, fs in os.walk(trace_dir) for f in fs
             if f.endswith(".xplane.pb")]
    if not paths:
        return None
    data = jax.profiler.ProfileData.from_file(paths[0])
    dur, cnt, stats, gaps = collections.defaultdict(list), collections.Counter(), {}, []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            prev_end = None
            for ev in sorted(line.events, key=lambda e: e.start_ns):
                name = ev.name[:60]
                dur[name].append(ev.duration_ns / 1e3)
                cnt[name] += 1
                if name not in stats:
                    try:
                        stats[name] = {k: str(v)[:80] for k, v in ev.stats}
                    except Exception as e:  # (the profiler's stats API varies)
                        stats[name] = {"error": repr(e)[:80]}
                if prev_end is not None:
                    gaps.append((ev.start_ns - prev_end) / 1e3)
                prev_end = ev.start_ns + ev.duration_ns
    return {"kernels": {n: {"per_call": cnt[n] / calls, "mean_us": statistics.mean(d),
                            "median_us": statistics.median(d), "stats": stats[n]}
                        for n, d in dur.items()},
            "gap_us": {"median": statistics.median(gaps) if gaps else None,
                       "mean": statistics.mean(gaps) if gaps else None,
                       "sum_per_call": sum(gaps) / calls if gaps else None}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--mb", type=float, default=8.0,
                   help="MiB of each next weight's first rows a layer_pf kernel prefetches")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import _common
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from sfi_jax.kernels import skinny_matmul_gpu as sm
    from sfi_jax.kernels import triton_lowering
    from sfi_jax.models.config import PRESETS

    interpret = jax.default_backend() != "gpu"
    cfg = PRESETS[args.model]
    if args.smoke:
        cfg = dataclasses.replace(cfg, hidden_size=64, intermediate_size=96, num_q_heads=4,
                                  num_kv_heads=2, head_dim=16)
        args.layers, args.iters, args.repeats = 2, 1, 1
    bf = jnp.bfloat16
    H, I, Q, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_q_heads * cfg.head_dim, args.layers
    nbytes = int(args.mb * (1 << 20))

    def rand(key, k, n):
        return (jax.random.normal(key, (k, n), jnp.float32) / np.sqrt(k)).astype(bf)

    layers = []
    for l in range(L):
        ks = jax.random.split(jax.random.fold_in(jax.random.key(0), l), 5)
        layers.append(dict(o=rand(ks[0], Q, H), g=rand(ks[1], H, I), u=rand(ks[2], H, I),
                           d=rand(ks[3], I, H),
                           ln=(1 + 0.2 * jax.random.normal(ks[4], (H,))).astype(bf)))
    xa0 = jax.random.normal(jax.random.key(1), (1, Q)).astype(bf)
    x0 = jax.random.normal(jax.random.key(2), (1, H)).astype(bf)

    def glue(xa, out):  # the next attention row, from the last output
        return (xa.astype(jnp.float32) + 1e-3 * jnp.tile(out, (1, -(-Q // H)))[:, :Q]
                .astype(jnp.float32)).astype(bf)

    def pf(ws, amount):
        return {} if ws is None else dict(prefetch=tuple(ws), prefetch_bytes=amount)

    def o_chain(same, prefetch):
        def run(ws, xa, x):
            sync = sm.new_sync()
            for l in range(L):
                w = ws[0 if same else l]
                nxt = None if not prefetch or l + 1 == L else (ws[l + 1]["o"],)
                x, sync = sm.skinny_matmul_fused(xa, (w["o"],), None, sync, epilogue="residual",
                                                 residual=x, interpret=interpret,
                                                 **pf(nxt, None))
                xa = glue(xa, x)
            return xa
        return jax.jit(run)

    def layer_chain(prefetch):
        def run(ws, xa, x):
            sync = sm.new_sync()
            for l, w in enumerate(ws):
                on = prefetch
                h, sync = sm.skinny_matmul_fused(xa, (w["o"],), None, sync, epilogue="residual",
                                                 residual=x, interpret=interpret,
                                                 **pf((w["g"], w["u"]) if on else None, nbytes))
                gh, sync = sm.skinny_matmul_fused(h, (w["g"], w["u"]), w["ln"], sync,
                                                  epilogue="silu", interpret=interpret,
                                                  **pf((w["d"],) if on else None, nbytes))
                nxt = (ws[l + 1]["o"],) if on and l + 1 < L else None
                x, sync = sm.skinny_matmul_fused(gh, (w["d"],), None, sync, epilogue="residual",
                                                 residual=h, interpret=interpret,
                                                 **pf(nxt, None))
                xa = glue(xa, x)
            return x
        return jax.jit(run)

    chains = {"o_same": o_chain(True, False), "o": o_chain(False, False),
              "o_pf": o_chain(False, True), "layer": layer_chain(False),
              "layer_pf": layer_chain(True)}
    outs = {n: np.asarray(f(layers, xa0, x0), np.float32) for n, f in chains.items()}
    # the prefetch changes no value
    same = {"o_pf == o": bool(np.array_equal(outs["o_pf"], outs["o"])),
            "layer_pf == layer": bool(np.array_equal(outs["layer_pf"], outs["layer"]))}
    print("values unchanged:", same, flush=True)
    rec = {"model": args.model, "layers": L, "prefetch_mib": args.mb,
           "prefetch_issued": triton_lowering.l2_prefetch_supported(interpret),
           "values_unchanged": same,
           "bytes": {"o": 2 * Q * H, "gate_up": 4 * H * I, "down": 2 * I * H},
           "us_per_link": {}, "profiles": {}}
    for _ in range(2):  # two rounds, each chain in turn
        for n, f in chains.items():
            us = _common.timeit(f, layers, xa0, x0, iters=args.iters, repeats=args.repeats) / L
            rec["us_per_link"].setdefault(n, []).append(round(us, 2))
            print(n, round(us, 2), flush=True)
    if not interpret and not args.no_profile:
        for n, f in chains.items():
            d = tempfile.mkdtemp()
            with jax.profiler.trace(d):
                for _ in range(3):
                    out = f(layers, xa0, x0)
                jax.block_until_ready(out)
            rec["profiles"][n] = trace_summary(d, 3)
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "command": "python " + " ".join(sys.argv)}
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "results": rec}, fh, indent=1)
    print("\n| chain | us per link (rounds) | kernels: mean us |")
    print("|---|---|---|")
    for n, v in rec["us_per_link"].items():
        prof = rec["profiles"].get(n) or {}
        ks = "; ".join(f"{k[:28]} {s['mean_us']:.1f} x{s['per_call']:.0f}"
                       for k, s in (prof.get("kernels") or {}).items())
        gap = (prof.get("gap_us") or {}).get("median")
        print(f"| {n} | {v} | {ks} | gap median {gap} |")


if __name__ == "__main__":
    main()
