"""Where a batch-1 fused matmul's time goes, from %globaltimer stamps each program takes
(skinny_matmul_gpu.PHASE_STAMPS): t0 at its first instruction (after XLA's entry wait), t1 after
its K loop, t2 after its counter bump, t3 (the column block's last program) once its epilogue's
stores are visible. Chain: q/k/v (heads epilogue) -> a glue fusion standing in for the attention
-> o -> gate/up -> down -> the next layer's q/k/v, 36 layers on distinct random weights, one
row. Medians over the layers, us, per kernel (benchmarks/phases_batch1.json).

    python scripts/diag/diag_phases.py --model qwen3-4b --out /tmp/phases.json   # GPU only
    python scripts/diag/diag_phases.py --gate-up-programs 4,3,8 ...   # gate/up grid variants
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--gate-up-programs", default="4",
                   help="gate/up grid aims in programs per SM, comma-separated: one chain each")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sfi_jax.kernels import skinny_matmul_gpu as sm
    from sfi_jax.models.config import PRESETS

    sm.PHASE_STAMPS = True
    cfg = PRESETS[args.model]
    bf = jnp.bfloat16
    H, I, L = cfg.hidden_size, cfg.intermediate_size, args.layers
    hq, hkv, D = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    Q, NQKV = hq * D, (hq + 2 * hkv) * D

    def rand(key, k, n):
        return (jax.random.normal(key, (k, n), jnp.float32) / np.sqrt(k)).astype(bf)

    layers = []
    for l in range(L):
        ks = jax.random.split(jax.random.fold_in(jax.random.key(0), l), 6)
        layers.append(dict(qkv=rand(ks[5], H, NQKV), o=rand(ks[0], Q, H), g=rand(ks[1], H, I),
                           u=rand(ks[2], H, I), d=rand(ks[3], I, H),
                           ln=(1 + 0.2 * jax.random.normal(ks[4], (H,))).astype(bf)))
    x0 = jax.random.normal(jax.random.key(2), (1, H)).astype(bf)
    cos = jnp.cos(jnp.arange(D // 2, dtype=jnp.float32))[None] * 0.1
    sin = jnp.sin(jnp.arange(D // 2, dtype=jnp.float32))[None] * 0.1
    ones = jnp.ones((D,), bf)

    def run(ws, x, gu_cfg=None):
        sync = sm.new_sync()
        stamps = []
        for w in ws:
            q, k, v, sync, st = sm.skinny_matmul_fused(
                x, (w["qkv"],), w["ln"], sync, epilogue="heads", cos=cos, sin=sin, q_norm=ones,
                k_norm=ones, num_q_heads=hq, num_kv_heads=hkv)
            stamps.append(st)
            xa = (q.reshape(1, Q).astype(jnp.float32) + 1e-3 * jnp.sum(v.astype(jnp.float32))
                  ).astype(bf)  # the attention row stand-in
            h, sync, st = sm.skinny_matmul_fused(xa, (w["o"],), None, sync, epilogue="residual",
                                                 residual=x)
            stamps.append(st)
            gh, sync, st = sm.skinny_matmul_fused(h, (w["g"], w["u"]), w["ln"], sync,
                                                  epilogue="silu", config=gu_cfg)
            stamps.append(st)
            x, sync, st = sm.skinny_matmul_fused(gh, (w["d"],), None, sync, epilogue="residual",
                                                 residual=h)
            stamps.append(st)
        return x, stamps

    def measure(gu_cfg):
        f = jax.jit(functools.partial(run, gu_cfg=gu_cfg))
        for _ in range(3):  # warm-up, then the measured call
            x, stamps = f(layers, x0)
        jax.block_until_ready(x)
        x, stamps = f(layers, x0)
        st = [np.asarray(s)[:, :, 0].astype(np.int64) & 0xFFFFFFFF for s in stamps]
        ref = st[0][:, 0].min()
        st = [((s - ref + 2**31) % 2**32) - 2**31 for s in st]  # ns since the first start
        kinds = ["qkv", "o", "gate_up", "down"]
        rows = {k: [] for k in kinds}
        for c, s in enumerate(st):
            t0, t1, t2, t3 = s[:, 0], s[:, 1], s[:, 2], s[:, 3]
            nxt = st[c + 1][:, 0].min() if c + 1 < len(st) else None
            rows[kinds[c % 4]].append(dict(
                programs=len(t0), start_spread=t0.max() - t0.min(),
                loop_median=float(np.median(t1 - t0)), loop_max=(t1 - t0).max(),
                main_span=t1.max() - t0.min(), tail=t2.max() - t1.max(),
                epilogue=t3.max() - t2.max(),
                to_next_start=None if nxt is None else nxt - t3.max(),
                start_to_next_start=None if nxt is None else nxt - t0.min()))
        summary = {}
        for k, rs in rows.items():
            med = {f: statistics.median([r[f] for r in rs if r[f] is not None]) / 1e3
                   for f in rs[0] if f != "programs"}
            summary[k] = dict(programs=rs[0]["programs"],
                              **{f: round(v, 2) for f, v in med.items()})
        total = (st[-1][:, 3].max() - st[0][:, 0].min()) / 1e3 / L
        return summary, total

    results = {}
    print("| variant | kernel | programs | start spread | loop (median program) | loop (slowest) "
          "| first start -> last loop end | last loop end -> last counter | last program's "
          "epilogue | epilogue end -> next start | start -> next start |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for per_sm in [int(v) for v in args.gate_up_programs.split(",")]:
        gu = dataclasses.replace(sm.default_config(I, H, 1), programs=per_sm * sm._NUM_SMS)
        summary, total = measure(gu)
        label = f"gate/up {per_sm} per SM"
        results[label] = dict(kernels=summary, us_per_layer=round(total, 2))
        for k, m in summary.items():
            print(f"| {label} | {k} | {m['programs']} | {m['start_spread']} | "
                  f"{m['loop_median']} | {m['loop_max']} | {m['main_span']} | {m['tail']} | "
                  f"{m['epilogue']} | {m['to_next_start']} | {m['start_to_next_start']} |")
        print(f"| {label} | us per layer, first start to last epilogue end: {total:.1f} |")
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "command": "python " + " ".join(sys.argv), "model": args.model, "layers": L}
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "results_us": results}, fh, indent=1)


if __name__ == "__main__":
    main()
