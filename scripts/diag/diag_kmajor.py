"""The K-major weight-streaming matmul (weights [N, K], whole K per program, no split sums)
against the fused split-K kernels the decode loop runs, at one decode row, on the device.

A layer here is the decode step's o -> gate/up -> down sequence (o and down with the residual
add, gate/up RMS-normed with the SiLU product), 36 of them back to back on distinct weights
(so no weight stays in L2), plus one small XLA fusion per layer that makes the next layer's
attention row from the last output. Each variant is also timed per projection (36 calls of
one projection, same glue), which picks the best K-major tiles per projection; the layer chain
is then timed with those. Outputs are checked against the fused kernels'.

    python scripts/diag/diag_kmajor.py --models qwen3-4b,qwen3-0.6b --out /tmp/kmajor.json
    python scripts/diag/diag_kmajor.py --smoke --out /tmp/kmajor.json   # CPU, interpret
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = "2:512:4:3,4:512:4:3,4:512:4:3:4,4:512:4:3:8,2:512:4:3:8,4:256:4:4:8,2:1024:4:3:8,8:256:4:3:4"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen3-4b,qwen3-0.6b")
    p.add_argument("--configs", default=CONFIGS,
                   help="bn:bk:warps:stages[:programs per SM[:tiles loaded ahead]], "
                        "comma-separated")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--layer-only", action="store_true",
                   help="only the layer chain: fused and each config alike, --rounds times in turn")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--xla-rows", type=int, default=0,
                   help="also time XLA's layer chain at this many rows with [K, N] and [N, K] "
                        "weights (the layout's cost where the kernel does not run)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import _common
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from sfi_jax.kernels import skinny_matmul_gpu as sm
    from sfi_jax.models.config import PRESETS

    interpret = jax.default_backend() != "gpu"
    if args.smoke:
        models = {"tiny": dataclasses.replace(
            PRESETS["qwen3-0.6b"], hidden_size=64, intermediate_size=96, num_q_heads=4,
            num_kv_heads=2, head_dim=16)}
        args.layers, args.iters, reps = 2, 1, 1
        cfgs = {"kmajor:8:32:4:2": _common.kmajor_config("8:32:4:2")}
    else:
        models = {m: PRESETS[m] for m in args.models.split(",")}
        reps = 5
        cfgs = {f"kmajor:{c}": _common.kmajor_config(c) for c in args.configs.split(",")}
    bf = jnp.bfloat16
    eps = 1e-6
    results = []
    for name, cfg in models.items():
        H, I, Q = cfg.hidden_size, cfg.intermediate_size, cfg.num_q_heads * cfg.head_dim
        L = args.layers
        key = jax.random.key(0)

        def rand_t(key, n, k):  # [N, K] and its [K, N] copy
            wt = (jax.random.normal(key, (n, k), jnp.float32) / np.sqrt(k)).astype(bf)
            return wt, jnp.asarray(wt.T)

        layers = []
        for l in range(L):
            ks = jax.random.split(jax.random.fold_in(key, l), 5)
            o, g, u, d = rand_t(ks[0], H, Q), rand_t(ks[1], I, H), rand_t(ks[2], I, H), \
                rand_t(ks[3], H, I)
            ln = (1 + 0.2 * jax.random.normal(ks[4], (H,))).astype(bf)
            layers.append(dict(o=o, g=g, u=u, d=d, ln=ln))
        kn = [{k: (v[1] if isinstance(v, tuple) else v) for k, v in lw.items()} for lw in layers]
        nk = [{k: (v[0] if isinstance(v, tuple) else v) for k, v in lw.items()} for lw in layers]
        xa0 = jax.random.normal(jax.random.key(1), (1, Q)).astype(bf)
        x0 = jax.random.normal(jax.random.key(2), (1, H)).astype(bf)

        def glue(xa, out):  # the next layer's attention row, from the last output
            return (xa.astype(jnp.float32) + 1e-3 * jnp.tile(out, (1, -(-Q // H)))[:, :Q]
                    .astype(jnp.float32)).astype(bf)

        def fused_proj(which, w, x, res, sync):
            if which == "o":
                return sm.skinny_matmul_fused(x, (w["o"],), None, sync, epilogue="residual",
                                              residual=res, eps=eps, interpret=interpret)
            if which == "gu":
                return sm.skinny_matmul_fused(x, (w["g"], w["u"]), w["ln"], sync,
                                              epilogue="silu", eps=eps, interpret=interpret)
            return sm.skinny_matmul_fused(x, (w["d"],), None, sync, epilogue="residual",
                                          residual=res, eps=eps, interpret=interpret)

        def kmajor_proj(which, w, x, res, c):
            if which == "o":
                return sm.skinny_matmul_kmajor(x, (w["o"],), None, epilogue="residual",
                                               residual=res, eps=eps, interpret=interpret,
                                               config=c)
            if which == "gu":
                return sm.skinny_matmul_kmajor(x, (w["g"], w["u"]), w["ln"], epilogue="silu",
                                               eps=eps, interpret=interpret, config=c)
            return sm.skinny_matmul_kmajor(x, (w["d"],), None, epilogue="residual",
                                           residual=res, eps=eps, interpret=interpret, config=c)

        def layer_chain(variant, per_proj=None):
            def run(ws, xa, x):
                sync = sm.new_sync()
                for w in ws:
                    if variant == "fused":
                        h, sync = fused_proj("o", w, xa, x, sync)
                        gh, sync = fused_proj("gu", w, h, None, sync)
                        x, sync = fused_proj("d", w, gh, h, sync)
                    else:
                        h = kmajor_proj("o", w, xa, x, per_proj["o"])
                        gh = kmajor_proj("gu", w, h, None, per_proj["gu"])
                        x = kmajor_proj("d", w, gh, h, per_proj["d"])
                    xa = glue(xa, x)
                return x
            return jax.jit(run)

        def proj_chain(which, variant, c=None):
            def run(ws, xa, x):
                sync = sm.new_sync()
                gin = jnp.tile(x, (1, -(-I // H)))[:, :I]
                for w in ws:
                    xin = {"o": xa, "gu": x, "d": gin}[which]
                    res = x if which != "gu" else None
                    if variant == "fused":
                        y, sync = fused_proj(which, w, xin, res, sync)
                    else:
                        y = kmajor_proj(which, w, xin, res, c)
                    xa = glue(xa, y)
                    x = (x.astype(jnp.float32) + 1e-3 * xa[:, :1].astype(jnp.float32)).astype(bf)
                    gin = (gin.astype(jnp.float32) + 1e-3 * xa[:, :1].astype(jnp.float32)).astype(bf)
                return xa
            return jax.jit(run)

        def timed(fn, ws):
            return _common.timeit(fn, ws, xa0, x0, iters=args.iters, repeats=reps) / L

        rec = {"model": name, "layers": L,
               "bytes_per_layer": {"o": 2 * H * Q, "gu": 4 * I * H, "d": 2 * H * I}}
        if args.xla_rows:
            from sfi_jax.kernels import skinny_matmul_reference as xref

            def xla_chain(transposed):
                def run(ws, xa, x):
                    for w in ws:
                        def mm(v, names, norm=None):
                            return [y.astype(bf) for y in xref.skinny_matmul(
                                v, tuple(w[n] for n in names), norm, eps=eps,
                                transposed=transposed)]
                        h = x + mm(xa, ("o",))[0]
                        g, u = mm(h, ("g", "u"), w["ln"])
                        x = h + mm((jax.nn.silu(g.astype(jnp.float32)) *
                                    u.astype(jnp.float32)).astype(bf), ("d",))[0]
                        xa = glue(xa, x)
                    return x
                return jax.jit(run)
            R = args.xla_rows
            xr, xar = jnp.tile(x0, (R, 1)), jnp.tile(xa0, (R, 1))
            rec["xla_layer_us"] = {
                lab: _common.timeit(xla_chain(t), ws, xar, xr, iters=args.iters,
                                    repeats=reps) / L
                for lab, t, ws in (("kn", False, kn), ("nk", True, nk))}
            rec["xla_rows"] = R
            print(name, "xla rows", R, rec["xla_layer_us"], flush=True)
        ref = layer_chain("fused")(kn[:1], xa0, x0)
        if args.layer_only:  # each variant compiled once, timed in turn round after round
            fns = {"fused": (layer_chain("fused"), kn)}
            fns.update({lab: (layer_chain("kmajor", {w: c for w in ("o", "gu", "d")}), nk)
                        for lab, c in cfgs.items()})
            rec["rel_err_vs_fused"] = {
                lab: float(jnp.max(jnp.abs(fn(ws[:1], xa0, x0).astype(jnp.float32) -
                                           ref.astype(jnp.float32))) /
                           jnp.max(jnp.abs(ref.astype(jnp.float32))))
                for lab, (fn, ws) in fns.items() if lab != "fused"}
            rounds = {lab: [] for lab in fns}
            for _ in range(args.rounds):
                for lab, (fn, ws) in fns.items():
                    rounds[lab].append(timed(fn, ws))
            rec["layer_us_rounds"] = rounds
            rec["layer_us"] = {lab: float(np.median(v)) for lab, v in rounds.items()}
            results.append(rec)
            print(name, {lab: [round(t, 1) for t in v] for lab, v in rounds.items()}, flush=True)
            del layers, kn, nk
            meta = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                    "command": " ".join(["python scripts/diag/diag_kmajor.py"] +
                                        (argv or sys.argv[1:]))}
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=1)
            continue
        rec["layer_us"] = {"fused": timed(layer_chain("fused"), kn)}
        proj = {}
        for which in ("o", "gu", "d"):
            proj[which] = {"fused": timed(proj_chain(which, "fused"), kn)}
            for label, c in cfgs.items():
                proj[which][label] = timed(proj_chain(which, "kmajor", c), nk)
            print(name, which, {k: round(v, 2) for k, v in proj[which].items()}, flush=True)
        rec["proj_us"] = proj
        best = {w: min((v, k) for k, v in proj[w].items() if k != "fused")[1]
                for w in ("o", "gu", "d")}
        rec["best"] = best
        per_proj = {w: cfgs[best[w]] for w in best}
        got = layer_chain("kmajor", per_proj)(nk[:1], xa0, x0)
        rec["rel_err_vs_fused"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) -
                                                        ref.astype(jnp.float32))) /
                                        jnp.max(jnp.abs(ref.astype(jnp.float32))))
        rec["layer_us"]["kmajor_best"] = timed(layer_chain("kmajor", per_proj), nk)
        for label, c in cfgs.items():
            rec["layer_us"][label] = timed(layer_chain("kmajor", {w: c for w in best}), nk)
        results.append(rec)
        print(json.dumps(rec), flush=True)
        del layers, kn, nk
        meta = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                "command": " ".join(["python scripts/diag/diag_kmajor.py"] +
                                    (argv or sys.argv[1:]))}
        with open(args.out, "w") as f:  # after each model: a cut-short run keeps the first
            json.dump({"meta": meta, "results": results}, f, indent=1)
    print("model | layer us fused | layer us kmajor best | best tiles")
    for r in results:
        if "best" not in r:
            print(r["model"], {k: round(v, 1) for k, v in r["layer_us"].items()})
            continue
        print(r["model"], round(r["layer_us"]["fused"], 2), round(r["layer_us"]["kmajor_best"], 2),
              r["best"], "err", round(r["rel_err_vs_fused"], 4))


if __name__ == "__main__":
    main()
