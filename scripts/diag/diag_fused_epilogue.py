"""The matmul kernel's fused epilogues on the device, at a model's real shapes: each epilogue
(q/k/v heads, gate/up SiLU product, o and down residual adds) against the same product made by
the unfused path (the kernel's split sums added by XLA, then jnp), for 1-4 rows; the same
call repeated many times must give the same bits every time (a missed ordering between a
split's stores and the last program's loads would show as an occasional difference) and
leave the counters at zero.

    python scripts/diag/diag_fused_epilogue.py --models qwen3-4b,qwen3-0.6b --out /tmp/fused.json
    python scripts/diag/diag_fused_epilogue.py --smoke --out /tmp/fused.json   # CPU, interpret
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cases(cfg):
    """(name, epilogue, K, N, number of weights, normed)"""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return [("qkv", "heads", h, qkv, 1, True), ("o", "residual", cfg.num_q_heads * cfg.head_dim,
                                                  h, 1, False),
            ("gate_up", "silu", h, inter, 2, True), ("down", "residual", inter, h, 1, False)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen3-4b,qwen3-0.6b")
    p.add_argument("--rows", default="1,2,3,4")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--smoke", action="store_true", help="a tiny shape, a few repeats (CPU)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import _common  # noqa: F401  (imports jax; puts this checkout's package on the path)
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from sfi_jax.kernels import heads_reference
    from sfi_jax.kernels import skinny_matmul as dispatch
    from sfi_jax.models.config import PRESETS

    eps = 1e-6
    if args.smoke:
        models = {"tiny": dataclasses.replace(
            PRESETS["qwen3-0.6b"], hidden_size=64, intermediate_size=96, num_q_heads=4,
            num_kv_heads=2, head_dim=16)}
        args.repeats, rows_list = 2, [1, 3]
    else:
        models = {m: PRESETS[m] for m in args.models.split(",")}
        rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for name, cfg in models.items():
        for case, epilogue, k, n, n_w, normed in cases(cfg):
            for rows in rows_list:
                ks = jax.random.split(jax.random.key(rows * 7 + n), 8)
                bf = jnp.bfloat16
                x = (2 * jax.random.normal(ks[0], (rows, k))).astype(bf)
                ws = tuple((jax.random.normal(ks[1 + i], (k, n)) / np.sqrt(k)).astype(bf)
                           for i in range(n_w))
                norm = (1 + 0.2 * jax.random.normal(ks[3], (k,))).astype(bf) if normed else None
                res = jax.random.normal(ks[4], (rows, n)).astype(bf)
                d, hq, hkv = cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
                cos = jax.random.uniform(ks[5], (rows, d // 2), minval=-1, maxval=1)
                sin = jax.random.uniform(ks[6], (rows, d // 2), minval=-1, maxval=1)
                qn = (1 + 0.2 * jax.random.normal(ks[7], (d,))).astype(bf)
                kw = {"residual": dict(residual=res), "silu": {},
                      "heads": dict(cos=cos, sin=sin, q_norm=qn, k_norm=qn, num_q_heads=hq,
                                    num_kv_heads=hkv)}[epilogue]

                fused = jax.jit(lambda x, s: dispatch.skinny_matmul_fused(
                    x, ws, norm, s, epilogue=epilogue, eps=eps, **kw))

                @jax.jit
                def unfused(x):  # the kernel's split sums, then jnp (the "xla" epilogue)
                    ys = [y.astype(bf) for y in dispatch.skinny_matmul(
                        x, ws, norm, eps=eps, impl="kernel")]
                    if epilogue == "residual":
                        return (res + ys[0],)
                    if epilogue == "silu":
                        return (jax.nn.silu(ys[0]) * ys[1],)
                    return heads_reference.norm_rope_heads(ys[0], cos, sin, qn, qn,
                                                           num_q_heads=hq, num_kv_heads=hkv,
                                                           eps=eps)

                sync = dispatch.new_sync()
                *first, sync = fused(x, sync)
                want = unfused(x)
                err = max(float(jnp.linalg.norm((a - b).astype(jnp.float32))
                                / jnp.linalg.norm(b.astype(jnp.float32)))
                          for a, b in zip(first, want))
                differ = 0
                for _ in range(args.repeats):
                    *again, sync = fused(x, sync)
                    differ += any(bool(jnp.any(a != b)) for a, b in zip(again, first))
                row = dict(model=name, case=case, epilogue=epilogue, rows=rows, k=k, n=n,
                           rel_err=err, repeats=args.repeats, runs_that_differ=differ,
                           counters_zero=bool(jnp.all(sync == 0)),
                           ok=err < 2e-2 and differ == 0 and bool(jnp.all(sync == 0)))
                results.append(row)
                print(json.dumps(row), flush=True)
    out = dict(device=str(jax.devices()[0]), jax=jax.__version__, results=results,
               all_ok=all(r["ok"] for r in results))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("fused epilogues:", "all ok" if out["all_ok"] else "FAILED", flush=True)
    return 0 if out["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
