"""Checkpoint load time: `sfi_jax.load_model` against transformers' `from_pretrained`.

Writes a random-weight Hugging Face checkpoint of a preset's shape with transformers
(`save_pretrained`, safetensors, sharded as the hub's: --max-shard-size), or reuses --dir, then
times, each run in a fresh process with its device already started:
  sfi_jax: load_model(dir) until every weight is ready (block_until_ready);
  transformers: AutoModelForCausalLM.from_pretrained(dir, dtype=bfloat16, device_map=cuda or
  cpu) until the device is idle (torch.cuda.synchronize).
The runs alternate between the two (the files stay in the page cache; --cold evicts them
before each library's first run, where the OS allows it). Both models then score one random
prompt after their last load: the same greedy next token (or a near tie) and the logits'
relative difference.

    python scripts/bench/bench_load.py --preset qwen3-0.6b --out /tmp/load      # CPU
    python scripts/bench/bench_load.py --preset qwen3-4b --out /tmp/load         # H200

--out PREFIX writes PREFIX.json and PREFIX.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROMPT_LEN = 16


def hf_config(preset: str, layers: int | None):
    """transformers' Qwen3Config of an sfi_jax dense Qwen3 preset."""
    import transformers

    from sfi_jax.models.config import PRESETS

    if preset not in PRESETS or not preset.startswith("qwen3") or PRESETS[preset].is_moe:
        dense = [p for p in PRESETS if p.startswith("qwen3") and not PRESETS[p].is_moe]
        raise SystemExit(f"--preset {preset!r}: choose a dense Qwen3 preset ({', '.join(dense)})")
    c = PRESETS[preset]
    return transformers.Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=layers or c.num_layers, num_attention_heads=c.num_q_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def write_checkpoint(preset: str, layers: int | None, directory: str, max_shard_size: str):
    """A random bf16 model of the preset's shape, built on the GPU when there is one."""
    import torch
    import transformers

    t0 = time.perf_counter()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(preset, layers),
                                                              dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    del model
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in files)
    return {"files": files, "bytes": size, "write_s": time.perf_counter() - t0}


def evict(directory: str) -> bool:
    """Drop the checkpoint's files from the page cache (False where the OS ignores it)."""
    ok = True
    for f in os.listdir(directory):
        try:
            fd = os.open(os.path.join(directory, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            ok = False
    return ok


# ----------------------------------------------------------------------------- workers

def _prompt(vocab: int):
    import numpy as np

    return np.random.default_rng(1).integers(0, vocab, (1, PROMPT_LEN))


def worker_sfi(directory: str, logits_path: str) -> dict:
    sys.path.insert(0, ROOT)
    import jax
    import numpy as np

    import sfi_jax

    jax.block_until_ready(jax.numpy.zeros(1) + 1)  # the backend started
    t0, c0 = time.perf_counter(), time.process_time()
    model = sfi_jax.load_model(directory)
    jax.block_until_ready(jax.tree.leaves(model.params))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if logits_path:
        logits = np.asarray(sfi_jax.forward(model, _prompt(model.config.vocab_size)))[0, -1]
        np.save(logits_path, logits)
    return {"seconds": seconds, "cpu_s": cpu, "device": str(jax.devices()[0].device_kind),
            "layers_split": model.layers_split}


def worker_hf(directory: str, logits_path: str) -> dict:
    import numpy as np
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    if cuda:
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.bfloat16, device_map="cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if logits_path:
        ids = torch.as_tensor(_prompt(model.config.vocab_size), device=model.device)
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float().cpu().numpy()
        np.save(logits_path, logits)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    return {"seconds": seconds, "cpu_s": cpu, "device": device}


def run_worker(which: str, directory: str, tmp: str, score: bool) -> dict:
    """One timed load in a fresh process; `score`: also the prompt's last logits."""
    logits = os.path.join(tmp, f"{which}_logits.npy") if score else None
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", which,
                           "--dir", directory] + (["--logits", logits] if score else []),
                          capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"the {which} worker failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    out["logits"] = logits
    return out


# ----------------------------------------------------------------------------- main

def compare(sfi_logits: str, hf_logits: str) -> dict:
    import numpy as np

    a, b = np.load(sfi_logits).astype(np.float64), np.load(hf_logits).astype(np.float64)
    top_a, top_b = int(a.argmax()), int(b.argmax())
    # a near tie: transformers' top token within bf16 noise of ours in our logits
    gap = float(a[top_a] - a[top_b])
    return {"sfi_next_token": top_a, "hf_next_token": top_b, "same_token": top_a == top_b,
            "our_logit_gap_to_hf_token": gap,
            "near_tie": top_a != top_b and gap <= 2e-2 * float(np.abs(a).max()),
            "logits_rel_diff": float(np.linalg.norm(a - b) / np.linalg.norm(b))}


def summary(runs: list[float], cpu: list[float]) -> dict:
    """Wall seconds (and the process's CPU seconds, steadier on a shared machine)."""
    return {"first_s": runs[0], "min_s": min(runs), "median_s": statistics.median(runs),
            "runs_s": runs, "cpu_min_s": min(cpu), "cpu_runs_s": cpu}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b", help="a dense Qwen3 preset")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the preset")
    ap.add_argument("--dir", default=None, help="checkpoint directory: reused when it holds "
                    "one, else written there (default: a temporary directory)")
    ap.add_argument("--max-shard-size", default="4GB", help="save_pretrained's shard size")
    ap.add_argument("--repeats", type=int, default=3, help="runs per library")
    ap.add_argument("--only", choices=("sfi", "hf"), default=None, help="time one library")
    ap.add_argument("--cold", action="store_true",
                    help="evict the files from the page cache before each library's first run")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--worker", choices=("sfi", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--logits", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        fn = worker_sfi if args.worker == "sfi" else worker_hf
        print("RESULT " + json.dumps(fn(args.dir, args.logits)), flush=True)
        return
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    sys.path.insert(0, ROOT)
    with tempfile.TemporaryDirectory(prefix="bench_load_") as tmp:
        directory = args.dir or os.path.join(tmp, "ckpt")
        os.makedirs(directory, exist_ok=True)
        if os.path.exists(os.path.join(directory, "config.json")):
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            written = {"files": files, "reused": True,
                       "bytes": sum(os.path.getsize(os.path.join(directory, f)) for f in files)}
        else:
            written = write_checkpoint(args.preset, args.layers, directory, args.max_shard_size)
        print(f"checkpoint {directory}: {len(written['files'])} files, "
              f"{written['bytes'] / 1e9:.2f} GB", flush=True)
        which = [args.only] if args.only else ["sfi", "hf"]
        times = {w: [] for w in which}
        cpu = {w: [] for w in which}
        last = {}
        evicted = None
        for r in range(args.repeats):
            for w in which:
                if args.cold and r == 0:
                    evicted = evict(directory)
                last[w] = run_worker(w, directory, tmp, score=r == args.repeats - 1)
                times[w].append(last[w]["seconds"])
                cpu[w].append(last[w]["cpu_s"])
                print(f"run {r + 1} {w}: {last[w]['seconds']:.2f} s "
                      f"(CPU {last[w]['cpu_s']:.2f} s)", flush=True)
        result = {"preset": args.preset, "layers": args.layers, "checkpoint": written,
                  "device": next(iter(last.values()))["device"],
                  "first_run_cold": bool(args.cold and evicted), **{w: summary(times[w], cpu[w])
                                                                    for w in which}}
        if len(which) == 2:
            result["ratio_min"] = result["sfi"]["min_s"] / result["hf"]["min_s"]
            result["ratio_median"] = result["sfi"]["median_s"] / result["hf"]["median_s"]
            result["check"] = compare(last["sfi"]["logits"], last["hf"]["logits"])
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out + ".json", "w") as f:
            f.write(text + "\n")
        with open(args.out + ".md", "w") as f:
            f.write(markdown(result))


def markdown(r: dict) -> str:
    layers = f" ({r['layers']} layers)" if r["layers"] else ""
    cached = "after evicting the page cache" if r["first_run_cold"] else "with the files cached"
    lines = [f"Load time, {r['preset']}{layers}, "
             f"{r['checkpoint']['bytes'] / 1e9:.2f} GB in {len(r['checkpoint']['files'])} "
             f"safetensors files, on {r['device']}; first run "
             f"{cached}.",
             "", "| loader | first (s) | min (s) | median (s) | runs (s) | process CPU, min (s) |",
             "|---|---|---|---|---|---|"]
    for w, name in (("sfi", "sfi_jax.load_model"), ("hf", "transformers from_pretrained")):
        if w in r:
            s = r[w]
            lines.append(f"| {name} | {s['first_s']:.2f} | {s['min_s']:.2f} | "
                         f"{s['median_s']:.2f} | {', '.join(f'{t:.2f}' for t in s['runs_s'])} | "
                         f"{s['cpu_min_s']:.2f} |")
    if "check" in r:
        c = r["check"]
        verdict = "same" if c["same_token"] else "near tie" if c["near_tie"] else "DIFFERENT"
        lines += ["", f"sfi_jax / transformers: {r['ratio_min']:.2f}x (min), "
                      f"{r['ratio_median']:.2f}x (median). Next token: sfi_jax "
                      f"{c['sfi_next_token']}, transformers {c['hf_next_token']} "
                      f"({verdict}); "
                      f"logits relative difference {c['logits_rel_diff']:.3g}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
