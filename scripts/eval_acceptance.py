"""Exact mode's acceptance on the embedded SmolLM2-135M: how many drafted tokens the dense verify
step accepts, by retention, by draft_len, with successor_radius on and off, and with the
equal-budget baselines as the draft (streaming = StreamingLLM-style, prefill_only = SnapKV-like,
oracle = the ceiling), on the natural text and budgets of scripts/eval_quality.py.

Writes acceptance.json and acceptance.md into --out.

    python scripts/eval_acceptance.py                 # the committed run (see --help)
    python scripts/eval_acceptance.py --smoke         # tiny sizes, a check that it runs

Greedy decoding; every exact-mode row is also checked against dense decoding's tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval_quality import _machine, budget_config  # noqa: E402

BASELINES = ("streaming", "prefill_only", "oracle")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048])
    p.add_argument("--samples", type=int, default=4, help="text windows (rows) per context")
    p.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per row")
    p.add_argument("--retention", type=float, nargs="+", default=[0.05, 0.15, 0.30])
    p.add_argument("--ref-retention", type=float, default=0.15,
                   help="retention of the draft_len and successor_radius sweeps")
    p.add_argument("--draft-lens", type=int, nargs="+", default=[1, 2, 3, 5, 7])
    p.add_argument("--draft-len", type=int, default=3, help="draft_len of the other sweeps")
    p.add_argument("--successor-radius", type=int, default=7)
    p.add_argument("--policies", nargs="+", default=["sfi", *BASELINES])
    p.add_argument("--t-max", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="one short context, two configs")
    p.add_argument("--out", default="benchmarks")
    return p.parse_args(argv)


def configs(args):
    """(sweep, policy, retention, SFIConfig) for every run."""
    out = []
    for r in args.retention:
        for pol in args.policies:
            # every round drafts draft_len tokens: the acceptance of the draft policy itself
            cfg = dataclasses.replace(budget_config(pol, r, args.context, args.t_max),
                                      draft_len=args.draft_len, adaptive_draft=False)
            out.append(("retention", pol, r, cfg))
    ref = dataclasses.replace(budget_config("sfi", args.ref_retention, args.context, args.t_max),
                              adaptive_draft=False)
    for d in args.draft_lens:
        if d != args.draft_len:
            out.append(("draft_len", "sfi", args.ref_retention,
                        dataclasses.replace(ref, draft_len=d)))
    if args.successor_radius:
        out.append(("successor_radius", "sfi", args.ref_retention, dataclasses.replace(
            ref, draft_len=args.draft_len, successor_radius=args.successor_radius)))
    return out


def run_context(model, tok, text, args, context, log, save):
    import sfi_jax

    args.context = context
    rng = random.Random(f"acc-{context}-{args.seed}")
    P = context - args.new_tokens
    prompts = [text.window(rng.randrange(len(text.starts) - 2000), P)
               for _ in range(args.samples)]
    kw = dict(max_new_tokens=args.new_tokens, stop_at_eos=False, tokenizer=tok)
    dense = sfi_jax.generate(model, prompts, mode="dense", **kw)
    rows = []
    out = {"prompt_tokens": P, "new_tokens": args.new_tokens, "rows": len(prompts),
           "results": rows}
    for sweep, pol, r, cfg in configs(args):
        t0 = time.perf_counter()
        res = sfi_jax.generate(model, prompts, mode="exact", sfi=cfg, **kw)
        s = res.stats
        drafted, accepted = sum(s["drafted"]), sum(s["accepted"])
        verify = sum(s["verify_steps"])
        same = sum(a == b for a, b in zip(res.tokens, dense.tokens))
        row = {"sweep": sweep, "policy": pol, "retention": r, "budget": cfg.budget,
               "k_select": cfg.k_select, "n_recent": cfg.n_recent, "draft_len": cfg.draft_len,
               "successor_radius": cfg.successor_radius, "drafted": drafted,
               "accepted": accepted, "verify_steps": verify,
               "acceptance_rate": accepted / drafted if drafted else None,
               "mean_accepted_length": accepted / verify if verify else None,
               "tokens_per_verify": (accepted + verify) / verify if verify else None,
               "slow_steps": sum(s["slow_steps"]), "rows_equal_dense": same,
               "rows": len(prompts), "wall_s": time.perf_counter() - t0}
        rows.append(row)
        log(f"{context} {sweep:16s} {pol:12s} r={r:.2f} d={cfg.draft_len} "
            f"succ={cfg.successor_radius}: accept {row['acceptance_rate']:.3f}, "
            f"len {row['mean_accepted_length']:.2f}, equal {same}/{len(prompts)} "
            f"({row['wall_s']:.0f}s)")
        save(out)  # partial results survive an interruption
    return out


def speedup_model(a, d, cost_fast=3.7 / 29.3, cost_verify=1.0):
    """Tokens per dense-step time of exact mode with acceptance rate a per draft token
    (independent draws), draft_len d: E[tokens per round] = (1 - a^(d+1)) / (1 - a); a round
    costs d fast steps + one verify (in dense-step units; H200 qwen3-4b B6/128K figures)."""
    tokens = (1 - a ** (d + 1)) / (1 - a) if a < 1 else d + 1
    return tokens / (d * cost_fast + cost_verify)


def write_markdown(res, path):
    lines = ["# Exact mode: acceptance of SFI drafts (SmolLM2-135M, CPU)", "",
             f"Produced by `{res['meta']['command']}` on {res['meta']['date']} "
             f"({res['meta']['machine']['cpu_count']} CPU cores, jax "
             f"{res['meta']['machine']['jax']}), {res['meta']['wall_s']:.0f} s.", "",
             "Greedy decoding of natural text (the text of `scripts/eval_quality.py`); budgets "
             "as there (retention = budget / context). acceptance = accepted / drafted draft "
             "tokens; mean accepted length = accepted drafts per verify step; tokens per "
             "verify adds the verify's own token. `equal` counts rows whose tokens equal dense "
             "decoding's. `model x` is the bytes-model speedup over dense decoding from that "
             "acceptance (i.i.d. acceptance; fast step 3.7 ms, verify = dense step 29.3 ms: "
             "qwen3-4b, batch 6, 128K on the H200).", ""]
    for ctx, c in res["contexts"].items():
        lines += [f"## context {ctx} ({c['rows']} rows x {c['new_tokens']} new tokens)", ""]
        for sweep, title in (("retention", "by retention and draft policy"),
                             ("draft_len", "SFI by draft_len"),
                             ("successor_radius", "SFI with successor_radius")):
            rows = [r for r in c["results"] if r["sweep"] == sweep]
            if sweep == "draft_len":  # the sweep's reference point lives in the first table
                rows = sorted(rows + [r for r in c["results"] if r["sweep"] == "retention"
                                      and r["policy"] == "sfi" and
                                      abs(r["retention"] - res["meta"]["args"]["ref_retention"])
                                      < 1e-9], key=lambda r: r["draft_len"])
            if sweep == "successor_radius":
                rows = rows + [r for r in c["results"] if r["sweep"] == "retention"
                               and r["policy"] == "sfi"]
                rows.sort(key=lambda r: (r["retention"], r["successor_radius"]))
            if not rows:
                continue
            lines += [f"### {title}", "",
                      "| draft | retention | budget | draft_len | successor_radius | "
                      "acceptance | mean accepted length | tokens per verify | model x | "
                      "equal |", "|---|---|---|---|---|---|---|---|---|---|"]
            for r in rows:
                a = r["acceptance_rate"] or 0.0
                lines.append(
                    f"| {r['policy']} | {r['retention']:.0%} | {r['budget']} | {r['draft_len']} "
                    f"| {r['successor_radius']} | {a:.3f} | {r['mean_accepted_length']:.2f} | "
                    f"{r['tokens_per_verify']:.2f} | {speedup_model(a, r['draft_len']):.2f} | "
                    f"{r['rows_equal_dense']}/{r['rows']} |")
            lines.append("")
    lines += ["## Defaults", "", res.get("defaults", ""), ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        args.contexts, args.samples, args.new_tokens = [512], 2, 12
        args.retention, args.draft_lens, args.policies = [0.15], [2], ["sfi"]
        args.successor_radius = 0
    import sfi_jax
    from sfi_jax.eval.text import TokenText, load_text

    t_start = time.perf_counter()
    model = sfi_jax.load_model("smollm2-135m", dtype="float32")
    tok = sfi_jax.load_tokenizer("smollm2-135m")
    source = load_text()
    text = TokenText(source, tok, max_verses=4000)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    res = {"meta": {"command": "python scripts/eval_acceptance.py " + " ".join(
        argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(), "model": "SmolLM2-135M-Instruct (embedded GGUF)",
        "dtype": "float32", "args": vars(args), "text": source.name}, "contexts": {}}
    os.makedirs(args.out, exist_ok=True)
    name = "acceptance_smoke" if args.smoke else "acceptance"

    def save(ctx_result):
        res["contexts"][str(ctx)] = ctx_result
        res["meta"]["wall_s"] = time.perf_counter() - t_start
        res["meta"]["args"] = {k: v for k, v in vars(args).items() if k != "context"}
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump(res, f, indent=1)
        write_markdown(res, os.path.join(args.out, name + ".md"))

    for ctx in args.contexts:
        save(run_context(model, tok, text, args, ctx, log, save))
    return res


if __name__ == "__main__":
    main()
