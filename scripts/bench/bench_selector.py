"""Time the selector on the current JAX backend: top-k alone (lax.top_k against the radix
threshold paths, each checked to select lax.top_k's set) over rows x S scores, and the whole
selector (scores + top-k) for one layer.

    python scripts/bench/bench_selector.py            # 8/48 rows x {16K, 128K}, k=2048
    python scripts/bench/bench_selector.py --cases 224x32768,288x131072 --impls lax,radix/4,radix_kernel/2,radix_mosaic_gpu/2
    python scripts/bench/bench_selector.py --cases 224x32768 --no-select --impls lax --kth-configs 0:3,8192:4
    python scripts/bench/bench_selector.py --smoke    # tiny sizes, for a CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import timeit  # noqa: E402

from sfi_jax.config import SFIConfig  # noqa: E402
from sfi_jax.selector import select, selector_scores, topk_positions  # noqa: E402


def time_kth(scores, args, record):
    """The radix search alone: the Triton kernel and each Mosaic GPU config, each checked
    against the jnp search's keys."""
    from sfi_jax.kernels import selector_gpu, selector_mgpu, selector_reference
    from sfi_jax.kernels.common import interpret_for, sortable_keys

    rows, size = scores.shape
    want = np.asarray(selector_reference.kth_largest_key(sortable_keys(scores), args.k, 2))
    off_gpu = interpret_for("mosaic_gpu")  # (interpret mode off the GPU: a smoke run)
    arms = [("kth_triton/2", lambda s: selector_gpu.kth_largest_key(s, args.k, radix_bits=2,
                                                                    interpret=off_gpu))]
    for item in args.kth_configs.split(","):
        copy, stages = (int(v) for v in item.split(":"))
        cfg = selector_mgpu.Config(copy=copy or None, stages=stages)
        arms.append((f"kth_mgpu/{copy}:{stages}", lambda s, cfg=cfg: selector_mgpu.kth_largest_key(
            s, args.k, radix_bits=2, config=cfg, interpret=off_gpu)))
    for name, f in arms:
        fn = jax.jit(f)
        same = bool(np.array_equal(np.asarray(fn(scores)), want))
        record("kth", name, rows, size, timeit(fn, scores, iters=args.iters,
                                                repeats=args.repeats), same=same)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 48], help="B*Hkv rows for the top-k timing")
    ap.add_argument("--seq", type=int, nargs="+", default=[16384, 131072], help="positions S")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8], help="radix bits per round to try")
    ap.add_argument("--impls", default=None,
                    help="top-k impl/bits list, e.g. lax,radix/4,radix_kernel/2 (default: lax and "
                         "threshold at each --bits)")
    ap.add_argument("--cases", default=None,
                    help="ROWSxS list for the top-k timing, e.g. 224x32768 (default: --rows x --seq)")
    ap.add_argument("--no-select", action="store_true", help="time the top-k alone")
    ap.add_argument("--kth-configs", default=None,
                    help="also time the radix search alone (k-th largest key of every row, 2 "
                         "bits per round): the Triton kernel, then the Mosaic GPU kernel per "
                         "COPY:STAGES in this list (selector_mgpu.Config; 0 for COPY: one "
                         "register tile), e.g. 0:3,8192:4")
    ap.add_argument("--heads", type=int, default=8, help="KV heads for the whole-selector timing")
    ap.add_argument("--group", type=int, default=4, help="query rows R per KV head (decode: GQA group)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and few iterations")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.seq, args.k, args.heads = [4], [2048, 8192], 256, 4
        args.iters, args.repeats = 2, 2

    rng = np.random.default_rng(0)
    results = []

    def record(part, impl, rows, size, us, same=None):
        results.append(dict(part=part, impl=impl, rows=rows, S=size, k=args.k, us=round(us, 1),
                            us_per_row=round(us / rows, 2), same_as_lax=same,
                            backend=jax.default_backend()))
        print(f"{part:<9} {impl:<16} {rows:>5} {size:>8} {args.k:>6} {us:>11.1f} {us / rows:>10.2f}"
              f"  {'' if same is None else 'same' if same else 'DIFFERS'}", flush=True)

    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
    print(f"{'part':<9} {'impl':<16} {'rows':>5} {'S':>8} {'k':>6} {'median_us':>11} {'us/row':>10}")
    if args.impls:
        impls = []
        for item in args.impls.split(","):
            impl, _, bits = item.partition("/")
            impls.append((item, impl, int(bits or 4)))
    else:
        impls = [("lax", "lax", 4)] + [(f"threshold/{b}", "threshold", b) for b in args.bits]
    if args.cases:
        cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    else:
        cases = [(rows, size) for size in args.seq for rows in args.rows]
    for rows, size in cases:
        scores = jnp.asarray(rng.standard_normal((rows, size)).astype(np.float32))
        scores = scores.at[:, :300].set(-jnp.inf)  # sink + outside J, as in the runtime
        want = np.asarray(topk_positions(scores, args.k, impl="lax"))
        for name, impl, bits in impls:
            fn = jax.jit(lambda s, impl=impl, bits=bits: topk_positions(s, args.k, impl=impl, radix_bits=bits))
            got = np.asarray(fn(scores))
            record("topk", name, rows, size, timeit(fn, scores, iters=args.iters, repeats=args.repeats),
                   same=bool(np.array_equal(got, want)))
        if args.kth_configs:
            time_kth(scores, args, record)
    for size in [] if args.no_select else args.seq:
        # The whole selector for one refreshed sequence and one layer (B=1, all KV heads).
        sfi = SFIConfig(k_select=args.k)
        logits = jnp.asarray(rng.standard_normal((1, args.heads, args.group, size)).astype(np.float32) * 3)
        norms = jnp.asarray(rng.uniform(0.5, 3.0, (1, args.heads, size)).astype(np.float32))
        lo = jnp.array([sfi.n_sink], jnp.int32)
        hi = jnp.array([size - sfi.n_recent], jnp.int32)
        fn = jax.jit(lambda l, n, a, b: selector_scores(l, n, a, b, sfi))
        record("scores", "-", args.heads, size, timeit(fn, logits, norms, lo, hi, iters=args.iters, repeats=args.repeats))
        for name, impl, bits in impls[:1] + [i for i in impls if i[2] == 4 and i[1] == "threshold"]:
            fn = jax.jit(lambda l, n, a, b, impl=impl: select(l, n, a, b, sfi, topk_impl=impl))
            record("select", name, args.heads, size, timeit(fn, logits, norms, lo, hi, iters=args.iters, repeats=args.repeats))

    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(command="python scripts/bench/bench_selector.py " + " ".join(sys.argv[1:]),
                           device=jax.devices()[0].device_kind, jax=jax.__version__,
                           results=results), fh, indent=1)


if __name__ == "__main__":
    main()
