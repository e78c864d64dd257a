"""Where does a decode step's time go? Step time against the weights floor, kernel time from a
profiler trace (busy time, kernel count, top kernels), and copies of the big buffers in the
compiled HLO, for several engine variants (each in its own process, since XLA flags are read
once per process).

    python scripts/diag/profile_decode.py --out /tmp/prof                 # all variants
    python scripts/diag/profile_decode.py --one base --model qwen3-4b     # one variant, this process

Variants: engine options (layer unroll), XLA flags and `--layers list` (weights passed as one
dict per layer instead of stacked, so no layer slicing happens at all).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

CMD_BUF = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
           "WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1")
# name: (environment, engine options, weight layout)
VARIANTS = {
    "base": ({}, ["layer_unroll=6"], "stacked"),
    "unroll_all": ({}, ["layer_unroll=all"], "stacked"),
    "list": ({}, [], "list"),
    "list_cmdbuf": ({"XLA_FLAGS": CMD_BUF}, [], "list"),
    "unroll_all_dsf": ({"XLA_FLAGS": "--xla_gpu_enable_dynamic_slice_fusion=true"},
                       ["layer_unroll=all"], "stacked"),
    "list_nocmdbuf": ({"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}, [], "list"),
}


def one(args):
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax
    import jax.numpy as jnp
    from _common import TRIGGER_ID, big_copies, forced_schedule, make_state, profile_summary

    from sfi_jax.config import SFIConfig
    from sfi_jax.models.config import PRESETS
    from sfi_jax.models.modeling import split_layers
    from sfi_jax.models.params import random_params
    from sfi_jax.runtime import decode
    from sfi_jax.options import EngineOptions
    from sfi_jax.runtime.sampling import SamplingConfig

    options = EngineOptions.from_strings(args.opt).resolved()
    cfg = PRESETS[args.model]
    params = random_params(cfg, "bfloat16", 0)
    if args.layers == "list":
        params["layers"] = split_layers(params["layers"], fuse_qkv=True)
    B, n = args.batch, args.steps
    results = []
    for mode in args.modes.split(","):
        sfi = None if mode == "dense" else SFIConfig(refresh_rows=max(2, B // 4))
        ctx = args.ctx
        S = ctx + 4 * n + 128
        st = make_state(cfg, B, S, ctx, sfi)
        eos = jnp.zeros((cfg.vocab_size,), bool)
        trig = eos.at[TRIGGER_ID].set(True)
        every = args.trigger_every if mode == "sfi" else 0
        forced = [jnp.asarray(forced_schedule(B, n, c * n, every, cfg.vocab_size))
                  for c in range(6)]
        t0 = time.perf_counter()
        fn = decode.decode_chunk.lower(params, st, eos, trig, forced[0], cfg=cfg, sfi=sfi,
                                       sampling=SamplingConfig(), n_steps=n,
                                       options=options).compile()
        compile_s = time.perf_counter() - t0
        txt = fn.as_text()
        shapes = {f"[{cfg.num_layers},{B},{cfg.num_kv_heads},{S},{cfg.head_dim}]": "cache"}
        if sfi is not None:
            shapes[f"[{cfg.num_layers},{B},{cfg.num_kv_heads},{sfi.compact_size},"
                   f"{cfg.head_dim}]"] = "compact"
        copies = big_copies(txt, shapes)
        ds_fusions = len(re.findall(r"dynamic-slice", txt))
        ts = []
        for c in range(1, 5):
            t = time.perf_counter()
            st, toks, *_ = fn(params, st, eos, trig, forced[c])
            jax.block_until_ready(toks)
            ts.append((time.perf_counter() - t) / n)
        prof = None
        if jax.default_backend() == "gpu":
            d = tempfile.mkdtemp()
            with jax.profiler.trace(d):
                st, toks, *_ = fn(params, st, eos, trig, forced[5])
                jax.block_until_ready(toks)
            prof = profile_summary(d, n, args.top, txt)
        floor = cfg.param_count() * 2 / args.bandwidth * 1e3
        r = {"variant": args.one, "mode": mode, "model": cfg.name, "batch": B, "ctx": ctx,
             "step_ms": statistics.median(ts) * 1e3, "weights_floor_ms": floor,
             "compile_s": compile_s, "big_copies": copies,
             "dynamic_slice_mentions": ds_fusions, "profile": prof}
        print("RESULT " + json.dumps(r), flush=True)
        results.append(r)
        del st
    return results


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--modes", default="dense,sfi")
    p.add_argument("--trigger-every", type=int, default=20)
    p.add_argument("--bandwidth", type=float, default=4.2e12)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--one", default=None, help="run one variant in this process")
    p.add_argument("--layers", default="stacked", choices=["stacked", "list"])
    p.add_argument("--opt", action="append", default=[], metavar="FIELD=VALUE",
                   help="an engine option (sfi_jax.EngineOptions field) for --one")
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--top", type=int, default=12, help="kernels listed per variant and mode")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.one:
        one(a)
        return
    rows = []
    for name in a.variants.split(","):
        env_add, opts, layers = VARIANTS[name]
        env = dict(os.environ, **env_add)
        cmd = [sys.executable, __file__, "--one", name, "--layers", layers, "--model", a.model,
               "--batch", str(a.batch), "--ctx", str(a.ctx), "--steps", str(a.steps),
               "--modes", a.modes, "--trigger-every", str(a.trigger_every),
               "--bandwidth", str(a.bandwidth), "--top", str(a.top),
               *[x for o in opts for x in ("--opt", o)]]
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
            text = out.stdout + out.stderr
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            text += "\nTIMEOUT"
        got = [json.loads(l[7:]) for l in text.splitlines() if l.startswith("RESULT ")]
        if not got:
            print(f"{name}: failed\n{text[-3000:]}", flush=True)
        for r in got:
            r["env"], r["options"] = env_add, opts
            rows.append(r)
            print(json.dumps(r), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "profile_decode.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print("\nvariant         mode   step ms  floor ms  busy ms  kernels  compile s  copies")
    for r in rows:
        pr = r["profile"] or {}
        print(f"{r['variant']:<15} {r['mode']:<6} {r['step_ms']:7.2f} {r['weights_floor_ms']:8.2f} "
              f"{pr.get('busy_ms_per_step', float('nan')):8.2f} "
              f"{pr.get('kernels_per_step', float('nan')):8.0f} {r['compile_s']:9.1f}  "
              f"{r['big_copies']}")


if __name__ == "__main__":
    main()
