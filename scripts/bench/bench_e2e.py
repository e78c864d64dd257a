"""End-to-end decode throughput: SFI against the dense arm of the same engine, with a bytes model.

    python scripts/bench/bench_e2e.py --out benchmarks        # on the GPU (random bf16 weights)
    python scripts/bench/bench_e2e.py --smoke --out /tmp/e2e  # tiny config on CPU

Both arms run the same jitted decode loop (`sfi_jax.runtime.decode.decode_chunk`) on random
bf16 weights created on the device. The KV cache is filled with random values instead of a
prefill (`--fill random`, the default, so 128K contexts fit the time budget). Random weights
never emit punctuation, so the trigger is driven at a stated rate through teacher-forced
tokens: row b's token is a trigger every `--trigger-every` steps (staggered by row), plus
t_max. The dense arm uses our Pallas dense kernel (within a few % of cuDNN, see
benchmarks/kernels.md) reading the cache in place.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time

# the KV cache is most of the device: let JAX take more of it than its 75% default (an
# environment that sets its own fraction keeps it; the report records the device's limit)
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402  (also puts this checkout's package on the path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import (TRIGGER_ID, chunk_plan, copy_bandwidth, device_bytes,  # noqa: E402
                     forced_schedule, make_state, timeit)

import sfi_jax  # noqa: E402
from sfi_jax.config import SFIConfig  # noqa: E402
from sfi_jax.models.config import PRESETS, ModelConfig  # noqa: E402
from sfi_jax.models.modeling import split_layers  # noqa: E402
from sfi_jax.runtime import decode, exact, programs  # noqa: E402
from sfi_jax.runtime.sampling import SamplingConfig  # noqa: E402
from sfi_jax.selector import select  # noqa: E402
from sfi_jax.options import EngineOptions, KernelTuning  # noqa: E402


def pick_batch(cfg: ModelConfig, ctx: int, want: int, S: int, sfi: SFIConfig, limit: int):
    """The largest batch up to `want` whose cache, SFI state and slow-step scratch fit."""
    weights = cfg.param_count() * 2
    for b in range(want, 0, -1):
        kv = cfg.kv_cache_bytes(b, S, 2)
        state = 2 * cfg.num_layers * b * cfg.num_kv_heads * sfi.compact_size * cfg.head_dim * 2
        norms = cfg.num_layers * b * cfg.num_kv_heads * S * 4
        # slow-step scratch: f32 logits for the refreshed rows of one layer, several copies
        scratch = 6 * b * cfg.num_q_heads * S * 4
        # the refreshed rows' logits of every layer (one step's worth)
        slots = min(b, max(2, b // 4))
        slow_logits = cfg.num_layers * slots * cfg.num_q_heads * S * 4
        # the selector's temporaries for one refreshed row of every layer
        selector = cfg.num_layers * S * 4 * (cfg.num_q_heads + 8 * cfg.num_kv_heads)
        if weights + kv + state + norms + scratch + slow_logits + selector < 0.95 * limit:
            return b
    raise SystemExit(f"{cfg.name} at {ctx} does not fit even at batch 1")


def run_chunks(params, state, cfg, sfi, options, n_steps, chunks, forced_fn, trig,
               profile=None):
    """Time `chunks` decode chunks of n_steps after one warm-up chunk. Returns (state, times,
    slow shares, the compiled chunk). profile: a dict that receives the kernel breakdown of one
    more chunk (GPU), with each kernel's source lines."""
    eos = jnp.zeros((cfg.vocab_size,), bool)
    kw = dict(cfg=cfg, sfi=sfi, sampling=SamplingConfig(), n_steps=n_steps, options=options)
    fn = decode.decode_chunk.lower(params, state, eos, trig, jnp.asarray(forced_fn(0)),
                                   **kw).compile()
    times, slow = [], []
    for c in range(chunks + 1):
        forced = jnp.asarray(forced_fn(c))
        jax.block_until_ready(forced)
        t = time.perf_counter()
        state, toks, taken, slow_flags, _, _ = fn(params, state, eos, trig, forced)
        jax.block_until_ready(toks)
        if c:
            times.append(time.perf_counter() - t)
            slow.append(float(np.asarray(slow_flags).mean()))
    if profile is not None and jax.default_backend() == "gpu":
        import tempfile

        d = tempfile.mkdtemp()
        with jax.profiler.trace(d):
            state, toks, *_ = fn(params, state, eos, trig, jnp.asarray(forced_fn(chunks + 1)))
            jax.block_until_ready(toks)
        # (60 kernels, each with the source lines of its ops: which XLA fusions sit around
        # a kernel, e.g. the Mosaic attention's, mosaic_ab.json `mosaic_attention_h100_1207g`)
        profile.update(_common.profile_summary(d, n_steps, 60, fn.as_text()) or {})
    return state, times, slow, fn


def selector_time(cfg, B, ctx, sfi, options, reps=5):
    """The selector (scores + top-k) for B rows x all layers at once (B = 1: what the engine
    runs per refreshed row)."""
    B = B * cfg.num_layers
    G = cfg.num_q_heads // cfg.num_kv_heads
    key = jax.random.key(1)
    logits = jax.random.normal(key, (B, cfg.num_kv_heads, G, ctx), jnp.float32)
    norms = jax.random.uniform(key, (B, cfg.num_kv_heads, ctx), jnp.float32) + 0.5
    lo = jnp.full((B,), sfi.n_sink, jnp.int32)
    hi = jnp.full((B,), ctx - sfi.n_recent, jnp.int32)
    f = jax.jit(lambda lg, n: select(lg, n, lo, hi, sfi, topk_impl=options.selector_topk,
                                     scores_impl=options.selector_scores))
    return timeit(f, logits, norms, iters=5, repeats=reps) / 1e6


def repack_time(cfg, B, S, sfi, slots, reps=5):
    """The repack alone: one gather of sink + selected K/V from the cache and one scatter into
    the compact buffers, for every layer and `slots` refreshed rows (as the engine does)."""
    L, Hkv, D, C = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, sfi.compact_size
    shape = (L, B, Hkv, S, D)
    k = jax.random.normal(jax.random.key(4), shape, jnp.bfloat16)
    ck = jnp.zeros((L, B, Hkv, C, D), jnp.bfloat16)
    pos = jnp.sort(jax.random.randint(jax.random.key(5), (L, slots, Hkv, C), 0, S), axis=-1)
    rows = jnp.arange(slots, dtype=jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def f(ck, k, pos):
        idx = (jnp.arange(L)[:, None, None, None], rows[None, :, None, None],
               jnp.arange(Hkv)[None, None, :, None], pos)
        return ck.at[:, rows].set(k[idx], mode="drop", unique_indices=True,
                                  indices_are_sorted=True)

    ck = f(ck, k, pos)
    jax.block_until_ready(ck)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(5):
            ck = f(ck, k, pos)
        jax.block_until_ready(ck)
        ts.append((time.perf_counter() - t) / 5)
    del k
    return 2 * statistics.median(ts)  # K and V


def bytes_model(cfg, B, ctx, sfi, slow_share, bw):
    """Predicted step times from bytes moved over the measured copy bandwidth."""
    L, Hkv, D, Hq = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_q_heads
    if cfg.is_moe:
        touched = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** B)
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
        attn_w = cfg.hidden_size * D * (2 * Hq + 2 * Hkv) * 2
        weights = L * (attn_w + touched * per_expert) + cfg.vocab_size * cfg.hidden_size * 2
    else:
        weights = cfg.param_count() * 2 - (cfg.vocab_size * cfg.hidden_size * 2
                                          if not cfg.tie_word_embeddings else 0)
    dense_kv = 2 * L * B * Hkv * ctx * D * 2
    fast_kv = 2 * L * B * Hkv * (sfi.compact_size + sfi.n_recent + 1) * D * 2
    # slow step: dense read + f32 logits written and read twice by the selector + compact repack
    slow_extra = L * B * (Hq * ctx * 4 * 3 + Hkv * ctx * 4 + 2 * Hkv * sfi.compact_size * D * 2 * 2)
    t_dense = (weights + dense_kv) / bw
    t_fast = (weights + fast_kv) / bw
    t_slow = (weights + fast_kv + dense_kv + slow_extra) / bw
    t_sfi = (1 - slow_share) * t_fast + slow_share * t_slow
    return dict(weights_bytes=weights, dense_kv_bytes=dense_kv, fast_kv_bytes=fast_kv,
                pred_dense_step_s=t_dense, pred_fast_step_s=t_fast, pred_slow_step_s=t_slow,
                pred_sfi_step_s=t_sfi)


def _steps(ctx, args):
    """Steps per chunk, timed chunks, and the cache length they need."""
    return chunk_plan(ctx, args.chunk_steps, args.new_tokens)


def engine_options(args) -> EngineOptions:
    """The engine options of this run (`--opt` over the defaults, the kernels' sweep points
    from their flags), resolved for the platform: the record names what each "auto" stood
    for."""
    options = EngineOptions.from_strings(args.opt).resolved()
    return dataclasses.replace(options, tuning=kernel_tuning(args))


def kernel_tuning(args) -> KernelTuning:
    """The GPU kernels' sweep points of this run (`--sparse-config`, `--dense-config`,
    `--fused-programs`, `--kmajor-config`, `--no-launch-dependents`, `--zero-fill`,
    `--kernel-stores`; absent: the tuned kernels)."""
    return KernelTuning(
        dense_attention=attention_config(args.dense_config) if args.dense_config else None,
        sparse_attention=attention_config(args.sparse_config) if args.sparse_config else None,
        fused_programs_per_sm=args.fused_programs or None,
        kmajor=_common.kmajor_config(args.kmajor_config) if args.kmajor_config else None,
        launch_dependents=False if args.no_launch_dependents else None,
        zero_fill=args.zero_fill, kernel_stores=args.kernel_stores)


def sfi_fields(pairs):
    """`--sfi FIELD=VALUE` pairs as SFIConfig keyword arguments (ints where they parse, None
    for "none")."""
    out = {}
    for pair in pairs:
        field, sep, value = pair.partition("=")
        if not sep or field not in SFIConfig.__dataclass_fields__:
            raise SystemExit(f"--sfi {pair!r}: expected FIELD=VALUE with an SFIConfig field")
        if value.lower() == "none":  # e.g. selection_memory=none (off)
            out[field] = None
            continue
        try:
            out[field] = int(value)
        except ValueError:
            out[field] = float(value)
    return out


def bench_one(name, cfg, params, ctx, args, bw, B):
    n, chunks, S = _steps(ctx, args)
    # static refresh slots per step: rows beyond them wait one step with their old selection
    slots = args.refresh_rows or min(B, max(2, B // 4))
    # the record says what "auto" stands for
    sfi = SFIConfig(**{"t_max": args.t_max, "refresh_rows": slots, **sfi_fields(args.sfi)})
    options = engine_options(args)
    trig = np.zeros((cfg.vocab_size,), bool)
    trig[TRIGGER_ID] = True
    trig = jnp.asarray(trig)
    no_trig = jnp.zeros_like(trig)
    rec = dict(model=name, context=ctx, batch=B, new_tokens=chunks * n, fill=args.fill,
               trigger_every=args.trigger_every, t_max=args.t_max, k_select=sfi.k_select,
               n_recent=sfi.n_recent, n_sink=sfi.n_sink, refresh_rows=slots,
               sfi_fields=sfi_fields(args.sfi), options=dataclasses.asdict(options))

    # dense arm
    state = make_state(cfg, B, S, ctx, None)
    dense_prof = {} if args.profile else None
    state, times, _, _ = run_chunks(params, state, cfg, None, options, n, chunks,
                                    lambda c: forced_schedule(B, n, c * n, 0, cfg.vocab_size),
                                    no_trig, dense_prof)
    del state
    dense_step = statistics.median(times) / n
    rec.update(dense_step_s=dense_step, dense_tokens_per_s=B / dense_step)

    # SFI arm: the stated trigger schedule
    state = make_state(cfg, B, S, ctx, sfi)
    sfi_prof = {} if args.profile else None
    state, times, slow, fn = run_chunks(
        params, state, cfg, sfi, options, n, chunks,
        lambda c: forced_schedule(B, n, c * n, args.trigger_every, cfg.vocab_size), trig,
        sfi_prof)
    if args.profile:
        rec.update(dense_profile=dense_prof, sfi_profile=sfi_prof)
    sfi_step = statistics.median(times) / n
    slow_share = float(np.mean(slow))
    # the same executable (not compiled again) with every row slow at every step, then none
    eos = jnp.zeros((cfg.vocab_size,), bool)
    all_trig = jnp.full((B, n), TRIGGER_ID, jnp.int32)
    state = state._replace(sfi=state.sfi._replace(pending=jnp.ones((B,), bool)))
    t = time.perf_counter()
    state, toks, *_ = fn(params, state, eos, trig, all_trig)
    jax.block_until_ready(toks)
    slow_step = (time.perf_counter() - t) / n
    plain = jnp.asarray(forced_schedule(B, n, 0, 0, cfg.vocab_size))
    state = state._replace(sfi=state.sfi._replace(
        pending=jnp.zeros((B,), bool), since_slow=jnp.zeros((B,), jnp.int32)))
    state, toks, *_ = fn(params, state, eos, no_trig, plain)  # warm the fast path's caches
    state = state._replace(sfi=state.sfi._replace(
        pending=jnp.zeros((B,), bool), since_slow=jnp.zeros((B,), jnp.int32)))
    t = time.perf_counter()
    state, toks, *_ = fn(params, state, eos, no_trig, plain)
    jax.block_until_ready(toks)
    fast_step = (time.perf_counter() - t) / n
    del state
    sel = selector_time(cfg, 1, ctx, sfi, options)  # the engine selects per occupied slot
    repack = repack_time(cfg, 1, ctx, sfi, 1)  # one refreshed row, all layers
    attn_dense = attention_time(cfg, B, ctx)
    rec.update(sfi_step_s=sfi_step, sfi_tokens_per_s=B / sfi_step, slow_share=slow_share,
               fast_step_s=fast_step, slow_step_s=slow_step, selector_row_s=sel, repack_row_s=repack,
               dense_attention_step_s=attn_dense,
               dense_attention_share=attn_dense / dense_step, speedup=dense_step / sfi_step)
    rec.update(bytes_model(cfg, B, ctx, sfi, slow_share, bw))
    rec["dense_of_floor"] = rec["pred_dense_step_s"] / dense_step
    rec["sfi_of_floor"] = rec["pred_sfi_step_s"] / sfi_step
    if args.mode == "exact":
        rec["exact"] = exact_points(params, cfg, B, S, ctx, sfi, options, args, n, chunks, bw)
        for p in rec["exact"]:
            p["exact_speedup"] = p["exact_tokens_per_s"] / rec["dense_tokens_per_s"]
            p["pred_exact_speedup"] = p["pred_exact_tokens_per_s"] * rec["pred_dense_step_s"] / B
    return rec


def expected_tokens_per_round(a, d):
    """Tokens a round emits when each draft token is accepted with probability a (independent):
    1 + a + ... + a^d (the accepted prefix and the verify's own token)."""
    return float(sum(a ** i for i in range(d + 1)))


def exact_points(params, cfg, B, S, ctx, sfi, options, args, n, chunks, bw):
    """exact_arm at every (--draft-len, --accept-rate) pair: one program per draft length (the
    rate is data)."""
    return [exact_arm(params, cfg, B, S, ctx, sfi, options, d, a, n, chunks, bw)
            for d in args.draft_lens for a in args.accept_rates]


def exact_arm(params, cfg, B, S, ctx, sfi, options, d, accept_rate, n, chunks, bw):
    """Exact mode's rounds (up to d fast steps + one dense verify of d + 1 queries; rows
    whose acceptance does not pay draft less or run plain dense steps) with acceptance drawn
    at accept_rate per draft token (random weights accept nothing useful); tokens/s counts
    the tokens the rounds emit. Beside it the bytes model: a round reads the weights and the
    sparse KV d times, then the weights and the whole KV once (plus the refreshed rows'
    logits). The program comes from the runtime's program cache: compiled once per draft
    length."""
    esfi = dataclasses.replace(sfi, draft_len=d)
    rounds = max(1, n // (d + 1))
    trig = np.zeros((cfg.vocab_size,), bool)
    trig[TRIGGER_ID] = True
    trig, eos = jnp.asarray(trig), jnp.zeros((cfg.vocab_size,), bool)
    state = make_state(cfg, B, S, ctx, esfi)
    counts = exact.initial_counts(B, np.full((B,), S - ctx - 2 * (d + 1), np.int32))
    rate = jnp.float32(accept_rate)
    kw = dict(cfg=cfg, sfi=esfi, sampling=SamplingConfig(), n_rounds=rounds, options=options)
    fn, _ = programs.compiled(exact.exact_chunk, (params, state, counts, eos, trig, rate), kw)
    times, emitted, taken_rounds = [], [], []
    for c in range(chunks + 1):
        t = time.perf_counter()
        state, counts, toks, n_out, taken = fn(params, state, counts, eos, trig, rate)
        jax.block_until_ready(toks)
        if c:
            times.append(time.perf_counter() - t)
            emitted.append(int(np.asarray(n_out).sum()))
            taken_rounds.append(int(taken))
    slow = float(np.asarray(state.sfi.slow_steps).sum() / max(1, np.asarray(
        counts.verify_steps).sum()))
    drafted, verifies = int(np.asarray(counts.drafted).sum()), int(np.asarray(
        counts.verify_steps).sum())
    del state
    tok_s = sum(emitted) / sum(times)
    m = bytes_model(cfg, B, ctx, esfi, 0.0, bw)
    slow_extra = m["pred_slow_step_s"] - m["pred_fast_step_s"] - m["dense_kv_bytes"] / bw
    t_verify = (m["weights_bytes"] + m["dense_kv_bytes"]) / bw + slow * slow_extra
    # the draft length that pays best at this rate (what the adaptive rows aim for): 0 is a
    # plain dense step
    best = max(range(d + 1), key=lambda j: expected_tokens_per_round(accept_rate, j) / (
        j * m["pred_fast_step_s"] + (t_verify if j else m["pred_dense_step_s"])))
    t_round = best * m["pred_fast_step_s"] + (t_verify if best else m["pred_dense_step_s"])
    e_tok = expected_tokens_per_round(accept_rate, best)
    return dict(exact_draft_len=d, exact_accept_rate=accept_rate,
                exact_tokens_per_s=tok_s, exact_round_s=statistics.median(times) / rounds,
                exact_tokens_per_round=sum(emitted) / (B * sum(taken_rounds)),
                exact_drafted_per_verify=drafted / max(1, verifies),
                exact_refresh_share=slow, pred_exact_round_s=t_round, pred_exact_draft_len=best,
                pred_exact_tokens_per_s=B * e_tok / t_round)


class OutOfMemory(Exception):
    """Every batch tried for a (model, context) ran out of device memory."""

    def __init__(self, name, ctx, batches):
        super().__init__(f"{name} at {ctx}: out of memory at batches {batches}")
        self.entry = dict(model=name, context=ctx, batches=batches)


def bench_fitting(name, cfg, params, ctx, args, bw, limit, tries=4):
    """bench_one at the largest batch that fits; when the decode loop still runs out of memory
    (each of K and V needs one contiguous buffer, and the free memory beside the weights may be
    split), one row fewer, and the record says which batches failed. OutOfMemory after
    `tries`."""
    S = _steps(ctx, args)[2]
    B = pick_batch(cfg, ctx, args.batch, S, SFIConfig(t_max=args.t_max), limit)
    failed = []
    for _ in range(tries):
        try:
            rec = bench_one(name, cfg, params, ctx, args, bw, B)
            if failed:
                rec["batches_out_of_memory"] = failed
            return rec
        except Exception as e:  # noqa: BLE001 - only out-of-memory is retried
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            failed.append(B)
            if B <= 1:
                break
            nxt = B - 1
            print(f"{name} {ctx}: batch {B} ran out of memory; trying {nxt}", flush=True)
        B = nxt
        # the failed try's traceback held its device arrays in frames that form cycles: free
        # them now (outside the except clause, which keeps the exception alive), not whenever
        # the cyclic collector runs
        gc.collect()
        jax.clear_caches()
    raise OutOfMemory(name, ctx, failed)


def attention_time(cfg, B, ctx, reps=5):
    """Dense decode attention alone for all layers (our kernel, in place)."""
    from sfi_jax.kernels import dense_decode

    shape = (B, cfg.num_kv_heads, ctx, cfg.head_dim)
    k = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
    q = jax.random.normal(jax.random.key(3), (B, cfg.num_q_heads, cfg.head_dim), jnp.bfloat16)
    lengths = jnp.full((B,), ctx, jnp.int32)

    @jax.jit
    def f(q, k):  # k is an argument: a closed-over cache would be baked in as a constant
        def body(c, _):
            return c + dense_decode(q + c, k, k, lengths).astype(jnp.float32).mean(), None
        return jax.lax.scan(body, jnp.float32(0), None, length=cfg.num_layers)[0]

    return timeit(f, q, k, iters=1, repeats=reps) / 1e6


def engine_check(k_major=False, options=None):
    """On this device: SFI with a budget covering the context equals dense token for token, and
    with a small budget the platform kernels give the same tokens as the xla path. Float32
    matmuls run at full precision: on GPU jnp's default takes TF32 passes, which moved a
    near-tied token of the xla arm on the H200 (diag_engine_check.py in docs/findings.md).
    k_major: the model's weight layout (`Model.split_layers`); options: the run's engine
    options (`--opt`), for every arm but the xla one."""
    with jax.default_matmul_precision("highest"):
        return _engine_check(k_major, options or EngineOptions())


def _engine_check(k_major, options):
    model, prompts = _common.engine_check_model(k_major)
    out = {}
    dense = sfi_jax.generate(model, prompts, max_new_tokens=24, mode="dense", stop_at_eos=False,
                             options=options)
    full = sfi_jax.generate(model, prompts, max_new_tokens=24, stop_at_eos=False,
                            sfi=SFIConfig(k_select=2048), options=options)
    out["full_budget_equals_dense"] = full.tokens == dense.tokens
    small = SFIConfig(n_sink=4, k_select=64, n_recent=32, t_max=8)
    # the xla arm: every operation in jnp; the other the platform's kernels
    xla = EngineOptions(attention="xla", selector_scores="xla", selector_topk="lax")
    a = sfi_jax.generate(model, prompts, max_new_tokens=24, stop_at_eos=False, sfi=small,
                         options=xla, trigger_ids=[5, 6, 7])
    b = sfi_jax.generate(model, prompts, max_new_tokens=24, stop_at_eos=False, sfi=small,
                         trigger_ids=[5, 6, 7], options=options)
    out["small_budget_kernels_equal_xla"] = a.tokens == b.tokens
    out["small_budget_differs_from_dense"] = a.tokens != dense.tokens
    out["slow_steps"] = b.stats["slow_steps"]
    if jax.default_backend() == "gpu":  # both expert-kernel layouts (EngineOptions.moe)
        for impl in ("kernel", "tokens"):
            err = moe_kernel_check(impl=impl)
            out[f"moe_{impl}_rel_err"] = err
            out[f"moe_{impl}_matches_ragged_dot"] = err < 2e-2
    return out


def moe_kernel_check(cfg=None, n_tokens=16, seed=0, impl="kernel"):
    """Relative error of the expert kernels' MoE block (`impl` as in moe_mlp) against the
    lax.ragged_dot path (models.modeling.moe_mlp both ways) at one decode step's tokens, bf16,
    fresh random weights; Qwen3-30B-A3B's expert shapes unless `cfg` says otherwise."""
    from sfi_jax.models.modeling import moe_mlp

    cfg = cfg or PRESETS["qwen3-30b-a3b"]
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    ks = jax.random.split(jax.random.key(seed), 5)
    w = {"router": jax.random.normal(ks[0], (h, e), jnp.bfloat16),
         "we_gate": jax.random.normal(ks[1], (e, h, inter), jnp.bfloat16) * h ** -0.5,
         "we_up": jax.random.normal(ks[2], (e, h, inter), jnp.bfloat16) * h ** -0.5,
         "we_down": jax.random.normal(ks[3], (e, inter, h), jnp.bfloat16) * inter ** -0.5}
    x = jax.random.normal(ks[4], (n_tokens, h), jnp.bfloat16)
    want, got = (jax.jit(lambda w, x, impl=i: moe_mlp(w, cfg, x, impl=impl))(w, x)
                 .astype(jnp.float32) for i in ("xla", impl))
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def _ms(seconds):
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"


def _num(x):
    return "n/a" if x is None else f"{x:.2f}"


def targets(records):
    """Issue 6's targets, each met or missed by how much (rows of the report's table)."""
    rows = []
    dense = [r for r in records if r["context"] >= 32768]
    if dense:
        low = [r for r in dense if r["dense_of_floor"] < 0.85]
        rng = f"{min(r['dense_of_floor'] for r in dense):.2f}-{max(r['dense_of_floor'] for r in dense):.2f}"
        miss = ", ".join(f"{r['model']} {r['context'] // 1024}K {r['dense_of_floor']:.2f}"
                         for r in low)
        rows.append(("dense arm >= 0.85 of its bytes floor from 32K",
                     f"met ({rng})" if not low else f"missed by {miss} ({rng} overall)"))
    if records:
        sfi = [r["sfi_of_floor"] for r in records]
        low = [v for v in sfi if v < 0.75]
        met = [f"{r['model']} {r['context'] // 1024}K" for r in records if r["sfi_of_floor"] >= 0.75]
        rows.append(("SFI arm >= 0.75 of its bytes floor",
                     f"met ({min(sfi):.2f}-{max(sfi):.2f})" if not low else
                     f"missed by {len(low)} of {len(sfi)} rows: {min(low):.2f}-{max(low):.2f} "
                     f"({0.75 - max(low):.2f} to {0.75 - min(low):.2f} short)"
                     + (f"; met by {', '.join(met)}" if met else "")))
    for r in records:
        if r["model"] == "qwen3-4b" and r["context"] == 131072:
            tps, sp = r["sfi_tokens_per_s"], r["speedup"]
            ok = tps >= 1000 and sp >= 6
            rows.append(("qwen3-4b 128K: SFI >= 1000 tok/s and >= 6x dense",
                         ("met" if ok else "missed") + f": {tps:.0f} tok/s ({tps / 10:.0f} % of "
                         f"1000) and {sp:.2f}x ({sp / 6 * 100:.0f} % of 6x), batch {r['batch']}"))
    return rows


def write_outputs(records, meta, out, notes=None):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "e2e.json"), "w") as f:
        json.dump({"meta": meta, "results": records}, f, indent=1)
    lines = ["# End-to-end decode throughput: SFI vs dense", "",
             f"Machine: {meta['device']}; jax {meta['jax']}; measured copy bandwidth "
             f"{meta['copy_bw_tbs']:.2f} TB/s.", "",
             f"Command: `{meta['command']}`", "",
             "Random bf16 weights created on the device; KV cache filled with random values "
             f"(fill={meta['fill']}); {meta['new_tokens']} timed new tokens per row after a "
             f"warm-up chunk; triggers every {meta['trigger_every']} tokens per row (staggered) "
             f"plus t_max={meta['t_max']}; SFI budget sink 4 + selected 2048 + recent 256. "
             "Dense arm: the same engine with the Pallas dense kernel (no SFI state). "
             "Floor = bytes-model time (weights + KV bytes read per step / copy bandwidth); "
             "'of floor' = floor / measured (1.0 = at the bandwidth limit).", "",
             "| model | ctx | batch | dense tok/s | SFI tok/s | speedup | slow share | "
             "fast step ms | slow step ms (all slots refreshed) | selector ms per refreshed row | "
             "repack ms per refreshed row | dense attn share | dense of floor | SFI of floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(
            f"| {r['model']} | {r['context']} | {r['batch']} | {r['dense_tokens_per_s']:.0f} | "
            f"{r['sfi_tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['slow_share']:.3f} | "
            f"{r['fast_step_s'] * 1e3:.2f} | {r['slow_step_s'] * 1e3:.2f} | "
            f"{r.get('selector_row_s', r.get('selector_step_s', float('nan'))) * 1e3:.2f} | "
            f"{_ms(r.get('repack_row_s'))} | "
            f"{r['dense_attention_share']:.2f} | "
            f"{r['dense_of_floor']:.2f} | {r['sfi_of_floor']:.2f} |")
    # (older records hold one point in the record itself)
    ex = [{**r, **p} for r in records
          for p in r.get("exact", [r] if "exact_tokens_per_s" in r else [])]
    if ex:
        lines += ["", "Exact mode (SFI fast steps draft, one dense multi-query step verifies): "
                  "acceptance drawn per draft token at the stated rate (random weights accept "
                  "nothing useful); model = bytes model with i.i.d. acceptance at the draft "
                  "length that pays best at that rate (0: a plain dense step).", "",
                  "| model | ctx | batch | draft_len | accept rate | tokens/round | dense tok/s | "
                  "exact tok/s | exact vs dense | model tok/s | model vs dense | round ms | "
                  "model round ms | refresh share | drafted per verify |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in ex:
            lines.append(
                f"| {r['model']} | {r['context']} | {r['batch']} | {r['exact_draft_len']} | "
                f"{r['exact_accept_rate']:.2f} | {r['exact_tokens_per_round']:.2f} | "
                f"{r['dense_tokens_per_s']:.0f} | {r['exact_tokens_per_s']:.0f} | "
                f"{r['exact_speedup']:.2f}x | {r['pred_exact_tokens_per_s']:.0f} | "
                f"{r['pred_exact_speedup']:.2f}x | {r['exact_round_s'] * 1e3:.2f} | "
                f"{r['pred_exact_round_s'] * 1e3:.2f} | {r['exact_refresh_share']:.2f} | "
                f"{_num(r.get('exact_drafted_per_verify'))} |")
    if meta.get("out_of_memory"):
        lines += ["", "No row (out of memory at every batch tried): " + "; ".join(
            f"{o['model']} {o['context']} (batches {', '.join(map(str, o['batches']))})"
            for o in meta["out_of_memory"]) + "."]
    lines += ["", "## Targets (issue 6)", "", "| target | result |", "|---|---|"]
    lines += [f"| {t} | {res} |" for t, res in targets(records)]
    if notes:
        lines += ["", notes.strip()]
    with open(os.path.join(out, "e2e.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if records:
        plot(records, meta, out)


def plot(records, meta, out):
    """e2e.png: throughput and speedup against context length, dense vs SFI, per model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for i, m in enumerate(sorted({r["model"] for r in records})):
            rs = sorted((r for r in records if r["model"] == m), key=lambda r: r["context"])
            x = [r["context"] // 1024 for r in rs]
            color = f"C{i}"  # one colour per model: dense dashed, SFI solid
            a1.plot(x, [r["dense_tokens_per_s"] for r in rs], "o--", color=color,
                    label=f"{m} dense")
            a1.plot(x, [r["sfi_tokens_per_s"] for r in rs], "o-", color=color, label=f"{m} SFI")
            a2.plot(x, [r["speedup"] for r in rs], "o-", color=color, label=m)
        for a in (a1, a2):
            a.set_xscale("log", base=2)
            a.set_xlabel("context (K tokens)")
            a.legend(fontsize=7)
        a1.set_ylabel("decode tokens/s")
        a2.set_ylabel("SFI speedup over dense")
        fig.suptitle(meta["device"])
        fig.tight_layout()
        fig.savefig(os.path.join(out, "e2e.png"), dpi=120)
    except Exception as e:  # plots are optional
        print("plot skipped:", e)


def merge_reports(paths, out, notes=None):
    """One report from several runs' e2e.json (each record keeps the command that made it). A
    (model, context) in several files keeps its last file's row, and an out-of-memory entry is
    dropped where some file has a row for it. The newest engine check (last file with one)
    is kept with the command that ran it."""
    rows, meta = {}, None  # (model, context) -> record
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        meta = meta or dict(d["meta"], out_of_memory=[])
        meta["out_of_memory"] += [o for o in d["meta"].get("out_of_memory", [])
                                  if o not in meta["out_of_memory"]]
        if "engine_check" in d["meta"]:
            meta["engine_check"] = d["meta"]["engine_check"]
            meta["engine_check_command"] = d["meta"].get("engine_check_command",
                                                         d["meta"]["command"])
        for r in d["results"]:
            r.setdefault("command", d["meta"]["command"])
            rows[r["model"], r["context"]] = r
    records = list(rows.values())
    meta["out_of_memory"] = [o for o in meta["out_of_memory"]
                             if (o["model"], o["context"]) not in rows]
    models = list(dict.fromkeys(r["model"] for r in records))  # first-seen order, longest first
    records.sort(key=lambda r: (models.index(r["model"]), -r["context"]))
    meta["command"] = " ; ".join(dict.fromkeys(r["command"] for r in records))  # the kept rows'
    meta["copy_bw_tbs"] = statistics.median(json.load(open(p))["meta"]["copy_bw_tbs"]
                                            for p in paths)
    write_outputs(records, meta, out, notes)


def attention_config(text):
    """An attention kernel config from "BK:WARPS:STAGES:PROGRAMS_PER_SM" (the Triton kernel's)
    or "mosaic:BK:STAGES:PROGRAMS_PER_SM[:r]" (the Mosaic GPU twin's; r: P·V's operand from
    registers)."""
    from sfi_jax.kernels import attention_gpu

    if text.startswith("mosaic:"):
        return _common.mosaic_attention_config(text[len("mosaic:"):], per_sm=True)
    bk, w, st, per_sm = (int(v) for v in text.split(":"))
    return attention_gpu.Config(block_k=bk, num_warps=w, num_stages=st,
                                programs=per_sm * attention_gpu._NUM_SMS)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-4b,qwen3-0.6b,qwen3-30b-a3b")
    p.add_argument("--contexts", default="8192,16384,32768,65536,131072")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--chunk-steps", type=int, default=64)
    p.add_argument("--fill", choices=("random",), default="random",
                   help="KV cache contents (random values instead of a prefill)")
    p.add_argument("--trigger-every", type=int, default=20)
    p.add_argument("--t-max", type=int, default=64)
    p.add_argument("--refresh-rows", type=int, default=0,
                   help="refresh slots per step (0: max(2, batch/4))")
    p.add_argument("--opt", action="append", default=[], metavar="FIELD=VALUE",
                   help="an engine option (sfi_jax.EngineOptions field), e.g. "
                        "selector_topk=radix or repack=xla; repeat for several")
    p.add_argument("--sfi", action="append", default=[], metavar="FIELD=VALUE",
                   help="an SFIConfig field for the SFI arm, e.g. successor_radius=7")
    p.add_argument("--mode", choices=("sfi", "exact"), default="sfi",
                   help="exact: also time exact mode (SFI drafts, dense verify)")
    p.add_argument("--draft-len", default="3",
                   help="exact mode's draft length (the most a round drafts); comma-separated "
                   "for several")
    p.add_argument("--accept-rate", default="0.78",
                   help="exact mode: probability each draft token is accepted (random weights "
                   "accept nothing useful; take it from benchmarks/acceptance.md); "
                   "comma-separated for several, each timed on one program per draft length")
    p.add_argument("--out", default="benchmarks")
    p.add_argument("--smoke", action="store_true", help="tiny config, for a CPU check")
    p.add_argument("--no-check", action="store_true", help="skip the engine correctness check")
    p.add_argument("--profile", action="store_true",
                   help="record each arm's kernel breakdown (busy time, top kernels) on GPU")
    p.add_argument("--stacked", action="store_true",
                   help="stacked layer weights under lax.scan (default: split per layer)")
    p.add_argument("--distributed", action="store_true", help="jax.distributed.initialize()")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="write the report from these e2e.json files (no device work)")
    p.add_argument("--notes", default=None, help="Markdown appended to e2e.md")
    p.add_argument("--sparse-config", default=None, metavar="BK:WARPS:STAGES:PROGRAMS_PER_SM",
                   help="a sweep point: this run's sparse decode kernel config, in place of "
                        "attention_gpu's SPARSE and SPARSE_SMALL, or mosaic:BK:STAGES:"
                        "PROGRAMS_PER_SM[:r] for the Mosaic GPU twin's SPARSE "
                        "(KernelTuning.sparse_attention)")
    p.add_argument("--dense-config", default=None, metavar="BK:WARPS:STAGES:PROGRAMS_PER_SM",
                   help="a sweep point: the dense arm's decode kernel config, in place of "
                        "attention_gpu's DENSE (KernelTuning.dense_attention)")
    p.add_argument("--fused-programs", type=int, default=None, metavar="PER_SM",
                   help="a sweep point: the fused matmul epilogues' grid aim in programs per SM "
                        "(fewer, longer K splits for the last program to add up)")
    p.add_argument("--k-major", choices=("on", "off"), default="off",
                   help="the o and dense MLP weights stored [N, K] for the K-major kernel "
                        "(load_model(k_major=True)) or [K, N] for the split-K kernel (off: "
                        "load_model's default)")
    p.add_argument("--kmajor-config", default=None,
                   metavar="BN:BK:WARPS:STAGES:PER_SM[:PREFETCH]",
                   help="a sweep point: the K-major kernel's tiles for every weight, in place "
                        "of skinny_matmul_gpu.KMajorConfig's defaults (KernelTuning.kmajor)")
    p.add_argument("--no-launch-dependents", action="store_true",
                   help="an A/B point: no programmatic dependent launch (the Triton kernels do "
                        "not signal griddepcontrol.launch_dependents, the Mosaic GPU matmul "
                        "does not fetch weights before griddepcontrol.wait; "
                        "KernelTuning.launch_dependents)")
    p.add_argument("--zero-fill", action="store_true",
                   help="an A/B point: the Mosaic GPU kernels read their rows unpadded, TMA "
                        "filling those past an array's end with zeros (KernelTuning.zero_fill)")
    p.add_argument("--kernel-stores", action="store_true",
                   help="an A/B point: the Mosaic GPU sparse read stores the step's key and "
                        "value itself (KernelTuning.kernel_stores)")
    args = p.parse_args(argv)
    from sfi_jax.kernels.common import signals_dependents

    try:
        args.draft_lens = [int(x) for x in args.draft_len.split(",") if x.strip()]
        args.accept_rates = [float(x) for x in args.accept_rate.split(",") if x.strip()]
    except ValueError as e:
        p.error(f"--draft-len takes integers and --accept-rate numbers, comma-separated: {e}")
    if not args.draft_lens or min(args.draft_lens) < 1:
        p.error(f"--draft-len must be >= 1, got {args.draft_len!r}")
    if not args.accept_rates or not all(0 <= a <= 1 for a in args.accept_rates):
        p.error(f"--accept-rate must be in [0, 1], got {args.accept_rate!r}")

    try:
        engine_options(args)
    except ValueError as e:
        p.error(str(e))
    notes = open(args.notes).read() if args.notes else None
    if args.merge:
        merge_reports(args.merge, args.out, notes)
        return
    if args.distributed:
        jax.distributed.initialize()
    if args.smoke:
        args.new_tokens, args.chunk_steps, args.batch = 16, 8, 2
    bw = copy_bandwidth(8 << 20 if args.smoke else 2 << 30)
    limit = device_bytes()
    meta = dict(device=f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
                jax=jax.__version__, python=platform.python_version(), copy_bw_tbs=bw / 1e12,
                command="python " + " ".join(sys.argv), fill=args.fill,
                device_bytes_limit=limit,
                mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                options=dataclasses.asdict(engine_options(args)),
                package=os.path.dirname(os.path.abspath(sfi_jax.__file__)),
                new_tokens=args.new_tokens, trigger_every=args.trigger_every, t_max=args.t_max,
                sparse_config=args.sparse_config, dense_config=args.dense_config,
                fused_programs=args.fused_programs,
                kmajor_config=args.kmajor_config,
                launch_dependents=signals_dependents(
                    engine_options(args).tuning.launch_dependents),
                k_major=args.k_major == "on")
    if not args.smoke and not args.no_check:
        meta["engine_check"] = engine_check(k_major=args.k_major == "on",
                                            options=engine_options(args))
        print("engine check:", meta["engine_check"], flush=True)
    records = []
    models = args.models.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.smoke:
        tiny = ModelConfig(name="tiny", num_layers=2, hidden_size=64, intermediate_size=128,
                           num_q_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256,
                           max_position_embeddings=8192)
        models, contexts = ["tiny"], [2560]
    for name in models:
        cfg = tiny if args.smoke else PRESETS[name]
        from sfi_jax.models.params import random_params

        params = random_params(cfg, "bfloat16", 0)
        if not args.stacked:  # one weight dict per layer, as load_model does on GPU
            params["layers"] = split_layers(params["layers"], fuse_qkv=True,
                                            k_major=args.k_major == "on")
        for ctx in contexts:
            t = time.perf_counter()
            try:
                rec = bench_fitting(name, cfg, params, ctx, args, bw, limit)
            except OutOfMemory as e:  # the report says so; the other rows still run
                print(e, flush=True)
                meta.setdefault("out_of_memory", []).append(e.entry)
                write_outputs(records, meta, args.out, notes)
                continue
            rec["wall_s"] = time.perf_counter() - t
            rec.update(xla_flags=meta["xla_flags"], package=meta["package"])
            records.append(rec)
            print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v)
                              for k, v in rec.items()}), flush=True)
            write_outputs(records, meta, args.out, notes)
        del params
    print(open(os.path.join(args.out, "e2e.md")).read())


if __name__ == "__main__":
    main()
