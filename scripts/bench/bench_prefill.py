"""Time to first token through the public API (`sfi_jax.generate`), warm and cold, beside the
FLOP floor; and whole requests (prompt + new tokens, dense and SFI) beside the same request in
Hugging Face transformers with SDPA attention.

Every measurement runs in a child process of this script, so that JAX and torch never share a
GPU's memory and a cold start is a real fresh process:
- warm: per model, prompts of each context and batch, `generate(..., max_new_tokens=1)` three
  times: the first compiles (ttft_with_compile_s), the second is the warm time to first token,
  the third a prompt of another length in the same bucket (it must compile nothing);
- cold: a fresh process with an empty persistent compilation cache, then another with the
  filled cache (time from process start to the first token, model creation included);
- requests: prompt + new tokens end to end, dense and SFI (second call), with the bytes model
  of the decode part at the measured copy bandwidth;
- hf: the same requests by transformers (random weights of the same config, bf16, SDPA): the
  first token by one forward with logits_to_keep=1, the request by `generate` (warm).
Results merge into OUT/prefill.json by row key (several runs fill one table) and are written
again as OUT/prefill.md and OUT/prefill.png after every child.

    python scripts/bench/bench_prefill.py --models qwen3-4b --contexts 32768,130816 \\
        --batches 1 --parts warm --out benchmarks
    python scripts/bench/bench_prefill.py --models qwen3-4b --parts requests,hf --out benchmarks
    python scripts/bench/bench_prefill.py --smoke --out /tmp/prefill   # tiny config on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

T_START = time.perf_counter()
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
PEAK_FLOPS = 790e12  # bf16 dense matmul on the H200
MODELS = "qwen3-4b,qwen3-0.6b,qwen3-30b-a3b"
CONTEXTS = "8192,16384,32768,65536,130816"  # 130816 = 128K minus 256 new tokens
REQUESTS = "130816,65536,32768"
PARTS = ("warm", "cold", "requests", "hf")


# ------------------------------------------------------------------ configs and FLOPs

def tiny_config():
    from sfi_jax.models.config import ModelConfig

    return ModelConfig(name="tiny", num_layers=2, hidden_size=64, intermediate_size=128,
                       num_q_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256,
                       max_position_embeddings=4096)


def config_of(name):
    if name == "tiny":
        return tiny_config()
    from sfi_jax.models.config import PRESETS

    return PRESETS[name]


def active_params(cfg) -> int:
    """Parameters one token multiplies by, embeddings and the LM head excluded (the prefill
    needs the last position's logits only); for MoE the routed experts a token uses."""
    total = cfg.param_count() - cfg.vocab_size * cfg.hidden_size * \
        (1 if cfg.tie_word_embeddings else 2)
    if cfg.is_moe:
        unused = cfg.num_experts - cfg.num_experts_per_tok
        total -= cfg.num_layers * unused * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return total


def prefill_flops(cfg, batch: int, tokens: int) -> float:
    """2 x active params x tokens + causal attention (q.k and p.v over the lower triangle)."""
    attn = 2 * cfg.num_layers * cfg.num_q_heads * cfg.head_dim * tokens * tokens
    return batch * (2.0 * active_params(cfg) * tokens + attn)


def decode_bytes_model(cfg, batch, context, new_tokens, slow_steps, sfi) -> dict:
    """Bytes one decode step reads: the weights a step uses plus the KV it attends (dense: the
    whole context; SFI fast: sink + selected + recent; SFI slow: the whole context)."""
    weights = 2 * (active_params(cfg) + cfg.vocab_size * cfg.hidden_size)
    if cfg.is_moe:  # a batch of B tokens touches up to B x top_k experts
        per = cfg.num_layers * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
        weights += per * (min(cfg.num_experts, batch * cfg.num_experts_per_tok)
                          - cfg.num_experts_per_tok)
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    steps = new_tokens - 1
    dense = steps * (weights + batch * kv_token * (context + new_tokens // 2))
    if sfi is None:
        return {"decode_bytes": dense}
    fast_kv = batch * kv_token * (sfi.n_sink + sfi.k_select + sfi.n_recent)
    slow = sum(slow_steps) / max(batch, 1)
    total = steps * weights + (steps - slow) * fast_kv + slow * batch * kv_token * context
    return {"decode_bytes": total}


# ------------------------------------------------------------------ children (measurements)

def _make_model(name):
    import sfi_jax

    if name != "tiny":
        return sfi_jax.load_model(name)
    from sfi_jax.models.modeling import Model
    from sfi_jax.models.params import random_params

    cfg = tiny_config()
    return Model(cfg, random_params(cfg, "bfloat16", 0))


def _prompts(batch, length, vocab, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, min(vocab, 32000), (batch, length)).tolist()


def _row(stats, keys):
    return {k: (round(stats[k], 4) if isinstance(stats[k], float) else stats[k]) for k in keys}


TTFT_KEYS = ("ttft_s", "ttft_with_compile_s", "prefill_compile_s", "prefill_tokens_per_s",
             "prefill_chunk", "prefill_chunks", "padded_prompt", "max_len")


def _same_bucket_length(ctx, new_tokens):
    """Another prompt length with the same padded prompt and cache buckets as ctx (so the
    engine must compile nothing for it)."""
    from sfi_jax.runtime.prefill import bucket

    def key(n):
        return bucket(n), max(bucket(n + new_tokens), bucket(n))

    for d in (ctx // 64, 100, 10, 1):
        for other in (ctx - d, ctx + d):
            if other >= 1 and other != ctx and key(other) == key(ctx):
                return other
    return ctx


def child_warm(args):
    import sfi_jax

    model = _make_model(args.model)
    cfg = model.config
    out = []
    options = sfi_jax.EngineOptions(prefill_attention=args.prefill_attention)
    for batch in args.batch_list:
        for ctx in args.context_list:
            kw = dict(max_new_tokens=1, mode="dense", stop_at_eos=False, options=options)
            cold = sfi_jax.generate(model, _prompts(batch, ctx, cfg.vocab_size, 0), **kw).stats
            warm = sfi_jax.generate(model, _prompts(batch, ctx, cfg.vocab_size, 1), **kw).stats
            other = _same_bucket_length(ctx, kw["max_new_tokens"])
            again = sfi_jax.generate(model, _prompts(batch, other, cfg.vocab_size, 2), **kw).stats
            floor = prefill_flops(cfg, batch, ctx) / PEAK_FLOPS
            rec = {"part": "warm", "model": args.model, "batch": batch, "prompt": ctx,
                   "prefill_attention": args.prefill_attention,
                   **_row(warm, TTFT_KEYS),
                   "first_call_ttft_with_compile_s": round(cold["ttft_with_compile_s"], 3),
                   "first_call_compile_s": round(cold["prefill_compile_s"], 3),
                   "other_length": other, "other_length_compile_s": again["prefill_compile_s"],
                   "other_length_ttft_s": round(again["ttft_s"], 4),
                   "flop_floor_s": float(f"{floor:.4g}"),
                   "floor_fraction": float(f"{floor / warm['ttft_s']:.3g}"),
                   "tflops": float(f"{prefill_flops(cfg, batch, ctx) / warm['ttft_s'] / 1e12:.4g}")}
            print("RESULT " + json.dumps([rec]), flush=True)
            out.append(rec)


def child_cold(args):
    from sfi_jax.cache import enable_compilation_cache

    enable_compilation_cache(args.cache_dir)
    import jax
    import sfi_jax

    cache_events = {"hits": 0, "misses": 0}  # the persistent cache's own count, not a timing
    names = {f"/jax/compilation_cache/cache_{kind}": kind for kind in cache_events}

    def count(event, **_):
        if event in names:
            cache_events[names[event]] += 1

    jax.monitoring.register_event_listener(count)

    t_import = time.perf_counter() - T_START
    model = _make_model(args.model)
    cfg = model.config
    t_model = time.perf_counter() - T_START
    ctx, batch = args.context_list[0], args.batch_list[0]
    st = sfi_jax.generate(model, _prompts(batch, ctx, cfg.vocab_size, 0), max_new_tokens=1,
                          mode="dense", stop_at_eos=False).stats
    rec = {"part": "cold", "model": args.model, "batch": batch, "prompt": ctx,
           "cache": args.cache_state, "import_s": round(t_import, 2),
           "model_ready_s": round(t_model, 2),
           "process_to_first_token_s": round(time.perf_counter() - T_START, 2),
           "cache_hits": cache_events["hits"], "cache_misses": cache_events["misses"],
           **_row(st, ("ttft_with_compile_s", "ttft_s", "prefill_compile_s"))}
    print("RESULT " + json.dumps([rec]), flush=True)


def child_requests(args):
    import sfi_jax
    from _common import copy_bandwidth

    model = _make_model(args.model)
    cfg = model.config
    bw = copy_bandwidth(8 << 20 if args.model == "tiny" else 2 << 30)
    sfi = sfi_jax.SFIConfig() if args.model != "tiny" else \
        sfi_jax.SFIConfig(n_sink=2, n_recent=16, k_select=32)
    for ctx in args.context_list:
        for mode in ("dense", "sfi"):
            batch = args.batch_list[0]
            kw = dict(max_new_tokens=args.new_tokens, mode=mode, sfi=sfi, stop_at_eos=False)
            sfi_jax.generate(model, _prompts(batch, ctx, cfg.vocab_size, 3), **kw)
            t = time.perf_counter()
            st = sfi_jax.generate(model, _prompts(batch, ctx, cfg.vocab_size, 4), **kw).stats
            total = time.perf_counter() - t
            bytes_ = decode_bytes_model(cfg, batch, ctx, args.new_tokens, st["slow_steps"],
                                        sfi if mode == "sfi" else None)
            rec = {"part": "requests", "model": args.model, "batch": batch, "prompt": ctx,
                   "new_tokens": args.new_tokens, "mode": mode, "total_s": round(total, 3),
                   **_row(st, ("ttft_s", "prefill_s", "decode_s", "decode_tokens_per_s",
                               "compile_s")),
                   "slow_steps": st["slow_steps"],
                   "decode_bytes": bytes_["decode_bytes"], "copy_bandwidth": round(bw),
                   "bytes_model_decode_s": float(f"{bytes_['decode_bytes'] / bw:.4g}")}
            print("RESULT " + json.dumps([rec]), flush=True)


def hf_config(cfg):
    import transformers as tf

    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_q_heads,
              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
              max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
              rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
              rope_scaling=cfg.rope_scaling_dict, attn_implementation="sdpa")
    if cfg.is_moe:
        return tf.Qwen3MoeConfig(moe_intermediate_size=cfg.moe_intermediate_size,
                                 num_experts=cfg.num_experts,
                                 num_experts_per_tok=cfg.num_experts_per_tok,
                                 norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
                                 mlp_only_layers=[], intermediate_size=cfg.intermediate_size,
                                 **kw)
    return tf.Qwen3Config(intermediate_size=cfg.intermediate_size, **kw)


def child_hf(args):
    import torch
    import transformers as tf

    cfg = config_of(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and args.model != "tiny":
        raise SystemExit("transformers peer: no CUDA device")
    hcfg = hf_config(cfg)
    cls = tf.Qwen3MoeForCausalLM if cfg.is_moe else tf.Qwen3ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(hcfg).to(torch.bfloat16).eval()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for ctx in args.context_list:
        ids = torch.as_tensor(_prompts(args.batch_list[0], ctx, cfg.vocab_size, 4),
                              device=device)
        with torch.no_grad():
            times = []
            for _ in range(2):  # the second is the warm one
                sync()
                t = time.perf_counter()
                model(ids, logits_to_keep=1)
                sync()
                times.append(time.perf_counter() - t)
            gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                       do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
            totals = []
            for _ in range(2):
                sync()
                t = time.perf_counter()
                model.generate(ids, **gen)
                sync()
                totals.append(time.perf_counter() - t)
        rec = {"part": "hf", "model": args.model, "batch": args.batch_list[0], "prompt": ctx,
               "new_tokens": args.new_tokens, "ttft_s": round(times[1], 4),
               "total_s": round(totals[1], 3), "attention": "sdpa", "device": device,
               "torch": torch.__version__, "transformers": tf.__version__}
        print("RESULT " + json.dumps([rec]), flush=True)
        del ids
        if device == "cuda":
            torch.cuda.empty_cache()


CHILDREN = {"warm": child_warm, "cold": child_cold, "requests": child_requests, "hf": child_hf}


# ------------------------------------------------------------------ orchestration and outputs

def row_key(r):
    return (r["part"], r["model"], r["batch"], r["prompt"], r.get("mode"), r.get("cache"),
            r.get("prefill_attention", "auto"))


def run_child(kind, model, contexts, batches, args, extra=(), env=None,
              meta=None) -> list[dict]:
    """The rows a child process prints; `meta` takes the device and jax version a child names
    (where meta["device"] is still None)."""
    cmd = [sys.executable, HERE, "--child", kind, "--models", model,
           "--contexts", ",".join(map(str, contexts)),
           "--batches", ",".join(map(str, batches)), "--new-tokens", str(args.new_tokens),
           "--prefill-attention", args.prefill_attention, *extra]
    print("+", " ".join(cmd[1:]), flush=True)
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.dirname(os.path.dirname(HERE)),
                                         env.get("PYTHONPATH", "")])
    res = subprocess.run(cmd, capture_output=True, text=True, env=env,
                         timeout=args.child_timeout)
    rows = []
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            rows += json.loads(line[len("RESULT "):])
        elif line.startswith("DEVICE ") and meta is not None and meta["device"] is None:
            meta["device"], _, meta["jax"] = line[len("DEVICE "):].rpartition("|")
    if res.returncode != 0:
        print(f"child {kind} {model} failed ({res.returncode}):\n{res.stderr[-3000:]}",
              flush=True)
        rows.append({"part": "error", "model": model, "batch": batches[0],
                     "prompt": contexts[0], "mode": kind, "error": res.stderr[-1500:]})
    return rows


def merge(out_dir, rows, meta):
    path = os.path.join(out_dir, "prefill.json")
    old = {"rows": [], "runs": []}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    keep = {row_key(r): r for r in old["rows"]}
    for r in rows:
        keep[row_key(r)] = r
    data = {"rows": sorted(keep.values(), key=lambda r: tuple(map(str, row_key(r)))),
            "runs": old.get("runs", []) + [meta]}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return data


def _fmt(x, digits=2):
    return "" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def write_markdown(data, out_dir):
    rows = data["rows"]
    lines = ["# Time to first token (prefill) and whole requests", ""]
    if data["runs"]:
        last = data["runs"][-1]
        lines += [f"Last run: `{last['command']}` on {last['device']} (jax {last['jax']}).",
                  "FLOP floor: (2 x active params x tokens + causal attention FLOPs) at "
                  f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s. Warm = second call in the process; times "
                  "exclude compiling unless named.", ""]
    warm = [r for r in rows if r["part"] == "warm"]
    if warm:
        lines += ["## Time to first token, warm", "",
                  "| model | batch | prompt | prefill attention | TTFT s | floor s | "
                  "floor/TTFT | TFLOP/s | prompt tokens/s | chunk x n | first call (compile "
                  "incl.) s | other length in bucket: compile s |", "|" + "---|" * 12]
        for r in warm:
            lines.append(f"| {r['model']} | {r['batch']} | {r['prompt']} | "
                         f"{r.get('prefill_attention', 'auto')} | {_fmt(r['ttft_s'])} "
                         f"| {_fmt(r['flop_floor_s'])} | {_fmt(r['floor_fraction'])} | "
                         f"{_fmt(r['tflops'], 0)} | {_fmt(r['prefill_tokens_per_s'], 0)} | "
                         f"{r['prefill_chunk']} x {r['prefill_chunks']} | "
                         f"{_fmt(r['first_call_ttft_with_compile_s'])} | "
                         f"{_fmt(r['other_length_compile_s'])} |")
        lines.append("")
    cold = [r for r in rows if r["part"] == "cold"]
    if cold:
        lines += ["## Cold start (a fresh process; persistent compilation cache empty, then "
                  "filled)", "", "| model | batch | prompt | cache | process start to first "
                  "token s | of which import s | model ready s | compile s | cache hits / misses |",
                  "|" + "---|" * 9]
        for r in cold:
            lines.append(f"| {r['model']} | {r['batch']} | {r['prompt']} | {r['cache']} | "
                         f"{_fmt(r['process_to_first_token_s'])} | {_fmt(r['import_s'])} | "
                         f"{_fmt(r['model_ready_s'])} | {_fmt(r['prefill_compile_s'])} | "
                         f"{r.get('cache_hits', '-')} / {r.get('cache_misses', '-')} |")
        lines.append("")
    req = [r for r in rows if r["part"] == "requests"]
    hf = {(r["model"], r["batch"], r["prompt"]): r for r in rows if r["part"] == "hf"}
    if req:
        lines += ["## Whole requests (prompt + new tokens), warm", "",
                  "| model | batch | prompt | new | mode | TTFT s | decode s | total s | decode "
                  "tokens/s | slow steps | bytes-model decode s | transformers SDPA TTFT s | "
                  "transformers total s |", "|" + "---|" * 13]
        for r in req:
            peer = hf.get((r["model"], r["batch"], r["prompt"]), {})
            lines.append(f"| {r['model']} | {r['batch']} | {r['prompt']} | {r['new_tokens']} | "
                         f"{r['mode']} | {_fmt(r['ttft_s'])} | {_fmt(r['decode_s'])} | "
                         f"{_fmt(r['total_s'])} | {_fmt(r['decode_tokens_per_s'], 1)} | "
                         f"{r['slow_steps']} | {_fmt(r['bytes_model_decode_s'])} | "
                         f"{_fmt(peer.get('ttft_s'))} | {_fmt(peer.get('total_s'))} |")
        lines.append("")
    errors = [r for r in rows if r["part"] == "error"]
    if errors:
        lines += ["## Failed children", ""] + [
            f"- {r['mode']} {r['model']} {r['prompt']}: `{r['error'].strip().splitlines()[-1]}`"
            for r in errors if r["error"].strip()] + [""]
    with open(os.path.join(out_dir, "prefill.md"), "w") as f:
        f.write("\n".join(lines))


def write_plot(data, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    warm = [r for r in data["rows"] if r["part"] == "warm"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["model"], r["batch"]) for r in warm}):
        rs = sorted((r for r in warm if (r["model"], r["batch"]) == key), key=lambda r: r["prompt"])
        xs = [r["prompt"] for r in rs]
        line, = ax.plot(xs, [r["ttft_s"] for r in rs], "o-", label=f"{key[0]} x{key[1]}")
        ax.plot(xs, [r["flop_floor_s"] for r in rs], "--", color=line.get_color(), alpha=0.6)
    for r in (r for r in data["rows"] if r["part"] == "hf"):
        ax.plot([r["prompt"]], [r["ttft_s"]], "kx")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, warm (s)")
    ax.set_title("prefill: measured (solid), FLOP floor (dashed), transformers SDPA (x)")
    if warm:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "prefill.png"), dpi=110)
    plt.close(fig)


def device_line() -> tuple[str, str]:
    """The accelerator's name and jax's version, asked of a child (the parent imports no jax);
    a measuring child names them too (DEVICE line), so this runs only where none did."""
    code = ("import jax; d = jax.devices()[0]; "
            "print(getattr(d, 'device_kind', d.platform), jax.__version__, sep='|')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    name, _, version = res.stdout.strip().rpartition("|")
    return (name or "unknown"), version


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks", help="directory for prefill.{json,md,png}")
    p.add_argument("--models", default=MODELS, help="comma-separated presets")
    p.add_argument("--contexts", default=CONTEXTS, help="prompt lengths (warm part)")
    p.add_argument("--batches", default="1,4", help="batch sizes (warm part)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"subset of {PARTS}")
    p.add_argument("--cold-context", type=int, default=32768, help="prompt of the cold runs")
    p.add_argument("--request-contexts", default=REQUESTS, help="prompts of the requests")
    p.add_argument("--request-models", default="qwen3-4b", help="models of the requests")
    p.add_argument("--new-tokens", type=int, default=256, help="new tokens per request")
    p.add_argument("--child-timeout", type=int, default=1800, help="seconds per child")
    p.add_argument("--prefill-attention", default="auto",
                   help="EngineOptions.prefill_attention of the warm part (auto: the Mosaic GPU kernel on a Hopper GPU, cuDNN on other GPUs)")
    p.add_argument("--smoke", action="store_true", help="tiny config on CPU, every part")
    p.add_argument("--child", choices=tuple(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--cache-state", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.context_list = [int(c) for c in args.contexts.split(",") if c]
    args.batch_list = [int(b) for b in args.batches.split(",") if b]
    args.part_list = [x for x in args.parts.split(",") if x]
    bad = [x for x in args.part_list if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad}; expected a subset of {PARTS}")
    if args.smoke:
        args.models, args.request_models = "tiny", "tiny"
        args.context_list, args.batch_list = [300], [1]
        args.cold_context, args.request_contexts, args.new_tokens = 300, "600", 8
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        args.model = args.models
        sys.path.insert(0, ROOT)
        CHILDREN[args.child](args)
        if args.child != "hf":  # the device and jax version, for the parent's report
            import jax

            d = jax.devices()[0]
            print(f"DEVICE {getattr(d, 'device_kind', d.platform)}|{jax.__version__}",
                  flush=True)
        return 0
    os.makedirs(args.out, exist_ok=True)
    # the device and jax version: from the first child that names them (no process of its own)
    meta = {"command": "python scripts/bench/bench_prefill.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "device": None, "jax": None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # room for 128K x 4 rows
    if args.smoke:
        env["JAX_PLATFORMS"] = "cpu"
    rows: list[dict] = []

    def add(new):
        if meta["device"] is None:  # no child named them (each failed, or transformers only)
            meta["device"], meta["jax"] = device_line()
        rows.extend(new)
        data = merge(args.out, new, dict(meta, rows=len(new)))
        write_markdown(data, args.out)
        write_plot(data, args.out)

    models = [m for m in args.models.split(",") if m]
    if "warm" in args.part_list:
        for m in models:
            add(run_child("warm", m, args.context_list, args.batch_list, args, env=env,
                          meta=meta))
    if "cold" in args.part_list:
        for m in models:
            with tempfile.TemporaryDirectory(prefix="sfi_jax_cold_") as d:
                for state in ("empty", "filled"):
                    add(run_child("cold", m, [args.cold_context], [1], args,
                                  ["--cache-dir", d, "--cache-state", state], env=env,
                                  meta=meta))
    req_contexts = [int(c) for c in args.request_contexts.split(",") if c]
    for m in (m for m in args.request_models.split(",") if m):
        if "requests" in args.part_list:
            add(run_child("requests", m, req_contexts, [1], args, env=env, meta=meta))
        if "hf" in args.part_list:
            add(run_child("hf", m, req_contexts, [1], args, env=env, meta=meta))
    failed = [r for r in rows if r["part"] == "error"]
    print(f"wrote {args.out}/prefill.json, .md, .png ({len(rows)} rows, {len(failed)} failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
