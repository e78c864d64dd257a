"""Decode-step weight matmuls on one GPU: our weight-streaming kernel against XLA and cuBLAS,
written as JSON to --out.

For each model's projections (fused q/k/v and gate+up with their RMSNorm, o, down; the output
head for XLA and torch only) and row count R it times a chain of L matmuls, each with its own
weight (L = the model's layers, so the weights stream from HBM, not from L2), the next input
depending on the previous output:
- "xla": `kernels.skinny_matmul` with impl "xla" (jnp RMSNorm, `jnp.matmul` with float32
  accumulation): XLA's default gemm choice;
- "xla_cublas": the same with XLA's Triton gemm off (`xla_gpu_enable_triton_gemm=False`, a
  per-program compiler option): cuBLAS;
- "kernel": impl "kernel" with the default Config (and each --sweep Config);
- "torch": `torch.matmul` (cuBLAS) in a CUDA graph, when torch sees the GPU (no norm).
The kernel's product is checked against the float32 reference on every case. On the GPU each
variant also runs under the profiler: `busy_us` is the GPU's kernel time per chain link (the
matmul and the chain's small reduction, no launch gaps), `us` the wall time per link. Bytes: the weights
(the input rows are negligible); the fraction is of the copy bandwidth measured in the run.

  python scripts/bench/bench_skinny_matmul.py --out benchmarks/skinny_matmul.json
  python scripts/bench/bench_skinny_matmul.py --sweep --out /tmp/skinny_sweep.json
  python scripts/bench/bench_skinny_matmul.py --smoke --out /tmp/skinny.json   # CPU, interpret
  python scripts/bench/bench_skinny_matmul.py --report A.json [B.json ...] --out report.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402  (also puts this checkout's package on the path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sfi_jax.kernels import skinny_matmul_gpu as sm  # noqa: E402
from sfi_jax.kernels.skinny_matmul import skinny_matmul  # noqa: E402
from sfi_jax.models.config import PRESETS  # noqa: E402

# block_n:block_k:num_warps:num_stages:programs per SM, tried by --sweep
SWEEP = ["128:128:4:4:4", "64:128:4:4:4", "128:256:4:3:4", "256:64:4:4:4", "128:128:4:3:2",
         "128:128:8:4:4", "64:256:4:3:4", "128:64:4:6:4", "128:128:4:4:8", "32:256:4:3:4",
         "64:128:4:6:4", "256:128:8:3:4"]


MODE_CODES = {"d": "dot", "f": "fma", "fd": "fma_defer"}


def parse_config(text):
    """bn:bk:warps:stages:programs per SM[:mode], mode d (dot, the default), f (fma) or fd
    (fma_defer)."""
    parts = text.split(":")
    bn, bk, w, s, p = (int(v) for v in parts[:5])
    mode = MODE_CODES[parts[5]] if len(parts) > 5 else "dot"
    return sm.Config(bn, bk, w, s, p * sm._NUM_SMS, mode)


def projections(cfg):
    """(name, K, N, weights per call, normed) of one decode step's matmuls."""
    H, D = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_q_heads + 2 * cfg.num_kv_heads) * D
    out = [("qkv", H, qkv, 1, True), ("o", cfg.num_q_heads * D, H, 1, False)]
    if not cfg.is_moe:
        out += [("gate_up", H, cfg.intermediate_size, 2, True),
                ("down", cfg.intermediate_size, H, 1, False)]
    out.append(("head", H, cfg.vocab_size, 1, True))
    return out


def chain(matmul, dtype):
    """L matmuls back to back: x_{i+1} depends on every output column of step i."""
    def run(x, weights, norm):
        for w in weights:
            ys = matmul(x, w, norm)
            total = sum(jnp.sum(y, axis=-1, keepdims=True) for y in ys)
            x = (x.astype(jnp.float32) + 1e-30 * total).astype(dtype)
        return x
    return run


def matmul_fn(impl, config=None):
    def f(x, w, norm):
        return skinny_matmul(x, tuple(w), norm, impl=impl, config=config)
    return f


def time_jax(fn, x, weights, norm, iters, compiler_options=None, busy=False):
    """(wall us per chain, GPU busy us per chain from a profiler trace or None, the trace's
    kernels as (name, us per chain, launches per chain) or None)."""
    lowered = jax.jit(fn).lower(x, weights, norm)
    compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
    wall = _common.timeit(compiled, x, weights, norm, iters=iters, repeats=5)
    if not busy:
        return wall, None, None
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(iters):
                out = compiled(x, weights, norm)
            jax.block_until_ready(out)
        stats = _common.kernel_stats(d, iters)
    if not stats:
        return wall, None, None
    return wall, stats["busy_ms_per_step"] * 1e3, stats["top_us_per_step"]


def time_torch(K, N, nw, R, L, iters):
    import torch
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    ws = [[torch.randn((K, N), device=dev, generator=g,
                       dtype=torch.bfloat16) * 0.02 for _ in range(nw)] for _ in range(L)]
    x0 = torch.randn(R, K, device=dev, dtype=torch.bfloat16)

    def run(x):
        for w in ws:
            total = 0
            for wi in w:
                y = torch.matmul(x, wi).float()
                total = total + y.sum(-1, keepdim=True)
            x = (x.float() + 1e-30 * total).to(torch.bfloat16)
        return x

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run(x0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(x0)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / iters * 1e6)
    del ws, graph
    torch.cuda.empty_cache()
    return float(np.median(times))


def check(x, weights, norm, config):
    """Max relative error of the kernel's product against the float32 reference."""
    got = matmul_fn("kernel", config)(x, weights, norm)
    f32 = (lambda a: None if a is None else a.astype(jnp.float32))
    with jax.default_matmul_precision("highest"):
        want = skinny_matmul(f32(x), tuple(f32(w) for w in weights), f32(norm), impl="xla")
    return max(float(jnp.max(jnp.abs(g - r)) / (jnp.max(jnp.abs(r)) + 1e-30))
               for g, r in zip(got, want))


def report(paths, out):
    """A Markdown table per results file: GPU busy us per matmul (us of wall time where no
    profile), and the fraction of the copy bandwidth the best variant reached."""
    lines = ["# Decode-step weight matmuls: weight-streaming kernel vs XLA and cuBLAS", ""]
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        meta, rows = d["meta"], d["rows"]
        labels = list(dict.fromkeys(k for r in rows for k in r.get("busy_us", r["us"])))
        bw = meta.get("copy_bandwidth") or 0
        lines += [f"## {os.path.basename(path)}", "",
                  f"Machine: {meta['device']}, jax {meta['jax']}, copy bandwidth "
                  f"{bw / 1e12:.2f} TB/s, {meta['time']}. Command: `{meta.get('command', '')}`",
                  "", "GPU busy us per matmul (chain link: the matmul and the chain's small "
                  "reduction); torch: wall us in a CUDA graph; MB: weight bytes read; kernel:N:K:W:S:P = "
                  "block_n, block_k, warps, stages, programs per SM.", "",
                  "| model | proj | rows | MB | " + " | ".join(labels) + " | torch | best | "
                  "best of bandwidth |",
                  "|" + "---|" * (len(labels) + 7)]
        for r in rows:
            t = r.get("busy_us", r["us"])
            best = min((v, k) for k, v in t.items() if v)
            frac = r["weight_bytes"] / (best[0] / 1e6) / bw if bw else float("nan")
            torch_us = r["us"].get("torch")
            lines.append(f"| {r['model']} | {r['proj']} | {r['rows']} | "
                         f"{r['weight_bytes'] / 1e6:.1f} | "
                         + " | ".join(f"{t[k]:.1f}" if t.get(k) else "-" for k in labels)
                         + (f" | {torch_us:.1f} | " if torch_us else " | - | "))
            lines[-1] += f"{best[1]} | {frac:.2f} |"
        lines.append("")
    with open(out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {out}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report", nargs="+", metavar="JSON",
                    help="write --out as a Markdown report of these results (no device work)")
    ap.add_argument("--models", default="qwen3-4b,qwen3-0.6b")
    ap.add_argument("--rows", default="1,6,16,24")
    ap.add_argument("--sweep", action="store_true", help="also time every SWEEP config")
    ap.add_argument("--configs", default="", help="comma-separated bn:bk:warps:stages:progs/SM[:d|f|fd]")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpret)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.report:
        report(args.report, args.out)
        return

    interpret = jax.default_backend() != "gpu"
    bandwidth = None if interpret else _common.copy_bandwidth()
    configs = [("default", None)]
    extra = SWEEP if args.sweep else []
    extra += [c for c in args.configs.split(",") if c]
    configs += [(c, parse_config(c)) for c in extra]
    torch_ok = False
    if not (args.no_torch or interpret):
        try:
            import torch
            torch_ok = torch.cuda.is_available()
        except ImportError:
            pass
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                python=platform.python_version(), command="python " + " ".join(sys.argv),
                copy_bandwidth=bandwidth, time=time.strftime("%Y-%m-%d %H:%M:%S"))
    rows_out = []
    for model in args.models.split(","):
        cfg = PRESETS[model]
        L = cfg.num_layers
        shapes = projections(cfg)
        if args.smoke:
            shapes, L = [("tiny", 96, 80, 1, False), ("tiny_pair", 64, 48, 2, True)], 2
        for name, K, N, nw, normed in shapes:
            n_chain = min(L, 4) if name == "head" else L
            key = jax.random.PRNGKey(K + N)
            weights = [tuple(jax.random.normal(jax.random.fold_in(key, 10 * i + j), (K, N),
                                               jnp.bfloat16) * 0.02
                             for j in range(nw)) for i in range(n_chain)]
            norm = (1 + 0.1 * jax.random.normal(key, (K,), jnp.bfloat16)) if normed else None
            n_bytes = K * N * 2 * nw
            for R in (int(r) for r in args.rows.split(",")):
                x = jax.random.normal(jax.random.PRNGKey(R), (R, K), jnp.bfloat16)
                row = dict(model=model, proj=name, K=K, N=N, weights=nw, rows=R, normed=normed,
                           weight_bytes=n_bytes, us={})
                variants = [("xla", matmul_fn("xla"), None)]
                if not interpret:
                    variants.append(("xla_cublas", matmul_fn("xla"),
                                     {"xla_gpu_enable_triton_gemm": False}))
                if name != "head":  # the output head stays XLA's (models.modeling)
                    variants += [(f"kernel:{label}", matmul_fn("kernel", config), None)
                                 for label, config in configs]
                for label, fn, opts in variants:
                    try:
                        if label.startswith("kernel"):
                            cfg_ = dict(configs)[label.split(":", 1)[1]]
                            row.setdefault("err", {})[label] = check(x, weights[0], norm, cfg_)
                        t, busy, top = time_jax(chain(fn, jnp.bfloat16), x, weights, norm,
                                                args.iters, opts, busy=not interpret)
                        row["us"][label] = t / n_chain
                        if busy is not None:
                            row.setdefault("busy_us", {})[label] = busy / n_chain
                            row.setdefault("kernels", {})[label] = [
                                (name, us / n_chain, n / n_chain) for name, us, n in top]
                    except Exception as e:  # noqa: BLE001  (a config that does not lower)
                        row["us"][label] = None
                        row.setdefault("errors", {})[label] = f"{type(e).__name__}: {e}"[:300]
                        traceback.print_exc()
                if torch_ok:
                    try:
                        row["us"]["torch"] = time_torch(K, N, nw, R, n_chain,
                                                        args.iters) / n_chain
                    except Exception as e:  # noqa: BLE001
                        row["us"]["torch"] = None
                        row.setdefault("errors", {})["torch"] = f"{type(e).__name__}: {e}"[:300]
                if bandwidth:
                    row["frac"] = {k: (n_bytes / (v / 1e6) / bandwidth if v else None)
                                   for k, v in row["us"].items()}
                rows_out.append(row)
                with open(args.out, "w") as f:
                    json.dump(dict(meta=meta, rows=rows_out), f, indent=1)
                times = row.get("busy_us", row["us"])  # GPU busy time where profiled
                best = min((v, k) for k, v in times.items() if v)
                print(f"{model:11s} {name:8s} R={R:2d} " + " ".join(
                    f"{k}={v:.1f}" for k, v in times.items() if v and
                    (k in ("xla", "xla_cublas", "kernel:default") or v == best[0]))
                    + (f" torch(wall)={row['us']['torch']:.1f}" if row["us"].get("torch")
                       else "") + f"  best {best[1]}", flush=True)
            del weights
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
