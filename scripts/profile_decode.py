"""Where does a decode step's time go? Step time against the weights floor, kernel time from a
profiler trace (busy time, kernel count, top kernels), and copies of the big buffers in the
compiled HLO, for several engine variants (each in its own process, since XLA flags are read
once per process).

    python scripts/profile_decode.py --out /tmp/prof                 # all variants
    python scripts/profile_decode.py --one base --model qwen3-4b     # one variant, this process

Variants: environment settings (layer unroll, XLA flags) and `--layers list` (weights passed as
one dict per layer instead of stacked, so no layer slicing happens at all).
"""

from __future__ import annotations

import argparse
import collections
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
VARIANTS = {
    "base": ({"SFI_JAX_LAYER_UNROLL": "6"}, "stacked"),
    "unroll_all": ({"SFI_JAX_LAYER_UNROLL": "all"}, "stacked"),
    "list": ({}, "list"),
    "list_cmdbuf": ({"XLA_FLAGS": CMD_BUF}, "list"),
    "unroll_all_dsf": ({"SFI_JAX_LAYER_UNROLL": "all",
                        "XLA_FLAGS": "--xla_gpu_enable_dynamic_slice_fusion=true"}, "stacked"),
    "list_nocmdbuf": ({"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}, "list"),
}


def kernel_stats(trace_dir, n_steps, top=12):
    """Sum kernel events on the GPU plane's stream lines of a profiler trace: busy time, kernel
    count, and the `top` kernels by time as (name, us per step, launches per step)."""
    import jax
    paths = [os.path.join(r, f) for r, _, fs in os.walk(trace_dir) for f in fs
             if f.endswith(".xplane.pb")]
    if not paths:
        return None
    data = jax.profiler.ProfileData.from_file(paths[0])
    dur, cnt = collections.Counter(), collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                dur[ev.name[:70]] += ev.duration_ns
                cnt[ev.name[:70]] += 1
    if not dur:
        return None
    return {"busy_ms_per_step": sum(dur.values()) / n_steps / 1e6,
            "kernels_per_step": sum(cnt.values()) / n_steps,
            "top_us_per_step": [(n, round(t / n_steps / 1e3, 1), round(cnt[n] / n_steps, 2))
                                for n, t in dur.most_common(top)]}


def profile_summary(trace_dir, n_steps, top, hlo_text):
    """kernel_stats of a trace with each listed kernel's source lines (kernel_sources)."""
    prof = kernel_stats(trace_dir, n_steps, top)
    if prof:
        prof["sources"] = kernel_sources(hlo_text, [t[0] for t in prof["top_us_per_step"]])
    return prof


def _tables(hlo_text):
    """The stack-frame tables of compiled HLO text: {frame id: [(file, line, function), ...]}
    from the innermost frame outwards (newer XLA writes metadata as stack_frame_id)."""
    section, tabs = None, collections.defaultdict(dict)
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if not line.strip() or line.startswith("%") or line.startswith("ENTRY"):
            section = None
            continue
        if section:
            key, _, rest = line.partition(" ")
            tabs[section][int(key)] = rest.strip().strip('"')
    def fields(text):
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text)}
    frames = {}
    for start in tabs["StackFrames"]:
        chain, fid, seen = [], start, set()
        while fid in tabs["StackFrames"] and fid not in seen:  # a root is its own parent
            seen.add(fid)
            fr = fields(tabs["StackFrames"][fid])
            loc = fields(tabs["FileLocations"].get(fr.get("file_location_id"), ""))
            chain.append((tabs["FileNames"].get(loc.get("file_name_id"), "?"),
                          loc.get("line", 0),
                          tabs["FunctionNames"].get(loc.get("function_name_id"), "?")))
            fid = fr.get("parent_frame_id")
        frames[start] = chain
    return frames


def kernel_sources(hlo_text, names, prefer="sfi_jax", most=4):
    """For kernel names from a profile (HLO instruction names with '.' as '_'), where in the
    source their work comes from: the `most` commonest 'file:line function' of the ops inside
    (for a fusion, those of its fused computation), preferring frames under `prefer`, and the
    ops' kinds. {name: {"ops": [...], "sources": [...]}}; unknown names are left out."""
    frames = _tables(hlo_text)
    comps, current, insts = {}, None, {}
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) \(", line)
        if head:
            current = comps.setdefault(head.group(1), [])
            continue
        m = re.match(r"^\s*(?:ROOT )?%(\S+) = \S+ ([\w-]+)\(", line)
        if m and current is not None:
            inst = (m.group(2), re.findall(r"calls=%([\w.\-]+)", line), line)
            current.append(inst)
            insts[m.group(1).replace(".", "_").replace("-", "_")] = inst

    def where(line):
        sid = re.search(r"stack_frame_id=(\d+)", line)
        chain = frames.get(int(sid.group(1)), []) if sid else []
        if not chain:
            f = re.search(r'source_file="([^"]+)" source_line=(\d+)', line)
            chain = [(f.group(1), int(f.group(2)), "?")] if f else []
        ours = [c for c in chain if prefer in c[0]] or chain
        return f"{os.path.basename(ours[0][0])}:{ours[0][1]} {ours[0][2]}" if ours else None

    def walk(inst, ops, srcs, depth=0):
        op, calls, line = inst
        if op not in ("parameter", "constant", "fusion"):
            ops[op] += 1
            w = where(line)
            if w:
                srcs[w] += 1
        for c in calls:
            if depth < 4:
                for sub in comps.get(c, []):
                    walk(sub, ops, srcs, depth + 1)

    out = {}
    for name in names:
        inst = insts.get(name.replace(".", "_").replace("-", "_"))
        if inst is None:
            continue
        ops, srcs = collections.Counter(), collections.Counter()
        walk(inst, ops, srcs)
        out[name] = {"ops": [o for o, _ in ops.most_common(most)],
                     "sources": [w for w, _ in srcs.most_common(most)]}
    return out


def big_copies(hlo_text, shapes):
    """Copies in compiled HLO text of buffers whose shape string is a key of `shapes`
    ({"[L,B,H,S,D]": "cache", ...}), counted by name."""
    copies = collections.Counter()
    for line in hlo_text.splitlines():
        if re.search(r"= \S+ copy(-start)?\(", line):
            for shp, name in shapes.items():
                if shp in line:
                    copies[name] += 1
    return dict(copies)


def one(args):
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(__file__))
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import bench_e2e as be
    from sfi_jax.config import SFIConfig
    from sfi_jax.models.config import PRESETS
    from sfi_jax.models.modeling import split_layers
    from sfi_jax.models.params import random_params
    from sfi_jax.runtime import engine
    from sfi_jax.runtime.sampling import SamplingConfig

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
        st = be.make_state(cfg, B, S, ctx, sfi)
        eos = jnp.zeros((cfg.vocab_size,), bool)
        trig = eos.at[be.TRIGGER_ID].set(True)
        every = args.trigger_every if mode == "sfi" else 0
        forced = [jnp.asarray(be.forced_schedule(B, n, c * n, every, cfg.vocab_size))
                  for c in range(6)]
        t0 = time.perf_counter()
        fn = engine.decode_chunk.lower(params, st, eos, trig, forced[0], cfg=cfg, sfi=sfi,
                                       sampling=SamplingConfig(), n_steps=n).compile()
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


def main():
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
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--top", type=int, default=12, help="kernels listed per variant and mode")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.one:
        one(a)
        return
    rows = []
    for name in a.variants.split(","):
        env_add, layers = VARIANTS[name]
        env = dict(os.environ, **env_add)
        cmd = [sys.executable, __file__, "--one", name, "--layers", layers, "--model", a.model,
               "--batch", str(a.batch), "--ctx", str(a.ctx), "--steps", str(a.steps),
               "--modes", a.modes, "--trigger-every", str(a.trigger_every),
               "--bandwidth", str(a.bandwidth), "--top", str(a.top)]
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
            r["env"] = env_add
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
