"""Where does a refreshed (slow) row's time go? A GPU diagnostic for one model and context.

    python scripts/diag/diag_slow_step.py --model qwen3-4b --ctx 131072 --batch 4 --out /tmp/diag

Runs the engine's decode loop with a fixed number of refreshed rows per step (none, one, two:
rows whose forced token is a trigger at every step, t_max out of reach), times it, and
records each variant's kernel breakdown from a profiler trace; times the selector's parts and
the dense kernel with and without logits for one row of all layers; counts copies of the big
buffers in the compiled decode loop. Writes diag_slow_step.json and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import (TRIGGER_ID, big_copies, forced_schedule, make_state,  # noqa: E402
                     profile_summary, timeit)

from sfi_jax.config import SFIConfig  # noqa: E402
from sfi_jax.kernels import dense_decode  # noqa: E402
from sfi_jax.kernels.common import sortable_keys  # noqa: E402
from sfi_jax.kernels.selector_reference import kth_largest_key  # noqa: E402
from sfi_jax.models.config import PRESETS  # noqa: E402
from sfi_jax.models.modeling import split_layers  # noqa: E402
from sfi_jax.models.params import random_params  # noqa: E402
from sfi_jax.options import EngineOptions  # noqa: E402
from sfi_jax.runtime import decode  # noqa: E402
from sfi_jax.runtime.sampling import SamplingConfig  # noqa: E402
from sfi_jax.runtime.state import DecodeState  # noqa: E402
selmod = importlib.import_module("sfi_jax.selector.select")


def ms(f, *args, reps=5, inner=5):
    """Median time of f(*args) in ms."""
    return timeit(f, *args, iters=inner, repeats=reps) / 1e3


def time_and_profile(fn, params, st, eos, trig, forced, n, top, hlo=None):
    """One warm-up chunk, the median of three timed chunks (ms per step), then one chunk under
    the profiler. Returns the state, ms per step, the last slow flags and the kernel stats
    (with each listed kernel's ops and source lines, from fn's compiled HLO text `hlo`, made
    here when not given)."""
    st, *_ = fn(params, st, eos, trig, forced)
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        st, toks, _, slow, *_ = fn(params, st, eos, trig, forced)
        jax.block_until_ready(toks)
        ts.append((time.perf_counter() - t) / n)
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        st, toks, *_ = fn(params, st, eos, trig, forced)
        jax.block_until_ready(toks)
    prof = profile_summary(d, n, top, hlo or fn.as_text())
    return st, statistics.median(ts) * 1e3, slow, prof


def selector_parts(cfg, ctx, sfi):
    """The selector for one refreshed row of every layer, by part (ms)."""
    L, Hkv, G = cfg.num_layers, cfg.num_kv_heads, cfg.num_q_heads // cfg.num_kv_heads
    key = jax.random.key(1)
    logits = jax.random.normal(key, (L, Hkv, G, ctx), jnp.float32) * 3
    norms = jax.random.uniform(key, (L, Hkv, ctx), jnp.float32) + 0.5
    lo = jnp.full((L,), sfi.n_sink, jnp.int32)
    hi = jnp.full((L,), ctx - sfi.n_recent, jnp.int32)
    scores = jax.jit(lambda lg, n: selmod.selector_scores(lg, n, lo, hi, sfi))
    z = scores(logits, norms)
    out = {"scores": ms(scores, logits, norms)}
    k = sfi.k_select
    ref = np.asarray(selmod._topk_lax(z, k, k))
    keys = sortable_keys(z)
    for bits in (1, 2, 4, 8):  # the radix search alone, and with its compaction
        f = jax.jit(lambda z, r=bits: selmod._topk_threshold(z, k, k, r))
        out[f"thr_r{bits}"] = ms(f, z)
        out[f"thr_r{bits}_same"] = bool((np.asarray(f(z)) == ref).all())
        out[f"kth_r{bits}"] = ms(jax.jit(lambda x, r=bits: kth_largest_key(x, k, r)),
                                 keys)
    f = jax.jit(lambda z: selmod._topk_prefiltered(z, k, k, 4, True))
    out["prefiltered"] = ms(f, z)
    out["prefiltered_same"] = bool((np.asarray(f(z)) == ref).all())
    out["lax_top_k"] = ms(jax.jit(lambda z: selmod._topk_lax(z, k, k)), z)
    m = z > 0
    out["count_prefix_blocked"] = ms(jax.jit(selmod._count_prefix), m)
    out["count_prefix_cumsum"] = ms(jax.jit(lambda m: jnp.cumsum(m, -1, dtype=jnp.int32)), m)
    full = jax.jit(lambda lg, n: selmod.select(lg, n, lo, hi, sfi, topk_impl="threshold"))
    out["select_threshold"] = ms(full, logits, norms)
    return out


def dense_row(cfg, ctx):
    """Dense kernel for one row over all layers, with and without logits (ms)."""
    shape = (1, cfg.num_kv_heads, ctx, cfg.head_dim)
    k = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
    q = jax.random.normal(jax.random.key(3), (1, cfg.num_q_heads, cfg.head_dim), jnp.bfloat16)
    lengths = jnp.full((1,), ctx, jnp.int32)
    out = {}
    for logits in (False, True):
        @jax.jit
        def f(q, k):
            def body(c, _):
                r = dense_decode(q + c, k, k, lengths, return_logits=logits)
                o = r[0] if logits else r
                extra = r[1][0, 0, 0] * 0 if logits else 0.0
                return c + o.astype(jnp.float32).mean() + extra, None
            return jax.lax.scan(body, jnp.float32(0), None, length=cfg.num_layers)[0]
        out["with_logits" if logits else "no_logits"] = ms(f, q, k, reps=3, inner=3)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--ctx", type=int, default=131072)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--topk", default="threshold,lax")
    p.add_argument("--top", type=int, default=25, help="kernels listed per variant")
    p.add_argument("--out", default="/tmp/diag")
    a = p.parse_args(argv)
    cfg = PRESETS[a.model]
    B, n, ctx = a.batch, a.steps, a.ctx
    res = {"model": a.model, "ctx": ctx, "batch": B, "steps": n,
           "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    base = SFIConfig(t_max=10**6, refresh_rows=2)
    res["selector_ms"] = selector_parts(cfg, ctx, base)
    print("selector", json.dumps(res["selector_ms"]), flush=True)
    res["dense_row_ms"] = dense_row(cfg, ctx)
    print("dense row", res["dense_row_ms"], flush=True)

    params = random_params(cfg, "bfloat16", 0)
    params["layers"] = split_layers(params["layers"], fuse_qkv=True)
    S = ctx + 12 * n + 128
    st = make_state(cfg, B, S, ctx, base)
    eos = jnp.zeros((cfg.vocab_size,), bool)
    trig = eos.at[TRIGGER_ID].set(True)
    plain = forced_schedule(B, n, 0, 0, cfg.vocab_size)
    schedules = {"fast": plain}
    for r in (1, 2):
        f = plain.copy()
        f[:r] = TRIGGER_ID
        schedules[f"{r}_slow"] = f
    runs = []
    G = cfg.num_q_heads // cfg.num_kv_heads
    shapes = {f"[{cfg.num_layers},{B},{cfg.num_kv_heads},{S},{cfg.head_dim}]": "cache",
              f"[{cfg.num_layers},{B},{cfg.num_kv_heads},{base.compact_size},{cfg.head_dim}]":
              "compact",
              f"[{cfg.num_layers},2,{cfg.num_kv_heads},{G},{S}]": "slow_logits",
              f"[{cfg.num_layers},{B},{cfg.num_kv_heads},{S}]": "key_norms"}
    for topk in a.topk.split(","):
        sfi = SFIConfig(t_max=10**6, refresh_rows=2)
        kw = dict(cfg=cfg, sfi=sfi, sampling=SamplingConfig(), n_steps=n,
                  options=EngineOptions(selector_topk=topk).resolved())
        t0 = time.perf_counter()
        fn = decode.decode_chunk.lower(params, st, eos, trig, jnp.asarray(plain), **kw).compile()
        compile_s = time.perf_counter() - t0
        hlo = fn.as_text()  # once per program: the copy check and every schedule's sources
        copies = big_copies(hlo, shapes)
        for name, sched in schedules.items():
            forced = jnp.asarray(sched)
            st = st._replace(sfi=st.sfi._replace(pending=jnp.zeros((B,), bool)))
            st, step_ms, slow, prof = time_and_profile(fn, params, st, eos, trig, forced, n,
                                                       a.top, hlo)
            r = {"arm": f"sfi_{topk}", "schedule": name, "step_ms": step_ms,
                 "slow_rows_per_step": float(np.asarray(slow).sum(0).mean()),
                 "compile_s": compile_s, "copies": copies, "profile": prof}
            runs.append(r)
            print(json.dumps(r), flush=True)
    # dense arm on the same cache
    dst = DecodeState(k=st.k, v=st.v, lengths=st.lengths, token=st.token, done=st.done,
                      step=st.step, key=st.key, sfi=None)
    del st
    kw = dict(cfg=cfg, sfi=None, sampling=SamplingConfig(), n_steps=n,
              options=EngineOptions().resolved())
    fn = decode.decode_chunk.lower(params, dst, eos, trig, jnp.asarray(plain), **kw).compile()
    _, step_ms, _, prof = time_and_profile(fn, params, dst, eos, trig, jnp.asarray(plain), n,
                                           a.top)
    runs.append({"arm": "dense", "schedule": "-", "step_ms": step_ms, "profile": prof})
    res["runs"] = runs
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "diag_slow_step.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\narm            schedule  step ms  slow rows/step  busy ms  kernels/step  copies")
    for r in runs:
        pr = r["profile"] or {}
        print(f"{r['arm']:<14} {r['schedule']:<8} {r['step_ms']:8.2f} "
              f"{r.get('slow_rows_per_step', 0):8.2f} {pr.get('busy_ms_per_step', 0):10.2f} "
              f"{pr.get('kernels_per_step', 0):10.0f}  {r.get('copies')}")
    print("selector ms:", json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                      for k, v in res["selector_ms"].items()}))
    print("dense row ms:", res["dense_row_ms"])


if __name__ == "__main__":
    main()
