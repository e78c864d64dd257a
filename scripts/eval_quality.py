"""Quality of SFI against dense decoding and equal-budget baselines, on the embedded SmolLM2-135M.

Writes benchmarks/quality.json, quality.md and quality_*.png. Parts:
  teacher-forced continuation of long natural text (KL, top-1, log-loss, attention coverage,
  by steps since the last slow step), the support-stability statistic, and retrieval tasks
  (passkey, needle-in-a-haystack single / multi-key / multi-value, variable tracking).

    python scripts/eval_quality.py                  # full run (see --help for the knobs)
    python scripts/eval_quality.py --smoke          # about a minute: tiny sizes
    python scripts/eval_quality.py --report run1.json run2.json   # merge partial runs

Every policy runs in the same runtime at the same KV budget per head (sink + selected +
recent); budgets are set as a retention (budget / context).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import sys
import time

from sfi_jax.eval.suite import budget_config

import numpy as np

POLICIES = ("sfi", "tmax", "prefill_only", "streaming", "oracle")
LABELS = {"sfi": "SFI", "tmax": "t_max refresh", "prefill_only": "prefill-only (SnapKV-like)",
          "streaming": "streaming (sink+recent)", "oracle": "oracle (dense top-k every step)"}
SINCE_BINS = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 10**9))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=("quality", "retrieval"), default="quality",
                   help="quality: teacher forcing, stability and the KJV retrieval tasks; "
                        "retrieval: the RULER-style suite (sfi_jax.eval.ruler), every arm at "
                        "equal budget, written to OUT/retrieval.json, .md and .png")
    p.add_argument("--arms", nargs="+", default=None,
                   help="retrieval suite: sparse arms (default: all of sfi_jax.eval.suite.ARMS)")
    p.add_argument("--sweep-arms", nargs="+", default=None,
                   help="retrieval suite: arms run at every retention (default: --arms); the "
                        "others run at --ref-retention only")
    p.add_argument("--rs-retention", type=float, nargs="+", default=[0.05, 0.10, 0.15, 0.25],
                   help="retrieval suite: retentions")
    p.add_argument("--no-exact", action="store_true",
                   help="retrieval suite: skip the exact-mode check (its tokens equal dense's)")
    p.add_argument("--rs-samples", type=int, default=50,
                   help="retrieval suite: samples per task and context")
    p.add_argument("--compile-cache", default=None,
                   help="a folder for JAX's persistent compilation cache (reruns skip compiles)")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192],
                   help="context lengths (prompt + continuation <= context)")
    p.add_argument("--retention", type=float, nargs="+", default=[0.05, 0.15, 0.30],
                   help="KV budget / context for every sparse policy")
    p.add_argument("--rt-retention", type=float, nargs="+", default=None,
                   help="retentions for the retrieval part (default: --retention)")
    p.add_argument("--ref-retention", type=float, default=0.15,
                   help="retention the targets and the stability statistic refer to")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--tf-samples", type=int, default=4, help="teacher-forced texts per context")
    p.add_argument("--tf-tokens", type=int, default=129,
                   help="teacher-forced continuation length (the first comes from the prefill)")
    p.add_argument("--tasks", nargs="+", default=None, help="retrieval tasks (default: all)")
    p.add_argument("--rt-samples", type=int, default=8, help="retrieval samples per task+context")
    p.add_argument("--rt-tokens", type=int, default=33,
                   help="tokens generated per retrieval sample (lead-in + answer)")
    p.add_argument("--chunk-steps", type=int, default=32,
                   help="decode steps per jitted chunk; teacher-forced and retrieval calls "
                        "share compiled chunks when (tokens - 1) is a multiple of it")
    p.add_argument("--model", default="smollm2-135m",
                   help="model source for load_model / load_tokenizer (e.g. a .gguf path)")
    p.add_argument("--dense-only", action="store_true",
                   help="retrieval with dense decoding only (checks which tasks the model solves)")
    p.add_argument("--min-dense-acc", type=float, default=0.5,
                   help="compare policies only on task+context cells where dense reaches this")
    p.add_argument("--t-max", type=int, default=64)
    p.add_argument("--set", nargs="+", default=None, metavar="FIELD=VALUE",
                   help="override SFIConfig fields of the selecting policies (an ablation; the "
                        "results are named e.g. 'sfi(alpha_soft=0)')")
    p.add_argument("--batch", type=int, default=4, help="rows per generate call")
    p.add_argument("--answer-modes", nargs="+", default=["onset"], choices=("onset", "lead_in"),
                   help="onset: the prompt ends with the lead-in (' ... The pass key is') and the "
                        "answer is generated at once; lead_in: the lead-in is fed through the "
                        "decoder first. The targets use onset")
    p.add_argument("--chat", action="store_true", help="retrieval prompts in the chat template")
    p.add_argument("--impl", default="auto", help="attention kernels: auto, xla, pallas_gpu, ...")
    p.add_argument("--no-tf", action="store_true", help="skip the teacher-forced part")
    p.add_argument("--no-retrieval", action="store_true", help="skip the retrieval part")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, about a minute on a CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks", help="folder for quality.json/.md/.png")
    p.add_argument("--json-only", default=None,
                   help="write only this JSON (a partial run, merged later with --report)")
    p.add_argument("--notes", default=None,
                   help="a Markdown file explaining the targets, embedded in the report")
    p.add_argument("--report", nargs="+", default=None,
                   help="merge these result JSONs and write the report; run nothing")
    a = p.parse_args(argv)
    if a.smoke and a.suite == "retrieval":
        a.contexts, a.rs_retention, a.rs_samples, a.batch = [1024], [0.15], 2, 2
        a.arms = a.arms or ["paper", "sfi+succ7"]
    elif a.smoke:
        a.contexts, a.retention, a.ref_retention = [1024], [0.15], 0.15
        a.tf_samples, a.tf_tokens, a.rt_samples = 2, 33, 2
        a.tasks = a.tasks or ["passkey"]
        a.batch = 2
    a.tasks = a.tasks or None
    return a


# ----------------------------------------------------------------------------- configs

def _overrides(args) -> dict:
    out = {}
    for item in args.set or []:
        key, _, value = item.partition("=")
        if value.lower() in ("none", "off"):  # an extension off, e.g. selection_memory=none
            out[key] = None
        else:
            out[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    return out


def _configs(args, context, retention=None):
    """(name, retention, SFIConfig) for every policy x retention; --set overrides SFIConfig
    fields of the selecting policies and names the variant, e.g. `sfi(alpha_soft=0)`."""
    sets = _overrides(args)
    tag = "(" + ",".join(args.set) + ")" if sets else ""
    out = []
    for r in retention or args.retention:
        for p in args.policies:
            cfg = budget_config(p, r, context, args.t_max)
            if sets and p != "streaming":
                cfg = dataclasses.replace(cfg, **sets)
            out.append((p + tag if p != "streaming" else p, r, cfg))
    return out


def _batches(items, n):
    for i in range(0, len(items), n):
        yield items[i:i + n]


# ----------------------------------------------------------------------------- teacher forcing

def _bin_since(since):
    return [int(np.searchsorted([b[1] for b in SINCE_BINS], s)) for s in since]


def _summ(x):
    x = np.asarray(x, np.float64)
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else None


def run_teacher_forced(model, tok, text, args, context, bar, log):
    """Teacher-forced continuation at one context: dense vs every policy x budget."""
    import sfi_jax
    from sfi_jax.eval import teacher_forced_metrics
    from sfi_jax.eval.prefill_cache import shared_prefill
    from sfi_jax.selector import trigger_token_ids

    N = args.tf_tokens
    P = context - N
    rng = random.Random(f"tf-{context}-{args.seed}")
    starts = [rng.randrange(len(text.starts) - 2000) for _ in range(args.tf_samples)]
    windows = [text.window(s, P + N) for s in starts]
    trig = np.zeros(model.config.vocab_size, bool)
    trig[trigger_token_ids(tok)] = True
    acc: dict = {}
    stab = {"within": [], "into_trigger": [], "after_trigger": []}
    for rows in _batches(windows, args.batch):
        prompts = [w[:P] for w in rows]
        targets = np.asarray([w[P:] for w in rows], np.int32)
        common = dict(max_new_tokens=N, forced_tokens=targets, return_logits=True,
                      stop_at_eos=False, tokenizer=tok, chunk_steps=args.chunk_steps,
                      max_len=context, impl=args.impl)
        with shared_prefill() as cache:
            common["prefill_fn"] = cache.prefill_fn
            t0 = time.perf_counter()
            dense = sfi_jax.generate(model, prompts, mode="dense", **common)
            bar.update(1)
            dl = dense.stats["logits"]
            for policy, r, cfg in _configs(args, context):
                res = sfi_jax.generate(model, prompts, mode="sfi", sfi=cfg, diagnostics=True,
                                       **common)
                m = teacher_forced_metrics(dl, res.stats["logits"], targets,
                                           res.stats["slow_timeline"])
                cov = res.stats["coverage"].mean(axis=(2, 3))[:, :m["kl"].shape[1]]
                a = acc.setdefault((policy, r), {"kl": [], "top1": [], "dloss": [], "since": [],
                                                 "slow": [], "cov": [], "dense_loss": [],
                                                 "cov_min": [], "cfg": cfg})
                for k in ("kl", "top1", "dloss", "since", "slow", "dense_loss"):
                    a[k].append(m[k].reshape(-1))
                a["cov"].append(cov.reshape(-1))
                a["cov_min"].append(res.stats["coverage"].min(axis=(2, 3))[:, :m["kl"].shape[1]]
                                    .reshape(-1))
                if policy == "sfi" and abs(r - args.ref_retention) < 1e-9:
                    jac = res.stats["support_jaccard"].mean(axis=(2, 3))  # [B, steps]
                    fed = targets  # decode step i feeds token i
                    for b in range(jac.shape[0]):
                        for t in range(1, jac.shape[1]):
                            if not np.isfinite(jac[b, t]):
                                continue
                            if trig[fed[b, t]]:
                                stab["into_trigger"].append(float(jac[b, t]))
                            elif trig[fed[b, t - 1]]:
                                stab["after_trigger"].append(float(jac[b, t]))
                            else:
                                stab["within"].append(float(jac[b, t]))
                bar.update(1)
            log(f"teacher-forced {context}: {len(rows)} rows in {time.perf_counter() - t0:.0f}s "
                f"(prefill cache {cache.counts})")
    out = {"prompt_tokens": P, "continuation_tokens": N, "samples": len(windows),
           "dense_log_loss": None, "configs": []}
    for (policy, r), a in acc.items():
        cat = {k: np.concatenate(v) for k, v in a.items() if k != "cfg"}
        cfg = a["cfg"]
        # tokens computed sparsely: the fast steps (every step for the oracle, which selects
        # densely but attends sparsely)
        fast = np.ones_like(cat["slow"]) if cfg.policy == "oracle" else ~cat["slow"]
        bins = np.asarray(_bin_since(cat["since"]))
        by_since = []
        for i, (lo, hi) in enumerate(SINCE_BINS):
            sel = bins == i
            if sel.any():
                by_since.append({"lo": lo, "hi": hi, "n": int(sel.sum()),
                                 "kl": _summ(cat["kl"][sel]), "top1": _summ(cat["top1"][sel]),
                                 "dloss": _summ(cat["dloss"][sel]),
                                 "coverage": _summ(cat["cov"][sel])})
        out["dense_log_loss"] = _summ(cat["dense_loss"])
        out["configs"].append({
            "policy": policy, "retention": r, "budget": cfg.budget, "k_select": cfg.k_select,
            "n_recent": cfg.n_recent, "n_sink": cfg.n_sink, "t_max": cfg.t_max,
            "tokens": int(cat["kl"].size), "kl": _summ(cat["kl"]), "top1": _summ(cat["top1"]),
            "dloss": _summ(cat["dloss"]), "slow_rate": _summ(cat["slow"]),
            "coverage_fast": _summ(cat["cov"][fast]) if fast.any() else None,
            "coverage_min_layer_fast": _summ(cat["cov_min"][fast]) if fast.any() else None,
            "kl_fast": _summ(cat["kl"][fast]) if fast.any() else None,
            "top1_fast": _summ(cat["top1"][fast]) if fast.any() else None,
            "by_since": by_since})
    stability = {k: {"n": len(v), "mean": _summ(v), "median": float(np.median(v)) if v else None,
                     "p10": float(np.percentile(v, 10)) if v else None}
                 for k, v in stab.items()}
    stability["k"] = budget_config("sfi", args.ref_retention, context, args.t_max).k_select
    return out, stability


# ----------------------------------------------------------------------------- retrieval

def _answer_rows(samples, results_tokens, slow_timeline, tok):
    from sfi_jax.eval import answer_correct
    from sfi_jax.eval.tasks import extract_answers

    rows = []
    for i, s in enumerate(samples):
        n_lead = len(s.lead_in_ids)
        gen = results_tokens[i][n_lead:n_lead + s.answer_tokens]  # capped by --rt-tokens
        text = tok.decode(gen, skip_special_tokens=True)
        ok, part = answer_correct(s.task, s.answers, text)
        # how much of a single answer came out right before the first error (digits kept)
        found = extract_answers(s.task, text)
        got, want = (found[0] if found else ""), s.answers[0]
        prefix = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                      min(len(got), len(want)))
        # generated token j comes from decode step j - 1 (token 0 from the dense prefill)
        slow = None
        if slow_timeline is not None:
            steps = [True if j == 0 else bool(slow_timeline[i][j - 1])
                     for j in range(n_lead, n_lead + len(gen))]
            slow = float(np.mean(steps)) if steps else 0.0
        rows.append({"ok": ok, "partial": part, "text": text, "slow_share": slow,
                     "prefix": prefix / len(want)})
    return rows


def run_retrieval(model, tok, text, args, context, bar, log):
    import sfi_jax
    from sfi_jax.eval import TASKS, make_sample
    from sfi_jax.eval.prefill_cache import shared_prefill

    out = {}
    tasks = args.tasks or list(TASKS)
    for task, mode in [(t, m) for m in args.answer_modes for t in tasks]:
        samples = []
        for i in range(args.rt_samples):
            depth = 0.05 + 0.85 * (i + 0.5) / args.rt_samples  # spread over the haystack
            s = make_sample(task, text, tok, context, seed=args.seed * 1000 + i, depth=depth,
                            chat=args.chat, new_tokens=args.rt_tokens)
            samples.append(s.onset() if mode == "onset" else s)
        name = task if mode == "onset" else f"{task} ({mode})"
        M = args.rt_tokens
        short = [s for s in samples if len(s.lead_in_ids) + 8 > M]  # answer room
        if short:
            raise ValueError(f"--rt-tokens {M} leaves no room for the answer after the lead-in "
                             f"of {task} ({len(short[0].lead_in_ids)} tokens)")
        cell = {"task": task, "answer_mode": mode, "samples": len(samples), "depths": [round(s.depth, 3) for s in samples],
                "prompt_tokens": [len(s.prompt_ids) for s in samples], "configs": []}
        per = {"dense": []}
        cfgs = {}
        t0 = time.perf_counter()
        batches = list(_batches(samples, args.batch))
        calls = []
        for batch in batches:
            forced = np.full((len(batch), M), -1, np.int32)
            for j, s in enumerate(batch):
                forced[j, :len(s.lead_in_ids)] = s.lead_in_ids
            calls.append(([s.prompt_ids for s in batch], dict(
                max_new_tokens=M, forced_tokens=forced, stop_at_eos=False, tokenizer=tok,
                chunk_steps=args.chunk_steps, max_len=context, impl=args.impl,
                return_logits=True)))
        with shared_prefill(max_entries=len(batches)) as cache:
            for _, common in calls:
                common["prefill_fn"] = cache.prefill_fn
            for batch, (prompts, common) in zip(batches, calls):
                res = sfi_jax.generate(model, prompts, mode="dense", **common)
                per["dense"] += _answer_rows(batch, res.tokens, None, tok)
                bar.update(1)
            dense_acc = float(np.mean([x["ok"] for x in per["dense"]]))
            if dense_acc < args.min_dense_acc or args.dense_only:  # skip the policies
                bar.update(len(batches) * len(_configs(args, context, args.rt_retention)))
            else:
                for batch, (prompts, common) in zip(batches, calls):
                    for policy, r, cfg in _configs(args, context, args.rt_retention):
                        # diagnostics on: the same compiled decode chunk as teacher forcing
                        res = sfi_jax.generate(model, prompts, mode="sfi", sfi=cfg,
                                               diagnostics=True, **common)
                        cfgs[(policy, r)] = cfg
                        per.setdefault((policy, r), []).extend(
                            _answer_rows(batch, res.tokens, res.stats["slow_timeline"], tok))
                        bar.update(1)
        dense_acc = float(np.mean([x["ok"] for x in per["dense"]]))
        cell["dense"] = {"acc": dense_acc,
                         "answer_prefix_share": float(np.mean([x["prefix"] for x in per["dense"]])),
                         "partial": float(np.mean([x["partial"] for x in per["dense"]])),
                         "examples": [x["text"] for x in per["dense"][:3]]}
        cell["answers"] = [s.answers for s in samples[:3]]
        cell["dense_ok"] = dense_acc >= args.min_dense_acc
        for key, rows in per.items():
            if key == "dense":
                continue
            policy, r = key
            cfg = cfgs[key]
            agree = [x["ok"] == d["ok"] for x, d in zip(rows, per["dense"])]
            cell["configs"].append({
                "policy": policy, "retention": r, "budget": cfg.budget,
                "acc": float(np.mean([x["ok"] for x in rows])),
                "partial": float(np.mean([x["partial"] for x in rows])),
                "agree_with_dense": float(np.mean(agree)),
                "answer_prefix_share": float(np.mean([x["prefix"] for x in rows])),
                "answer_slow_share": _summ([x["slow_share"] for x in rows]),
                "examples": [x["text"] for x in rows[:3]]})
        out[name] = cell
        log(f"retrieval {name} @ {context}: dense {dense_acc:.2f} "
            f"({time.perf_counter() - t0:.0f}s)")
    return out


# ----------------------------------------------------------------------------- report

def _machine():
    import jax

    d = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    return {"platform": d.platform, "device": getattr(d, "device_kind", str(d)),
            "cpu_count": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "jax": jax.__version__}


def merge(results: list[dict]) -> dict:
    """Merge partial runs (e.g. one per context, or an ablation) into one results dict: configs
    of the same context (and task) are concatenated."""
    out = {"meta": results[0]["meta"], "teacher_forced": {}, "stability": {}, "retrieval": {}}
    out["meta"]["commands"] = [c for r in results
                               for c in r["meta"].get("commands", [r["meta"]["command"]])]
    for r in results:
        for ctx, cell in r.get("teacher_forced", {}).items():
            if ctx in out["teacher_forced"]:
                out["teacher_forced"][ctx]["configs"] += cell["configs"]
            else:
                out["teacher_forced"][ctx] = cell
        for ctx, st in r.get("stability", {}).items():
            if st["within"]["n"] > 0:
                out["stability"][ctx] = st
        for ctx, tasks in r.get("retrieval", {}).items():
            dst = out["retrieval"].setdefault(ctx, {})
            for task, cell in tasks.items():
                if task in dst:
                    dst[task]["configs"] += cell["configs"]
                else:
                    dst[task] = cell
    return out


def _cfg(cell, policy, r):
    for c in cell["configs"]:
        if c["policy"] == policy and abs(c["retention"] - r) < 1e-9:
            return c
    return None


def evaluate_targets(res: dict, ref: float) -> dict:
    """The issue's targets at retention `ref`: top-1 >= 97 % teacher-forced, retrieval within 2
    points of dense, and SFI better than every equal-budget baseline except the oracle."""
    t = {"ref_retention": ref, "top1": {}, "retrieval_gap": {}, "beats_baselines": {}}
    for ctx, cell in res.get("teacher_forced", {}).items():
        c = _cfg(cell, "sfi", ref)
        if c:
            t["top1"][ctx] = {"sfi_top1": c["top1"], "met": c["top1"] >= 0.97}
            base = {p: _cfg(cell, p, ref) for p in ("tmax", "prefill_only", "streaming")}
            t["beats_baselines"].setdefault(ctx, {})["teacher_forced_kl"] = {
                p: {"sfi": c["kl"], "baseline": b["kl"], "met": c["kl"] < b["kl"]}
                for p, b in base.items() if b}
            t["beats_baselines"][ctx]["teacher_forced_top1"] = {
                p: {"sfi": c["top1"], "baseline": b["top1"], "met": c["top1"] > b["top1"]}
                for p, b in base.items() if b}
    for ctx, tasks in res.get("retrieval", {}).items():
        ok = {k: v for k, v in tasks.items()
              if v["dense_ok"] and v.get("answer_mode", "onset") == "onset"}
        if not ok:
            continue
        dense = float(np.mean([v["dense"]["acc"] for v in ok.values()]))
        accs = {}
        for p in POLICIES:
            cs = [_cfg(v, p, ref) for v in ok.values()]
            if all(cs):
                accs[p] = float(np.mean([c["acc"] for c in cs]))
        if "sfi" in accs:
            t["retrieval_gap"][ctx] = {"dense": dense, "sfi": accs["sfi"],
                                       "gap_points": 100 * (dense - accs["sfi"]),
                                       "met": 100 * (dense - accs["sfi"]) <= 2.0,
                                       "tasks": sorted(ok)}
            t["beats_baselines"].setdefault(ctx, {})["retrieval_acc"] = {
                p: {"sfi": accs["sfi"], "baseline": a, "met": accs["sfi"] > a}
                for p, a in accs.items() if p not in ("sfi", "oracle")}
    return t


def _order(name):
    """Sort key: the policies in POLICIES order, variants after their base policy."""
    base = name.split("(")[0]
    return (POLICIES.index(base) if base in POLICIES else len(POLICIES), name)


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def write_markdown(res: dict, path: str):
    m = res["meta"]
    L = ["# Quality: SFI vs dense and equal-budget baselines (SmolLM2-135M-Instruct)", ""]
    L += [f"Produced by `{' ; '.join(m.get('commands', [m['command']]))}` on {m['date']}.",
          f"Machine: {m['machine']['device']} ({m['machine']['platform']}), "
          f"{m['machine']['cpu_count']} CPU cores, jax {m['machine']['jax']}, "
          f"Python {m['machine']['python']}. Model: {m['model']} ({m['dtype']}).", "",
          f"Text: {m['text']['name']} from the PyPI package `{m['text']['package']}` "
          f"({m['text']['license']}); read offline from the package's data file.", ""]
    L += ["Budgets: every sparse policy reads the same number of KV positions per head and step "
          "(sink 4 + selected + recent; retention = budget / context). Selecting policies keep "
          "the paper's recent window of 256 (half the budget when that is smaller); streaming "
          "spends all but the sink on it. "
          f"t_max = {m['args']['t_max']}. Policies: " +
          "; ".join(f"`{p}` = {LABELS[p]}" for p in POLICIES) + ".", "",
          "The RULER-style retrieval suite (`--suite retrieval`: six tasks over several text "
          "sources, every SFI extension and baseline at equal budget, Wilson intervals) writes "
          "its own report: [retrieval.md](retrieval.md), [retrieval.png](retrieval.png).", ""]
    if m.get("suite_summary"):  # the suite's headline, kept with this report's runs
        L += [m["suite_summary"], ""]
    tg = res.get("targets", {})
    if tg:
        L += [f"## Targets at retention {tg['ref_retention']:.0%}", ""]
        for ctx, v in sorted(tg["top1"].items(), key=lambda kv: int(kv[0])):
            L.append(f"- {ctx}: SFI top-1 agreement {v['sfi_top1']:.2%} "
                     f"(target >= 97 %): **{'met' if v['met'] else 'missed'}**")
        for ctx, v in sorted(tg["retrieval_gap"].items(), key=lambda kv: int(kv[0])):
            L.append(f"- {ctx}: retrieval SFI {v['sfi']:.1%} vs dense {v['dense']:.1%} "
                     f"({v['gap_points']:+.1f} points; target within 2): "
                     f"**{'met' if v['met'] else 'missed'}** (tasks: {', '.join(v['tasks'])})")
        for ctx, v in sorted(tg["beats_baselines"].items(), key=lambda kv: int(kv[0])):
            for metric, d in v.items():
                spec = ".4f" if metric.endswith("kl") else ".1%"
                parts = [f"{p} {_fmt(x['baseline'], spec)} "
                         f"({'SFI better' if x['met'] else 'SFI not better'})"
                         for p, x in d.items()]
                sfi = next(iter(d.values()))["sfi"] if d else None
                L.append(f"- {ctx}: {metric}: SFI {_fmt(sfi, spec)} vs " + ", ".join(parts))
        L.append("")
        notes = m.get("notes")
        if notes:
            L += ["### Notes on the targets", "", notes, ""]
    if res.get("teacher_forced"):
        L += ["## Teacher-forced continuation", "",
              "The true continuation is fed through the decode path (prompt = context - "
              "continuation tokens); per step: KL(dense || policy) in nats, top-1 agreement with "
              "dense, change of the true token's log-loss (policy - dense, nats), and the share "
              "of the dense attention mass (mean over layers and KV heads) covered by the set a "
              "fast step attends. The first continuation token comes from the (dense) prefill and "
              "is not counted.", ""]
        for ctx, cell in sorted(res["teacher_forced"].items(), key=lambda kv: int(kv[0])):
            L += [f"### context {ctx} ({cell['samples']} texts x {cell['continuation_tokens']} "
                  f"tokens, prompt {cell['prompt_tokens']}; dense log-loss "
                  f"{_fmt(cell['dense_log_loss'])} nats/token)", "",
                  "| policy | retention | budget | KL | top-1 | d log-loss | coverage (fast) | "
                  "min-layer coverage (fast) | slow-step rate |",
                  "|---|---|---|---|---|---|---|---|---|"]
            for c in sorted(cell["configs"], key=lambda c: (c["retention"], _order(c["policy"]))):
                L.append(f"| {c['policy']} | {c['retention']:.0%} | {c['budget']} | "
                         f"{_fmt(c['kl'], '.4f')} | {_fmt(c['top1'], '.2%')} | "
                         f"{_fmt(c['dloss'], '+.4f')} | {_fmt(c['coverage_fast'])} | "
                         f"{_fmt(c['coverage_min_layer_fast'])} | {_fmt(c['slow_rate'], '.2f')} |")
            L.append("")
            c = _cfg(cell, "sfi", m["args"]["ref_retention"])
            if c:
                L += [f"SFI at {m['args']['ref_retention']:.0%} by steps since the last slow "
                      "step:", "", "| steps since slow | tokens | KL | top-1 | coverage |",
                      "|---|---|---|---|---|"]
                for b in c["by_since"]:
                    rng_ = f"{b['lo']}" if b["lo"] == b["hi"] else \
                        (f"{b['lo']}-{b['hi']}" if b["hi"] < 10**8 else f">={b['lo']}")
                    L.append(f"| {rng_} | {b['n']} | {_fmt(b['kl'], '.4f')} | "
                             f"{_fmt(b['top1'], '.2%')} | {_fmt(b['coverage'])} |")
                L.append("")
    if res.get("stability"):
        L += ["## Within-sentence support stability", "",
              "Jaccard overlap of the dense top-k attention support (k = k_select of SFI at the "
              "reference retention, per layer and KV head, averaged) between consecutive decode "
              "steps t-1 and t of the teacher-forced runs. `within`: neither fed token is a "
              "trigger; `into_trigger`: step t feeds a trigger token (the step SFI makes slow); "
              "`after_trigger`: step t-1 fed a trigger, so step t is the first query of a new "
              "sentence or clause.", "",
              "| context | k | within (n, mean, median, p10) | into_trigger | after_trigger |",
              "|---|---|---|---|---|"]
        for ctx, s in sorted(res["stability"].items(), key=lambda kv: int(kv[0])):
            f = lambda d: f"{d['n']}, {_fmt(d['mean'])}, {_fmt(d['median'])}, {_fmt(d['p10'])}"  # noqa
            L.append(f"| {ctx} | {s['k']} | {f(s['within'])} | {f(s['into_trigger'])} | "
                     f"{f(s['after_trigger'])} |")
        L.append("")
    if res.get("retrieval"):
        L += ["## Retrieval", "", m.get("retrieval_design", ""), "",
              "Accuracy (exact: the first number generated is the answer; multi-value and "
              "variable tracking need every value). Cells where dense is below "
              f"{m['args']['min_dense_acc']:.0%} are reported but left out of the comparison.", ""]
        for ctx, tasks in sorted(res["retrieval"].items(), key=lambda kv: int(kv[0])):
            names = list(tasks)
            ok = [t for t in names if tasks[t]["dense_ok"]]
            L += [f"### context {ctx}", "",
                  "| arm | retention | " + " | ".join(
                      f"{t} (n={tasks[t]['samples']}{'' if t in ok else ', excluded'})"
                      for t in names) + " | mean over compared tasks |",
                  "|---|---|" + "---|" * (len(names) + 1)]
            mean = lambda xs: _fmt(float(np.mean(xs)), ".1%") if xs else "-"  # noqa: E731
            L.append("| dense | 100% | " + " | ".join(
                f"{tasks[t]['dense']['acc']:.0%}" for t in names) + " | " +
                mean([tasks[t]["dense"]["acc"] for t in ok]) + " |")
            rets = sorted({c["retention"] for v in tasks.values() for c in v["configs"]})
            names = sorted({c["policy"] for v in tasks.values() for c in v["configs"]}, key=_order)
            names_t = list(tasks)
            for r in rets:
                for p in names:
                    cs = {t: _cfg(tasks[t], p, r) for t in names_t}
                    if not any(cs.values()):
                        continue
                    L.append(f"| {p} | {r:.0%} | " + " | ".join(
                        _fmt(c["acc"], ".0%") if c else "-" for c in cs.values()) + " | " +
                        mean([cs[t]["acc"] for t in ok if cs[t]]) + " |")
            L.append("")
            pre = []
            for t in ok:
                v = tasks[t]
                if v["dense"].get("answer_prefix_share") is None:
                    continue
                parts = [f"dense {v['dense']['answer_prefix_share']:.0%}"] + [
                    f"{c['policy']} {c['retention']:.0%}: {c['answer_prefix_share']:.0%}"
                    for c in v["configs"] if c.get("answer_prefix_share") is not None]
                pre.append(f"{t}: " + ", ".join(parts))
            if pre:
                L += ["Share of the answer (digits of the first number) right before the first "
                      "error: " + "; ".join(pre) + ".", ""]
            ex = [(t, tasks[t]) for t in names_t][:5]
            L += ["Examples (dense; first sample of each task): " + "; ".join(
                f"{t}: expected {v['answers'][0]}, got {v['dense']['examples'][0]!r}"
                for t, v in ex), ""]
    L += ["## Plots", "", "- `quality_teacher_forced.png`: top-1 agreement and KL against "
          "retention, per policy and context.", "- `quality_retrieval.png`: retrieval accuracy "
          "against retention.", "- `quality_since_slow.png`: SFI KL, top-1 and coverage against "
          "steps since the last slow step.", "- `quality_stability.png`: support Jaccard within "
          "a sentence vs across a trigger.", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def write_plots(res: dict, folder: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"sfi": "C3", "tmax": "C0", "prefill_only": "C2", "streaming": "C7",
              "oracle": "k"}
    files = []
    tf = res.get("teacher_forced", {})
    if tf:
        ctxs = sorted(tf, key=int)
        fig, ax = plt.subplots(2, len(ctxs), figsize=(4.2 * len(ctxs), 6.5), squeeze=False)
        for j, ctx in enumerate(ctxs):
            for p in POLICIES:
                cs = sorted([c for c in tf[ctx]["configs"] if c["policy"] == p],
                            key=lambda c: c["retention"])
                if not cs:
                    continue
                x = [100 * c["retention"] for c in cs]
                ax[0, j].plot(x, [100 * c["top1"] for c in cs], "o-", color=colors[p], label=p)
                ax[1, j].plot(x, [max(c["kl"], 1e-5) for c in cs], "o-", color=colors[p], label=p)
            ax[0, j].axhline(97, ls=":", color="gray")
            ax[0, j].set_title(f"context {ctx}")
            ax[0, j].set_ylabel("top-1 agreement with dense (%)")
            ax[1, j].set_ylabel("KL(dense || policy), nats")
            ax[1, j].set_yscale("log")
            ax[1, j].set_xlabel("retention (budget / context, %)")
            ax[0, j].set_xlim(0, 35)
            ax[1, j].set_xlim(0, 35)
        ax[0, 0].legend(fontsize=8)
        fig.suptitle("Teacher-forced continuation (SmolLM2-135M)")
        fig.tight_layout()
        files.append(os.path.join(folder, "quality_teacher_forced.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)

        ref = res["meta"]["args"]["ref_retention"]
        fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
        for ctx in ctxs:
            c = _cfg(tf[ctx], "sfi", ref)
            if not c:
                continue
            xs = [f"{b['lo']}" if b["lo"] == b["hi"] else (f"{b['lo']}-{b['hi']}" if b["hi"] < 10**8
                                                             else f">={b['lo']}")
                  for b in c["by_since"]]
            ax[0].plot(xs, [max(b["kl"], 1e-6) for b in c["by_since"]], "o-", label=f"{ctx}")
            ax[1].plot(xs, [100 * b["top1"] for b in c["by_since"]], "o-", label=f"{ctx}")
            ax[2].plot(xs, [b["coverage"] for b in c["by_since"]], "o-", label=f"{ctx}")
        ax[0].set_yscale("log")
        for a_, t in zip(ax, ("KL(dense || SFI), nats", "top-1 agreement (%)",
                              "attention mass covered")):
            a_.set_title(t)
            a_.set_xlabel("steps since the last slow step")
            a_.tick_params(axis="x", labelrotation=45)
        ax[0].legend(title="context", fontsize=8)
        fig.suptitle(f"SFI at retention {ref:.0%}")
        fig.tight_layout()
        files.append(os.path.join(folder, "quality_since_slow.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    rt = res.get("retrieval", {})
    if rt:
        ctxs = sorted(rt, key=int)
        fig, ax = plt.subplots(2, len(ctxs), figsize=(4.2 * len(ctxs), 6.8), squeeze=False)
        for j, ctx in enumerate(ctxs):
            ok = {k: v for k, v in rt[ctx].items()
                  if v["dense_ok"] and v.get("answer_mode", "onset") == "onset"}
            if not ok:
                ax[0, j].set_title(f"context {ctx}: no task solved densely")
                continue
            for row, key in enumerate(("acc", "answer_prefix_share")):
                dense = [v["dense"].get(key) for v in ok.values()]
                if None not in dense:
                    ax[row, j].axhline(100 * np.mean(dense), ls="--", color="gray", label="dense")
                for i, p in enumerate(POLICIES):
                    rets = sorted({c["retention"] for v in ok.values() for c in v["configs"]
                                   if c["policy"] == p})
                    ys = [[_cfg(v, p, r).get(key) for v in ok.values()] for r in rets]
                    if rets and all(None not in y for y in ys):
                        ax[row, j].plot([100 * r + 0.4 * (i - 2) for r in rets],
                                        [100 * np.mean(y) for y in ys], "o-", color=colors[p],
                                        label=p)
                ax[row, j].set_xlim(0, 35)
                ax[row, j].set_ylim(-5, 105)
            ax[0, j].set_title(f"context {ctx} ({', '.join(sorted(ok))})", fontsize=8)
            ax[0, j].set_ylabel("accuracy (%)")
            ax[1, j].set_ylabel("answer correct up to the first error (%)")
            ax[1, j].set_xlabel("retention (%)")
        ax[0, 0].legend(fontsize=8)
        fig.suptitle("Retrieval (tasks dense solves)")
        fig.tight_layout()
        files.append(os.path.join(folder, "quality_retrieval.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    st = res.get("stability", {})
    if st:
        ctxs = sorted(st, key=int)
        fig, ax = plt.subplots(figsize=(6, 3.8))
        w = 0.25
        for i, k in enumerate(("within", "into_trigger", "after_trigger")):
            ax.bar(np.arange(len(ctxs)) + (i - 1) * w,
                   [st[c][k]["mean"] or 0 for c in ctxs], w, label=k)
        ax.set_xticks(np.arange(len(ctxs)), [f"{c} (k={st[c]['k']})" for c in ctxs])
        ax.set_ylabel("Jaccard of dense top-k support, t-1 vs t")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        ax.set_title("Support stability: within a sentence vs across a trigger")
        fig.tight_layout()
        files.append(os.path.join(folder, "quality_stability.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files


RETRIEVAL_DESIGN = (
    "Design: the haystack is King James text with the needle sentence(s) inserted between verses "
    "at depths spread evenly over 5-90 %; the question follows the haystack, then `Answer:` and "
    "a fixed lead-in such as ` The pass key is`. The first generated token comes from the "
    "prefill logits, which are dense for every policy, and SFI's first decode step is slow "
    "(dense) too, so at most the first two answer tokens (the space and the first digit of a "
    "number) can come from dense attention; every further token is produced by a fast step "
    "that reads only the set the slow step selected (the JSON's `answer_slow_share`), so the "
    "remaining 4-6 digits are right only if the selection kept the needle. Answers are short "
    "(< t_max) and hold no trigger token. Mode `lead_in` (where run) instead feeds the lead-in "
    "through the decoder (teacher-forced) before the answer, so SFI's one slow step sees only "
    "the lead-in's first token (` The`) and every answer token is fast: the harder setting for "
    "a selection made from a single query. For these short answers t_max refresh behaves "
    "exactly like SFI (no trigger and no t_max expiry inside the answer); the oracle re-selects "
    "at every step (its timeline is all slow, but its tokens are computed sparsely).")


def run_retrieval_suite(args, argv):
    """--suite retrieval: the RULER-style suite; --report merges its JSONs instead."""
    from sfi_jax.eval import suite

    if args.report:
        res = suite.merge([json.load(open(p)) for p in args.report])
        if args.notes:
            res["meta"]["notes"] = open(args.notes).read().strip()
        suite.write_report(res, args.out)
        return res
    import jax
    from tqdm import tqdm

    if jax.devices()[0].platform != "cpu":  # f32 matmuls in full precision on GPUs
        jax.config.update("jax_default_matmul_precision", "highest")
    import sfi_jax
    from sfi_jax.eval.ruler import TASKS

    t_start = time.perf_counter()
    log = lambda s: tqdm.write(s, file=sys.stderr)  # noqa: E731
    model = sfi_jax.load_model(args.model, dtype="float32")
    tok = sfi_jax.load_tokenizer(args.model)
    tasks = args.tasks or list(TASKS)
    arms = args.arms or list(suite.ARMS)
    meta = {
        "commands": ["python scripts/eval_quality.py " + " ".join(
            argv if argv is not None else sys.argv[1:])],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(), "model": "SmolLM2-135M-Instruct (embedded GGUF, Q4_1 "
        "dequantised, float32)", "contexts": args.contexts, "tasks": tasks,
        "samples": args.rs_samples, "retentions": args.rs_retention, "arms": arms,
        "ref_retention": args.ref_retention, "batch": args.batch, "seed": args.seed,
        "sweep_arms": args.sweep_arms or arms, "arm_configs": suite.config_summary()}

    def save(res):
        res["meta"] = dict(meta, wall_s=time.perf_counter() - t_start)
        if args.json_only:
            with open(args.json_only, "w") as f:
                json.dump(res, f, indent=1)
        else:
            suite.write_report(res, args.out)

    res = suite.run_suite(model, tok, contexts=args.contexts, tasks=tasks,
                          samples=args.rs_samples, retentions=args.rs_retention, arms=arms,
                          sweep_arms=args.sweep_arms, batch=args.batch,
                          ref_retention=args.ref_retention, seed=args.seed, impl=args.impl,
                          exact=not args.no_exact, log=log, on_cell=save)
    save(res)
    log(f"done in {res['meta']['wall_s']:.0f}s")
    return res


def main(argv=None):
    args = parse_args(argv)
    if args.compile_cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if args.suite == "retrieval":
        return run_retrieval_suite(args, argv)
    if args.report:
        res = merge([json.load(open(p)) for p in args.report])
        if args.notes:
            res["meta"]["notes"] = open(args.notes).read().strip()
        res["targets"] = evaluate_targets(res, res["meta"]["args"]["ref_retention"])
        _write(res, args)
        return res

    import jax
    from tqdm import tqdm

    if jax.devices()[0].platform != "cpu":  # f32 matmuls in full precision on GPUs
        jax.config.update("jax_default_matmul_precision", "highest")
    import sfi_jax
    from sfi_jax.eval.text import TokenText, load_text

    t_start = time.perf_counter()
    log = lambda s: tqdm.write(s, file=sys.stderr)  # noqa: E731
    if args.dense_only:
        args.no_tf = True
    model = sfi_jax.load_model(args.model, dtype="float32")
    tok = sfi_jax.load_tokenizer(args.model)
    source = load_text()
    text = TokenText(source, tok, max_verses=4000 if args.smoke else 12000)
    from sfi_jax.eval import TASKS

    n_cfg = len(args.retention) * len(args.policies) + 1
    n_rt_cfg = len(args.rt_retention or args.retention) * len(args.policies) + 1
    n_tasks = len(args.tasks or TASKS) * len(args.answer_modes)
    total = 0
    for ctx in args.contexts:
        if not args.no_tf:
            total += -(-args.tf_samples // args.batch) * n_cfg
        if not args.no_retrieval:
            total += n_tasks * -(-args.rt_samples // args.batch) * n_rt_cfg
    res = {"meta": {
        "command": "python scripts/eval_quality.py " + " ".join(argv if argv is not None
                                                                 else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(), "model": "SmolLM2-135M-Instruct (embedded GGUF, Q4_1 "
        "dequantised)", "dtype": "float32", "args": vars(args),
        "text": {"name": source.name, "package": source.package, "license": source.license,
                 "tokens_used": len(text)},
        "retrieval_design": RETRIEVAL_DESIGN},
        "teacher_forced": {}, "stability": {}, "retrieval": {}}
    with tqdm(total=total, desc="generate calls", unit="call") as bar:
        for ctx in args.contexts:
            if not args.no_tf:
                tf, stab = run_teacher_forced(model, tok, text, args, ctx, bar, log)
                res["teacher_forced"][str(ctx)] = tf
                res["stability"][str(ctx)] = stab
                _write(res, args)
            if not args.no_retrieval:
                res["retrieval"][str(ctx)] = run_retrieval(model, tok, text, args, ctx, bar, log)
            _write(res, args)  # partial results survive an interruption
    res["meta"]["wall_s"] = time.perf_counter() - t_start
    res["targets"] = evaluate_targets(res, args.ref_retention)
    _write(res, args)
    log(f"done in {res['meta']['wall_s']:.0f}s")
    return res


def _write(res, args):
    if args.json_only:
        with open(args.json_only, "w") as f:
            json.dump(res, f, indent=1)
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quality.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(res, os.path.join(args.out, "quality.md"))
    write_plots(res, args.out)


if __name__ == "__main__":
    main()
