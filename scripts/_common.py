"""Helpers shared by the benchmark and diagnostic scripts: timers, the random decode state a
benchmark starts from, and readers of profiler traces and compiled HLO.

Scripts import it as `import _common` after putting the scripts directory on sys.path; it puts
the checkout root there too, so a script runs the package of the checkout it lives in (an A/B
against another checkout runs that checkout's scripts).

Set XLA_PYTHON_CLIENT_MEM_FRACTION (or other start-up settings) before importing this module:
it imports jax.
"""

from __future__ import annotations

import collections
import functools
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# the token the benchmarks force as a trigger (a refresh of that row at the next step)
TRIGGER_ID = 13


# --- timers -------------------------------------------------------------------------------

def timeit(fn, *args, iters: int, repeats: int) -> float:
    """Median over repeats of the mean time of `iters` back-to-back calls, in microseconds
    (one untimed call first, so compiling is not counted)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(times)


def mosaic_attention_config(text, per_sm=False):
    """A Mosaic GPU decode attention config from "BK:STAGES:PROGRAMS[:FLAGS]" (PROGRAMS per SM
    with per_sm; FLAGS letters: r, P·V's operand from registers; w, whole waves)."""
    from sfi_jax.kernels import attention_mgpu

    bk, stages, programs, *flags = text.split(":")
    flags = flags[0] if flags else ""
    if len(text.split(":")) > 4 or set(flags) - set("rw"):
        raise ValueError(f"a Mosaic attention config is BK:STAGES:PROGRAMS[:FLAGS] with FLAGS "
                         f"of r and w, got {text!r}")
    return attention_mgpu.Config(
        block_k=int(bk), stages=int(stages),
        programs=int(programs) * (attention_mgpu._NUM_SMS if per_sm else 1),
        p_regs="r" in flags, whole_wave="w" in flags)


def kmajor_config(text):
    """A K-major kernel config from "BN:BK:WARPS:STAGES[:PROGRAMS_PER_SM[:PREFETCH]]"."""
    from sfi_jax.kernels import skinny_matmul_gpu as sm

    v = [int(t) for t in text.split(":")]
    if not 4 <= len(v) <= 6:
        raise ValueError(f"a K-major config is BN:BK:WARPS:STAGES[:PER_SM[:PREFETCH]], "
                         f"got {text!r}")
    v += [0, 0][:6 - len(v)]  # (absent: one program per column block, no tile ahead)
    v[4] *= sm._NUM_SMS
    return sm.KMajorConfig(*v)


def copy_bandwidth(n_bytes=2 << 30):
    """Measured device copy bandwidth (read + write bytes per second)."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 2.0)
    return 2 * n_bytes / (timeit(f, x, iters=10, repeats=5) / 1e6)


def device_bytes():
    """The first device's memory limit (16 GiB where the device does not say)."""
    d = jax.devices()[0]
    st = d.memory_stats() if hasattr(d, "memory_stats") else None
    return int(st["bytes_limit"]) if st and "bytes_limit" in st else 16 << 30


# --- the engine check's model ----------------------------------------------------------------

def engine_check_model(k_major=False):
    """(model, prompts) of the e2e engine check: a small random float32 Qwen3-like decoder
    (head dim 128, GQA 4; on a GPU with split layers, fused q/k/v weights and, with k_major,
    the K-major o and MLP weights, so the few-row kernels and their fused epilogues run) and
    three prompts of different lengths.
    bench_e2e.py runs its arms on it."""
    from sfi_jax.models.config import ModelConfig
    from sfi_jax.models.modeling import Model
    from sfi_jax.models.params import random_params

    cfg = ModelConfig(name="check", num_layers=2, hidden_size=256, intermediate_size=512,
                      num_q_heads=8, num_kv_heads=2, head_dim=128, vocab_size=512,
                      max_position_embeddings=4096)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 512, n)) for n in (300, 777, 1500)]
    model = Model(cfg, random_params(cfg, "float32", 3))
    if jax.default_backend() == "gpu":  # per-layer weights, q/k/v fused: load_model's GPU layout
        model = model.split_layers(fuse_qkv=True, k_major=k_major)
    return model, prompts


# --- the benchmark's decode state -----------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(1,))
def _random_layer(key, shape):
    return jax.random.normal(key, shape, jnp.bfloat16)


@functools.partial(jax.jit, donate_argnums=0)
def put_layer(stack, x, layer):
    """stack[layer] = x in place (the stack is donated)."""
    return stack.at[layer].set(x)


@jax.jit
def _layer_key_norms(k, layer):
    return jnp.sqrt(jnp.sum(jnp.square(k[layer].astype(jnp.float32)), -1))


def random_kv(key, shape):
    """Random bf16 K and V made on the device one layer at a time into one buffer each, so the
    random bits and float32 temporaries are one layer's, not the whole cache's (at long
    contexts those temporaries do not fit beside the weights)."""
    out = []
    for key in jax.random.split(key):
        cache = jnp.zeros(shape, jnp.bfloat16)
        for layer, k in enumerate(jax.random.split(key, shape[0])):
            cache = put_layer(cache, _random_layer(k, shape[1:]), layer)
        out.append(cache)
    return tuple(out)


def make_state(cfg, B, S, ctx, sfi, seed=0):
    """A decode state of B rows at length `ctx` in a cache of S positions, filled with random
    K/V (instead of a prefill); with `sfi`, an empty SFI state whose key norms match the
    cache, so the first step of each row is a refresh."""
    from sfi_jax.runtime.state import DecodeState, empty_sfi_state

    shape = (cfg.num_layers, B, cfg.num_kv_heads, S, cfg.head_dim)
    k, v = random_kv(jax.random.key(seed), shape)
    st = None
    if sfi is not None:
        st = empty_sfi_state(cfg, sfi, B, S, jnp.bfloat16)
        # one layer at a time, in separate calls: a float32 copy of the whole cache (or the
        # transposed copy XLA made of a lax.map over layers) would not fit
        norms = st.key_norms
        for layer in range(cfg.num_layers):
            norms = put_layer(norms, _layer_key_norms(k, layer), layer)
        st = st._replace(key_norms=norms)
    return DecodeState(k=k, v=v, lengths=jnp.full((B,), ctx, jnp.int32),
                       token=jnp.zeros((B,), jnp.int32), done=jnp.zeros((B,), bool),
                       step=jnp.int32(0), key=jax.random.key(seed), sfi=st,
                       nonfinite=jnp.zeros((B,), bool))  # generate's per-row finite check


def forced_schedule(B, n, start, every, vocab):
    """[B, n] teacher-forced tokens that are no trigger, except that row b emits TRIGGER_ID
    every `every` steps (0: never), staggered by row."""
    rng = np.random.default_rng(start)
    toks = rng.integers(100, vocab, size=(B, n)).astype(np.int32)
    if every > 0:
        for b in range(B):
            for i in range(n):
                if (start + i + b * every // max(B, 1)) % every == every - 1:
                    toks[b, i] = TRIGGER_ID
    return toks


def chunk_plan(ctx, chunk_steps, new_tokens):
    """(steps per chunk, timed chunks, cache length they need) for a run at `ctx`."""
    chunks = max(1, new_tokens // chunk_steps)
    return chunk_steps, chunks, ctx + (chunks + 3) * chunk_steps + 128


# --- profiler traces and compiled HLO ------------------------------------------------------

def kernel_stats(trace_dir, n_steps, top=12):
    """Sum kernel events on the GPU plane's stream lines of a profiler trace: busy time, kernel
    count, and the `top` kernels by time as (name, us per step, launches per step). None when
    the trace has no GPU kernels."""
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


def _stack_frames(hlo_text):
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
    frames = _stack_frames(hlo_text)
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
