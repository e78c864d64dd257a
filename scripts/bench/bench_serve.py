"""Load generator for `python -m sfi_jax.serve`: Poisson arrivals at several rates, prompts of
chosen lengths as random token ids, outputs of chosen lengths, streamed over HTTP from
127.0.0.1. Per engine and rate: output tokens/s, time to first token and inter-token latency
(p50, p99).

    # start one server per engine (sfi, dense) itself, on a free port
    python scripts/bench/bench_serve.py --model qwen3-4b --engines sfi,dense \\
        --rates 0.05,0.1,0.2 --prompt-lens 32768,131072 --output-lens 256,1024 \\
        --requests 32 --max-seconds 900 --server-arg=--max-slots=8 \\
        --server-arg=--max-len=132096 --out benchmarks/serve
    # against a server already running (one engine, named by --label)
    python scripts/bench/bench_serve.py --url http://127.0.0.1:8000 --label sfi --smoke
    python scripts/bench/bench_serve.py --smoke          # the embedded SmolLM2, a tiny load
    # time from `python -m sfi_jax.serve` to an `openai` client's first answer, 3 launches
    python scripts/bench/bench_serve.py --startup 3 --out benchmarks/serve_startup

Writes OUT.json (every request's timings too), OUT.md and OUT.png (latency against output
throughput, one line per engine, one point per rate).

Inter-token latency: tokens arrive in chunks (the engine's decode chunk); a chunk of k new
tokens arriving a gap g after the previous one gives k samples of g / k. Time to first token:
from sending the request to the first chunk with a token. Output tokens/s: all completion
tokens of a rate's requests over the time from its first request sent to its last finished.

The transformers library's own server as the peer arm: `--engines sfi,dense,transformers`
starts `transformers serve CHECKPOINT --continuous-batching` (paged attention) on the GPU. The
checkpoint (`--peer-checkpoint`, written once if missing) holds random weights of `--model`'s
shape and a word-level tokenizer that reads the text "t<id>" as token <id>: the peer gets the
same token ids as text that the sfi_jax servers get as lists, and each streamed "t" is one
token. The sfi_jax servers load the preset (random weights of the same shape).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOCAL_HOSTS = ("127.0.0.1", "localhost")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None,
                   help="a running server (127.0.0.1 only); default: start one per engine")
    p.add_argument("--label", default="server", help="the engine's name with --url")
    p.add_argument("--model", default="smollm2-135m", help="the model the servers load")
    p.add_argument("--engines", default="sfi,dense",
                   help="comma-separated --mode of each server started (not with --url)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="one more flag for the servers started, e.g. --server-arg=--max-slots=8")
    p.add_argument("--rates", default="0.5,1,2", help="requests per second, comma-separated")
    p.add_argument("--requests", type=int, default=16, help="requests per rate at most")
    p.add_argument("--max-seconds", type=float, default=600.0,
                   help="per rate: requests still running after this are cancelled and "
                        "counted as unfinished")
    p.add_argument("--prompt-lens", default="64,256",
                   help="prompt lengths in tokens, comma-separated (each request picks one)")
    p.add_argument("--output-lens", default="16,32",
                   help="max_tokens values, comma-separated (each request picks one)")
    p.add_argument("--token-range", default="100:5000",
                   help="prompt token ids are drawn uniformly from LO:HI")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=1800.0,
                   help="seconds to wait for a started server's ready line")
    p.add_argument("--peer-checkpoint", default=None,
                   help="with the transformers engine: its checkpoint directory (written from "
                        "--model's shape with random weights if it does not exist)")
    p.add_argument("--peer-arg", action="append", default=[],
                   help="one more flag for `transformers serve`, e.g. --peer-arg=--cb-num-blocks=4096")
    p.add_argument("--startup", type=int, default=0, metavar="N",
                   help="instead of a load: launch the server N times (the first fills the "
                        "caches) and time launch -> ready line -> an openai client's answer")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="after the rates: N streams (set N to the server's --max-slots: every "
                        "slot busy) of the first --prompt-lens length decode --busy-tokens "
                        "each; their tokens/s over --busy-seconds; then one ends and --probes "
                        "new requests arrive one at a time beside the N - 1 others (their "
                        "time to first token against the same request's on an idle server)")
    p.add_argument("--busy-tokens", type=int, default=4096,
                   help="max_tokens of each busy stream (prompt + this must fit --max-len)")
    p.add_argument("--busy-seconds", type=float, default=10.0,
                   help="the window over which every stream is counted")
    p.add_argument("--probes", type=int, default=5,
                   help="requests timed alone and then beside the busy streams")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny load: 3 requests at one rate, 16-token prompts, 8 new tokens")
    p.add_argument("--out", default="benchmarks/serve",
                   help="output path without extension (.json, .md, .png)")
    return p


def _floats(text):
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def check_args(parser, args):
    if args.smoke:
        args.rates, args.requests, args.prompt_lens, args.output_lens = "2", 3, "16", "8"
        args.max_seconds = min(args.max_seconds, 300.0)
    try:
        args.rate_list = _floats(args.rates)
        args.prompt_list = _ints(args.prompt_lens)
        args.output_list = _ints(args.output_lens)
        lo, hi = (int(x) for x in args.token_range.split(":"))
    except ValueError as e:
        parser.error(f"bad number in --rates/--prompt-lens/--output-lens/--token-range: {e}")
    if (not args.rate_list and not args.busy) or min(args.rate_list, default=1) <= 0:
        parser.error(f"--rates must be positive numbers, got {args.rates!r}")
    if not args.prompt_list or min(args.prompt_list) < 1:
        parser.error(f"--prompt-lens must be >= 1, got {args.prompt_lens!r}")
    if not args.output_list or min(args.output_list) < 1:
        parser.error(f"--output-lens must be >= 1, got {args.output_lens!r}")
    if not 0 <= lo < hi:
        parser.error(f"--token-range must be LO:HI with 0 <= LO < HI, got {args.token_range!r}")
    args.token_lo, args.token_hi = lo, hi
    if args.requests < 1 or args.max_seconds <= 0:
        parser.error("--requests must be >= 1 and --max-seconds > 0")
    if args.busy < 0 or args.busy_tokens < 1 or args.busy_seconds <= 0 or args.probes < 1:
        parser.error("--busy must be >= 0, --busy-tokens and --probes >= 1, --busy-seconds > 0")
    if args.url:
        host = urllib.parse.urlparse(args.url).hostname
        if host not in LOCAL_HOSTS:
            parser.error(f"--url must point to 127.0.0.1 (this load stays local), got {host!r}")
        args.engine_list = [args.label]
    else:
        args.engine_list = [e for e in args.engines.split(",") if e]
        bad = [e for e in args.engine_list if e not in ("sfi", "dense", "exact", "transformers")]
        if bad or not args.engine_list:
            parser.error(f"--engines takes sfi, dense, exact and transformers, got {args.engines!r}")
        if "transformers" in args.engine_list and not args.peer_checkpoint:
            parser.error("the transformers engine needs --peer-checkpoint DIR")


# --- one server per engine -------------------------------------------------------------------

def start_server(args, mode):
    """`python -m sfi_jax.serve` on a free port of 127.0.0.1; (process, base URL, seconds from
    the launch to its ready line)."""
    launched = time.monotonic()
    cmd = [sys.executable, "-m", "sfi_jax.serve", "--model", args.model, "--mode", mode,
           "--host", "127.0.0.1", "--port", "0", "--served-model-name", mode,
           *args.server_arg]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT + os.pathsep +
                                 os.environ.get("PYTHONPATH", "")})
    deadline = time.monotonic() + args.start_timeout
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the {mode} server exited with status {proc.returncode}")
        if sel.select(timeout=1.0):
            line = proc.stdout.readline()
            m = re.search(r"serving .* on (http://\S+)", line)
            if m:
                return proc, m.group(1), time.monotonic() - launched
    proc.kill()
    raise SystemExit(f"error: the {mode} server was not ready in {args.start_timeout} s")


def write_peer_checkpoint(preset, directory):
    """Random bf16 weights of `preset`'s shape, saved by transformers, with a word-level tokenizer
    of the same vocabulary ("t<id>" is token <id>)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

    from sfi_jax.models.config import PRESETS

    c = PRESETS[preset]
    config = Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_q_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
        rope_scaling=dict(c.rope_scaling) if c.rope_scaling else None, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids), dtype="bfloat16")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(c.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0",
                            eos_token=f"t{c.eos_token_ids[0]}").save_pretrained(directory)
    del model


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_peer(args):
    """`transformers serve` with continuous batching on 127.0.0.1; (process, base URL)."""
    import httpx

    if not os.path.exists(os.path.join(args.peer_checkpoint, "config.json")):
        t = time.perf_counter()
        write_peer_checkpoint(args.model, args.peer_checkpoint)
        print(f"wrote the peer checkpoint in {time.perf_counter() - t:.1f} s", flush=True)
    port = _free_port()
    cmd = [sys.executable, "-c", "from transformers.cli.transformers import main; main()",
           "serve", args.peer_checkpoint, "--continuous-batching", "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", *args.peer_arg]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: transformers serve exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise SystemExit(f"error: transformers serve was not ready in {args.start_timeout} s")


def stop_server(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- the load --------------------------------------------------------------------------------

async def one_request(client, url, model, prompt, max_tokens, t0, as_text=False, rec=None):
    """Stream one completion; its timings (seconds from t0) and token counts, in `rec` (a dict
    the caller may pass to watch the stream as it goes). With `as_text` (the peer) the prompt
    goes as the text "t<id> t<id> ..." and each streamed "t" counts one token (its usage comes
    only at the end)."""
    rec = {} if rec is None else rec
    rec.update({"prompt_tokens": len(prompt), "max_tokens": max_tokens,
                "sent": time.perf_counter() - t0, "chunks": [], "completion_tokens": 0,
                "status": None, "error": None})
    body = {"prompt": " ".join(f"t{i}" for i in prompt) if as_text else prompt,
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if model is not None:
        body["model"] = model
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = (await r.aread()).decode(errors="replace")[:300]
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec["error"] = event["error"].get("message")
                    break
                if as_text:
                    text = "".join(c.get("text") or "" for c in event.get("choices") or [])
                    n = rec["completion_tokens"] + text.count("t")
                else:
                    n = (event.get("usage") or {}).get("completion_tokens",
                                                       rec["completion_tokens"])
                if n > rec["completion_tokens"]:
                    rec["chunks"].append((time.perf_counter() - t0, n - rec["completion_tokens"]))
                    rec["completion_tokens"] = n
        rec["done"] = time.perf_counter() - t0
    except asyncio.CancelledError:
        rec["error"] = "unfinished: the rate's time ran out"
    except Exception as e:  # httpx errors: the request failed, the load goes on
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


async def run_rate(args, url, model, rate, rng, as_text=False):
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for _ in range(args.requests):
            n = rng.choice(args.prompt_list)
            prompt = [rng.randrange(args.token_lo, args.token_hi) for _ in range(n)]
            tasks.append(asyncio.create_task(one_request(
                client, url, model, prompt, rng.choice(args.output_list), t0, as_text)))
            await asyncio.sleep(rng.expovariate(rate))
            if time.perf_counter() - t0 > args.max_seconds:
                break
        left = max(0.0, args.max_seconds - (time.perf_counter() - t0))
        done, pending = await asyncio.wait(tasks, timeout=left)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return [t.result() for t in tasks]


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    i = (len(xs) - 1) * q / 100
    lo = int(i)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def summarise(records, rate):
    ok = [r for r in records if r["error"] is None and r["status"] == 200]
    ttft = [r["chunks"][0][0] - r["sent"] for r in ok if r["chunks"]]
    itl = []
    for r in ok:
        for (t_prev, _), (t, k) in zip(r["chunks"], r["chunks"][1:]):
            itl += [(t - t_prev) / k] * k
    tokens = sum(r["completion_tokens"] for r in ok)
    span = (max(r["done"] for r in ok) - min(r["sent"] for r in records)) if ok else 0.0
    return {"rate": rate, "requests": len(records), "completed": len(ok),
            "rejected_429": sum(r["status"] == 429 for r in records),
            "failed": len(records) - len(ok), "output_tokens": tokens,
            "output_tokens_per_s": tokens / span if span > 0 else 0.0,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "e2e_p50_s": percentile([r["done"] - r["sent"] for r in ok], 50)}


def run_engine(args, url, model, label):
    rng = random.Random(args.seed)
    rows, raw = [], []
    for rate in args.rate_list:
        records = asyncio.run(run_rate(args, url, model, rate, rng, as_text=label == "transformers"))
        rows.append(summarise(records, rate))
        raw.append({"rate": rate, "records": records})
        print(json.dumps({"engine": label, **rows[-1]}), flush=True)
    busy = None
    if args.busy:
        busy = asyncio.run(run_busy(args, url, model, rng, as_text=label == "transformers"))
        print(json.dumps({"engine": label, "busy": {k: v for k, v in busy.items()
                                                    if k != "records"}}), flush=True)
    return rows, raw, busy


async def run_busy(args, url, model, rng, as_text=False):
    """Probes alone (the prefill time of a prompt on an idle server), then args.busy streams
    at once: tokens/s over a window in which every stream decodes, then one stream ends and the
    probes arrive one at a time beside the others. Every request is bounded: the streams are
    cancelled (their connections closed) at the end."""
    import httpx

    n_prompt = args.prompt_list[0]

    def prompt():
        return [rng.randrange(args.token_lo, args.token_hi) for _ in range(n_prompt)]

    def ttft(rec):
        return rec["chunks"][0][0] - rec["sent"] if rec["error"] is None and rec["chunks"] \
            else None

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        t0 = time.perf_counter()
        alone = [await one_request(client, url, model, prompt(), 1, t0, as_text)
                 for _ in range(args.probes + 1)]  # the first may compile: not counted
        recs = [{} for _ in range(args.busy)]  # filled as the streams go
        streams = [asyncio.create_task(one_request(client, url, model, prompt(),
                                                   args.busy_tokens, t0, as_text, rec))
                   for rec in recs]
        deadline = time.perf_counter() + args.max_seconds
        # until every stream has its first token: then all its slots decode
        while time.perf_counter() < deadline and not all(t.done() for t in streams):
            if all(r.get("chunks") for r in recs):
                break
            await asyncio.sleep(0.2)
        started = time.perf_counter() - t0
        await asyncio.sleep(args.busy_seconds)
        ended = time.perf_counter() - t0
        beside = []
        if streams:
            streams[0].cancel()  # its slot frees: the probes have one
            await asyncio.sleep(1.0)
            for _ in range(args.probes):
                beside.append(await one_request(client, url, model, prompt(), 1, t0, as_text))
        for t in streams:
            t.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    in_window = sum(k for r in recs for t, k in r["chunks"] if started <= t <= ended)
    t_alone = [x for x in map(ttft, alone[1:]) if x is not None]
    t_beside = [x for x in map(ttft, beside) if x is not None]
    return {"streams": args.busy, "prompt_tokens": n_prompt, "window_s": ended - started,
            "busy_tokens_per_s": in_window / max(ended - started, 1e-9),
            "all_streams_started": all(r["chunks"] and r["chunks"][0][0] <= started
                                       for r in recs),
            "ttft_alone_s": t_alone, "ttft_beside_s": t_beside,
            "ttft_alone_p50_s": percentile(t_alone, 50),
            "ttft_beside_p50_s": percentile(t_beside, 50),
            "ttft_beside_p99_s": percentile(t_beside, 99),
            "probes_failed": args.probes - len(t_alone) + len(beside) - len(t_beside),
            "records": {"alone": alone, "beside": beside, "streams": recs}}


# --- the report ------------------------------------------------------------------------------

def _fmt(x, scale=1.0, digits=1):
    return "-" if x is None else f"{x * scale:.{digits}f}"


def markdown(report):
    c = report["config"]
    lines = [f"# Serving: {c['model']}, Poisson arrivals", "",
             f"Command: `{report['command']}`  ", f"Machine: {report['machine']}  ",
             f"Prompts {c['prompt_lens']} tokens (random ids), outputs {c['output_lens']} "
             f"tokens, {c['requests']} requests per rate at most, {c['max_seconds']} s per rate "
             "at most. ITL: a chunk of k tokens after a gap g counts k samples of g/k.", "",
             "| engine | rate (req/s) | done/sent | 429 | output tok/s | TTFT p50 (s) | "
             "TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for engine, rows in report["results"].items():
        for r in rows:
            lines.append(f"| {engine} | {r['rate']:g} | {r['completed']}/{r['requests']} | "
                         f"{r['rejected_429']} | {r['output_tokens_per_s']:.1f} | "
                         f"{_fmt(r['ttft_p50_s'], digits=2)} | {_fmt(r['ttft_p99_s'], digits=2)} | "
                         f"{_fmt(r['itl_p50_s'], 1e3)} | {_fmt(r['itl_p99_s'], 1e3)} |")
    if report.get("busy"):
        lines += ["", "Busy slots: the streams decode at once (each has its first token) for "
                  f"{c.get('busy_seconds')} s; tokens/s counts every stream's tokens in that "
                  "window. Then one stream ends and each probe (the same prompt length, 1 new "
                  "token) arrives alone beside the others; 'alone' is the same probe on the "
                  "idle server before the streams (its prefill time).", "",
                  "| engine | streams | prompt tokens | busy tok/s | TTFT alone p50 (s) | "
                  "TTFT beside p50 (s) | TTFT beside p99 (s) | p99 - alone (s) | failed |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for engine, b in report["busy"].items():
            extra = None if b["ttft_beside_p99_s"] is None or b["ttft_alone_p50_s"] is None \
                else b["ttft_beside_p99_s"] - b["ttft_alone_p50_s"]
            lines.append(f"| {engine} | {b['streams']} | {b['prompt_tokens']} | "
                         f"{b['busy_tokens_per_s']:.1f} | {_fmt(b['ttft_alone_p50_s'], digits=2)} | "
                         f"{_fmt(b['ttft_beside_p50_s'], digits=2)} | "
                         f"{_fmt(b['ttft_beside_p99_s'], digits=2)} | {_fmt(extra, digits=2)} | "
                         f"{b['probes_failed']} |")
    if "transformers" in report["results"]:
        lines += ["", "transformers: `transformers serve --continuous-batching` (paged attention, "
                  "bf16) on the same GPU, the same requests as text; "
                  f"extra flags {report['config'].get('peer_args') or 'none'}."]
    lines.append("")
    return "\n".join(lines)


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for engine, rows in report["results"].items():
        pts = [r for r in rows if r["itl_p99_s"] is not None]
        x = [r["output_tokens_per_s"] for r in pts]
        axes[0].plot(x, [r["itl_p99_s"] * 1e3 for r in pts], "o-", label=engine)
        axes[1].plot(x, [r["ttft_p99_s"] for r in pts], "o-", label=engine)
        for r in pts:
            axes[0].annotate(f"{r['rate']:g}/s", (r["output_tokens_per_s"], r["itl_p99_s"] * 1e3),
                             fontsize=7, textcoords="offset points", xytext=(3, 3))
    axes[0].set(xlabel="output tokens/s", ylabel="inter-token latency p99 (ms)")
    axes[1].set(xlabel="output tokens/s", ylabel="time to first token p99 (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['config']['model']}: latency against throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine():
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.split("\n")
        gpus = [g for g in gpus if g.strip()]
    except (OSError, subprocess.SubprocessError):
        gpus = []
    where = f"{len(gpus)} x {gpus[0]}" if gpus else f"CPU ({os.cpu_count()} cores)"
    return f"{where}, {platform.node()}, Python {platform.python_version()}"


def startup(args, argv):
    """Launch the server args.startup times: seconds to its ready line and to the first answer
    of an `openai` client request (the first launch fills the compilation and weight caches)."""
    import openai

    runs = []
    for i in range(args.startup):
        launched = time.monotonic()
        proc, url, ready_s = start_server(args, args.engine_list[0])
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600)
            answer = client.completions.create(model=args.engine_list[0], max_tokens=8,
                                               prompt="The capital of France is",
                                               temperature=0)
            answer_s = time.monotonic() - launched
            t = time.monotonic()
            client.completions.create(model=args.engine_list[0], max_tokens=8, temperature=0,
                                      prompt="The capital of Italy is")
            again_s = time.monotonic() - t
        finally:
            stop_server(proc)
        runs.append({"launch": i, "ready_s": round(ready_s, 2), "answer_s": round(answer_s, 2),
                     "next_answer_s": round(again_s, 2), "text": answer.choices[0].text})
        print(json.dumps(runs[-1]), flush=True)
    report = {"command": "python scripts/bench/bench_serve.py " + " ".join(
                  argv if argv is not None else sys.argv[1:]),
              "machine": machine(), "model": args.model, "server_args": args.server_arg,
              "runs": runs}
    lines = [f"# Server start to first answer: {args.model}", "",
             f"Command: `{report['command']}`  ", f"Machine: {report['machine']}  ",
             "Seconds from launching `python -m sfi_jax.serve` to its ready line and to the "
             "answer of an `openai` client completion (8 tokens, greedy); then the time of a second "
             "such request. Launch 0 fills the caches; the others start warm.", "",
             "| launch | ready (s) | first answer (s) | next request (s) |", "|---|---|---|---|"]
    lines += [f"| {r['launch']} | {r['ready_s']:.2f} | {r['answer_s']:.2f} | "
              f"{r['next_answer_s']:.2f} |" for r in runs]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}.json, .md")
    return report


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.startup:
        return startup(args, argv)
    results, raw, busy = {}, {}, {}
    for engine in args.engine_list:
        proc = None
        if args.url:
            url, model = args.url.rstrip("/"), None
        elif engine == "transformers":
            proc, url = start_peer(args)
            model = None
        else:
            proc, url, _ = start_server(args, engine)
            model = engine
        try:
            results[engine], raw[engine], busy[engine] = run_engine(args, url, model, engine)
        finally:
            if proc is not None:
                stop_server(proc)
    report = {
        "command": "python scripts/bench/bench_serve.py " + " ".join(argv if argv is not None
                                                                      else sys.argv[1:]),
        "machine": machine(),
        "config": {"model": args.model if not args.url else args.url,
                   "prompt_lens": args.prompt_list, "output_lens": args.output_list,
                   "rates": args.rate_list, "requests": args.requests,
                   "max_seconds": args.max_seconds, "server_args": args.server_arg,
                   "seed": args.seed, "peer_args": args.peer_arg, "busy": args.busy,
                   "busy_tokens": args.busy_tokens, "busy_seconds": args.busy_seconds,
                   "probes": args.probes},
        "results": results,
        "busy": {e: b for e, b in busy.items() if b is not None},
        "raw": raw,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(report))
    plot(report, args.out + ".png")
    print(f"wrote {args.out}.json, .md, .png")
    return report


if __name__ == "__main__":
    main()
