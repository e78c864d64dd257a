"""CPU timings on the embedded SmolLM2-135M (float32).

    python scripts/bench/bench_cpu.py --out benchmarks            # both parts
    python scripts/bench/bench_cpu.py --part dense --smoke        # quick check

Part "dense": decode tokens/s of sfi_jax (dense mode) against transformers' `generate` on the
same CPU, same model (the same GGUF file), same prompts (512 and 2048 tokens), batch 1 and 8.
Decode time excludes prefill and compilation on both sides (transformers: generate(N) minus
generate(1); sfi_jax: stats["decode_s"], compile timed separately).
Part "sfi": the time of a fast step, a slow step and the selector alone at 4K and 8K context,
and the SFI state's memory next to the KV cache's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

# Both sides single-threaded: the comparison then does not depend on how the two libraries
# split work over cores, nor on other processes sharing a small machine.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                      "intra_op_parallelism_threads=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import sfi_jax  # noqa: E402
from sfi_jax.models.gguf_loader import embedded_gguf_path  # noqa: E402
from sfi_jax.runtime.state import state_bytes  # noqa: E402
from sfi_jax.selector import select  # noqa: E402


def prompt_ids(tok, n, seed=0):
    """n token ids of English-like text (the README and docs, repeated)."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    text = " ".join(open(os.path.join(here, p)).read() for p in
                    ("README.md", "docs/SFI_METHOD.md", "docs/DESIGN.md"))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ids = (ids * (n // len(ids) + 1))
    start = (seed * 997) % max(1, len(ids) - n)
    return ids[start:start + n]


def bench_dense(model, tok, lengths, batches, new_tokens, repeats):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path = embedded_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    rows = []
    for n in lengths:
        for b in batches:
            prompts = [prompt_ids(tok, n, seed=i) for i in range(b)]
            ours = []
            for _ in range(repeats + 1):
                r = sfi_jax.generate(model, prompts, max_new_tokens=new_tokens, mode="dense",
                                     stop_at_eos=False)
                ours.append(r.stats["decode_tokens_per_s"])
            x = torch.tensor(prompts)
            mask = torch.ones_like(x)

            def hf_time(k):
                t = time.perf_counter()
                with torch.no_grad():
                    hf.generate(x, attention_mask=mask, max_new_tokens=k, min_new_tokens=k,
                                do_sample=False)
                return time.perf_counter() - t

            hf_time(2)
            t1 = statistics.median(hf_time(1) for _ in range(repeats))
            tn = statistics.median(hf_time(new_tokens) for _ in range(repeats))
            theirs = b * (new_tokens - 1) / (tn - t1)
            rows.append(dict(prompt=n, batch=b, new_tokens=new_tokens,
                             sfi_jax_tok_s=statistics.median(ours[1:]),
                             transformers_tok_s=theirs,
                             ratio=statistics.median(ours[1:]) / theirs))
            print(rows[-1], flush=True)
    return rows


def bench_sfi(model, tok, contexts, new_tokens):
    cfg = model.config
    rows = []
    for ctx in contexts:
        prompt = [prompt_ids(tok, ctx)]
        row = dict(context=ctx)
        for label, sfi in (("fast", sfi_jax.SFIConfig(policy="prefill_only")),
                           ("slow", sfi_jax.SFIConfig(policy="oracle")),
                           ("dense", None)):
            times = []
            for _ in range(1):
                r = sfi_jax.generate(model, prompt, max_new_tokens=new_tokens,
                                     mode="dense" if sfi is None else "sfi", sfi=sfi,
                                     stop_at_eos=False)
                times.append(r.stats["decode_s"] / r.stats["decode_steps"])
            row[f"{label}_step_ms"] = 1e3 * min(times)
        sfi = sfi_jax.SFIConfig()
        G = cfg.num_q_heads // cfg.num_kv_heads
        key = jax.random.key(0)
        logits = jax.random.normal(key, (1, cfg.num_kv_heads, G, ctx), jnp.float32)
        norms = jax.random.uniform(key, (1, cfg.num_kv_heads, ctx)) + 0.5
        lo = jnp.array([sfi.n_sink], jnp.int32)
        hi = jnp.array([ctx - sfi.n_recent], jnp.int32)
        f = jax.jit(lambda a, b: select(a, b, lo, hi, sfi))
        f(logits, norms).block_until_ready()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            f(logits, norms).block_until_ready()
            ts.append(time.perf_counter() - t)
        row["selector_layer_ms"] = 1e3 * statistics.median(ts)
        row["selector_step_ms"] = row["selector_layer_ms"] * cfg.num_layers
        mem = state_bytes(cfg, 1, ctx + new_tokens, 4, sfi)
        row.update({f"bytes_{k}": v for k, v in mem.items()})
        rows.append(row)
        print(row, flush=True)
    return rows


def write_results(out, stem, header, rows, lines, machine, cmd):
    """`stem`.json (machine, command, rows) and `stem`.md (header lines, then `lines`)."""
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump({"machine": machine, "command": cmd, "results": rows}, f, indent=1)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write("\n".join([header, "", f"Machine: {machine}. Command: `{cmd}`.", ""] + lines)
                + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("dense", "sfi", "all"), default="all")
    p.add_argument("--out", default="benchmarks")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--contexts", default="4096,8000", help="contexts for the sfi part")
    args = p.parse_args(argv)
    model = sfi_jax.load_model("smollm2-135m", dtype="float32")
    tok = sfi_jax.load_tokenizer("smollm2-135m")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}"
    cmd = "python " + " ".join(sys.argv)
    os.makedirs(args.out, exist_ok=True)
    if args.part in ("dense", "all"):
        lengths, batches, n, reps = ([64], [1], 8, 1) if args.smoke else ([512, 2048], [1, 8], 32, 3)
        rows = bench_dense(model, tok, lengths, batches, n, reps)
        lines = ["Decode tokens/s over all rows, prefill and compilation excluded on both sides; "
                 "median of repeats. Both libraries single-threaded (torch.set_num_threads(1); "
                 "XLA CPU intra-op parallelism 1) on a shared machine.", "",
                 "| prompt | batch | sfi_jax tok/s | transformers tok/s | ratio |", "|---|---|---|---|---|"]
        lines += [f"| {r['prompt']} | {r['batch']} | {r['sfi_jax_tok_s']:.1f} | "
                  f"{r['transformers_tok_s']:.1f} | {r['ratio']:.2f}x |" for r in rows]
        write_results(args.out, "cpu_dense_vs_transformers",
                      "# Dense decode on CPU: sfi_jax vs transformers (SmolLM2-135M, float32)",
                      rows, lines, machine, cmd)
    if args.part in ("sfi", "all"):
        contexts, n = ([1024], 8) if args.smoke else ([int(c) for c in args.contexts.split(",")], 16)
        rows = bench_sfi(model, tok, contexts, n)
        lines = ["fast = policy prefill_only (no slow steps); slow = policy oracle (every step "
                 "a dense pass with logits + selector + repack + sparse attention); dense = "
                 "dense mode. Selector = one layer's selector for one row (3 KV heads x 3 query "
                 "rows), and x 30 layers. Memory in MiB for prompt + new tokens.", "",
                 "| context | fast step ms | slow step ms | dense step ms | selector ms/layer | "
                 "selector ms/step | KV cache MiB | SFI compact MiB | key norms MiB |",
                 "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['context']} | {r['fast_step_ms']:.1f} | {r['slow_step_ms']:.1f} | "
                  f"{r['dense_step_ms']:.1f} | {r['selector_layer_ms']:.2f} | "
                  f"{r['selector_step_ms']:.1f} | {r['bytes_kv_cache'] / 2**20:.1f} | "
                  f"{(r['bytes_sfi_compact'] + r['bytes_sfi_positions']) / 2**20:.1f} | "
                  f"{r['bytes_sfi_key_norms'] / 2**20:.1f} |" for r in rows]
        write_results(args.out, "cpu_sfi_steps",
                      "# SFI step costs on CPU (SmolLM2-135M, float32, batch 1)",
                      rows, lines, machine, cmd)

if __name__ == "__main__":
    main()
