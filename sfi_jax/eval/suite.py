"""The retrieval suite's runner and report: every arm at equal KV budget on the same samples.

`scripts/eval_quality.py --suite retrieval` calls `run_suite` and `write_report`. Arms: dense;
exact mode (a check: its tokens must be dense decoding's); SFI with the paper's values and with
each extension (successor radius 3 / 7 / 15, evidence window 16, the warm-up refreshes) and
combinations; t_max 4 throughout; the streaming,
prefill-only (SnapKV-like) and oracle baselines. Each batch's prefill is computed once and
shared by all arms (`prefill_cache.shared_prefill`), so an arm costs its decode steps only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from sfi_jax.config import PAPER as _PAPER
from sfi_jax.eval.metrics import wilson_interval
from sfi_jax.eval.ruler import make_sample, score

N_SINK = 4
ARMS = {
    # name: (policy, SFIConfig overrides). The SFI arms pin both extensions, so an arm means
    # the same thing whatever SFIConfig's defaults are ("paper" = SFIConfig.paper()'s values).
    "paper": ("sfi", _PAPER),
    "sfi+succ3": ("sfi", {**_PAPER, "successor_radius": 3}),
    "sfi+succ7": ("sfi", {**_PAPER, "successor_radius": 7}),
    "sfi+succ15": ("sfi", {**_PAPER, "successor_radius": 15}),
    "sfi+ew16": ("sfi", {**_PAPER, "evidence_window": 16}),
    "sfi+succ7+ew16": ("sfi", {**_PAPER, "successor_radius": 7, "evidence_window": 16}),
    "sfi+succ7+t4": ("sfi", {**_PAPER, "successor_radius": 7, "t_max": 4}),
    "sfi+succ7+warm32": ("sfi", {**_PAPER, "successor_radius": 7, "warmup_steps": 32}),
    "sfi+succ7+warm32+mem": ("sfi", {**_PAPER, "successor_radius": 7, "warmup_steps": 32,
                                     "selection_memory": 0.5}),
    "sfi+succ7+warm32+mem0": ("sfi", {**_PAPER, "successor_radius": 7, "warmup_steps": 32,
                                      "selection_memory": 0.0}),
    "sfi+succ7+warm32+mem0+nms025": ("sfi", {**_PAPER, "successor_radius": 7,
                                             "warmup_steps": 32, "selection_memory": 0.0,
                                             "alpha_soft": 0.25}),
    "sfi+succ7+warm32+mem0+recent64": ("sfi", {**_PAPER, "successor_radius": 7,
                                               "warmup_steps": 32, "selection_memory": 0.0,
                                               "n_recent": 64}),
    "sfi+succ7+warm32+mem0+recent25pct": ("sfi", {**_PAPER, "successor_radius": 7,
                                                  "warmup_steps": 32, "selection_memory": 0.0,
                                                  "recent_share": 0.25}),
    # half the budget recent, without the 256 cap (`budget_config` caps an n_recent override
    # at half the budget): the split that helped natural text at 8K (docs/findings.md)
    "sfi+succ7+warm32+mem0+recent50pct": ("sfi", {**_PAPER, "successor_radius": 7,
                                                  "warmup_steps": 32, "selection_memory": 0.0,
                                                  "n_recent": 1 << 30}),
    "streaming": ("streaming", {}),
    "prefill_only": ("prefill_only", {}),
    "oracle": ("oracle", {}),
}
"""Sparse arms; "dense" and "exact" (SFIConfig's defaults, at the reference retention) run
besides."""
ARM_LABELS = {"paper": "SFI, the paper's values (SFIConfig.paper())",
              "sfi+succ3": "SFI + successor_radius=3", "sfi+succ7": "SFI + successor_radius=7",
              "sfi+succ15": "SFI + successor_radius=15",
              "sfi+ew16": "SFI + evidence_window=16",
              "sfi+succ7+ew16": "SFI + successor_radius=7 + evidence_window=16",
              "sfi+succ7+t4": "SFI + successor_radius=7, t_max=4 throughout",
              "sfi+succ7+warm32": "SFI + successor_radius=7 + warm-up (every 4th of the first "
                                  "32 steps slow)",
              "sfi+succ7+warm32+mem": "SFI + successor_radius=7 + warm-up + selection_memory"
                                      "=0.5",
              "sfi+succ7+warm32+mem0": "SFI + successor_radius=7 + warm-up + selection_memory"
                                       "=0 (no decay)",
              "sfi+succ7+warm32+mem0+nms025": "the defaults with a softer soft-NMS "
                                              "(alpha_soft=0.25)",
              "sfi+succ7+warm32+mem0+recent64": "the defaults with a recent window of 64 "
                                                "(the rest of the budget selected)",
              "sfi+succ7+warm32+mem0+recent25pct": "the defaults with a recent window of a "
                                                   "quarter of the budget (at most 256)",
              "sfi+succ7+warm32+mem0+recent50pct": "the defaults with half the budget on the "
                                                   "recent window (no 256 cap)",
              "streaming": "streaming (sink + recent)",
              "prefill_only": "prefill-only (SnapKV-like)",
              "oracle": "oracle (dense top-k every step)", "dense": "dense",
              "exact": "exact mode (SFI drafts, dense verifies)"}


def default_arm() -> str | None:
    """The SFI arm whose pinned fields are SFIConfig()'s defaults (None if no arm is)."""
    from sfi_jax import SFIConfig

    d = SFIConfig()
    return next((a for a, (p, o) in ARMS.items()
                 if p == d.policy and o and all(getattr(d, k) == v for k, v in o.items())), None)


def budget_config(policy: str, retention: float, context: int, t_max: int = 64, **overrides):
    """SFIConfig for `policy` with n_sink + k_select + n_recent = round(retention * context).

    Selecting policies keep the paper's recent window of 256 positions (half the budget when
    that is smaller; an `n_recent` override in place of the 256, or a `recent_share` of the
    budget, at most 256); streaming spends everything but the sink on the recent window.
    """
    from sfi_jax import SFIConfig

    budget = max(32, int(round(retention * context)))
    if policy == "streaming":
        return SFIConfig(n_sink=N_SINK, k_select=1, n_recent=budget - N_SINK - 1, t_max=t_max,
                         policy=policy)
    share = overrides.pop("recent_share", None)
    n_recent = min(overrides.pop("n_recent", 256), budget // 2)
    if share is not None:
        n_recent = min(256, int(round(share * budget)))
    return SFIConfig(n_sink=N_SINK, k_select=budget - N_SINK - n_recent, n_recent=n_recent,
                     t_max=t_max, policy=policy, **overrides)


def _cell(ok: list[bool], texts: list[str], seconds: float) -> dict:
    k, n = int(sum(ok)), len(ok)
    lo, hi = wilson_interval(k, n)
    return {"n": n, "correct": k, "acc": k / n, "ci95": [lo, hi], "ok": [bool(x) for x in ok],
            "examples": texts[:3], "decode_s": seconds}


def run_suite(model, tok, *, contexts, tasks, samples, retentions, arms, batch,
              ref_retention=0.15, sweep_arms=None, chunk_steps=8, seed=0, impl="auto",
              exact=True, log=print, on_cell=None) -> dict:
    """Run every (task, context) on `samples` samples with dense, exact and every arm at
    ref_retention, and the sweep_arms (default: every arm) at the other retentions. Returns
    {"results": {context: {task: cell}}} with per-sample correctness and Wilson 95 % intervals;
    on_cell(results) is called after each cell (to save partial results)."""
    import sfi_jax
    from sfi_jax.eval.prefill_cache import shared_prefill

    sweep_arms = arms if sweep_arms is None else sweep_arms
    bad = [a for a in list(arms) + list(sweep_arms) if a not in ARMS]
    if bad:
        raise ValueError(f"unknown arms {bad}; choose from {list(ARMS)}")
    out: dict = {}
    for ctx in contexts:
        for task in tasks:
            t0 = time.perf_counter()
            smp = [make_sample(task, tok, ctx, seed=seed, index=i,
                               depth=0.05 + 0.85 * (i + 0.5) / samples) for i in range(samples)]
            runs = [("dense", 1.0, "dense", None)]
            if ref_retention is not None and exact:
                runs.append(("exact", ref_retention, "exact",
                             budget_config("sfi", ref_retention, ctx)))
            runs += [(a, r, "sfi", budget_config(ARMS[a][0], r, ctx, **ARMS[a][1]))
                     for r in retentions for a in ARMS
                     if a in (arms if ref_retention is not None and abs(r - ref_retention) < 1e-9
                              else sweep_arms)]
            # an SFI prefill keeps the window queries every later arm can reuse: run one first
            first = next((i for i, x in enumerate(runs) if x[2] == "sfi" and
                          x[3].policy != "streaming"), 0)
            runs = [runs[first]] + runs[:first] + runs[first + 1:]
            got = {(a, r): ([], [], [0.0]) for a, r, _, _ in runs}
            tokens = {a: [] for a in ("dense", "exact")}
            for b0 in range(0, samples, batch):
                rows = smp[b0:b0 + batch]
                prompts = [s.prompt_ids for s in rows]
                prompts += [prompts[-1]] * (batch - len(rows))  # fixed shapes: one compile
                M = max(s.answer_tokens for s in rows)
                with shared_prefill(max_entries=1) as cache:
                    for arm, r, mode, cfg in runs:
                        t = time.perf_counter()
                        res = sfi_jax.generate(model, prompts, mode=mode, sfi=cfg,
                                               max_new_tokens=M, stop_at_eos=False,
                                               tokenizer=tok, chunk_steps=chunk_steps,
                                               max_len=ctx, impl=impl,
                                               prefill_fn=cache.prefill_fn)
                        ok, texts, secs = got[(arm, r)]
                        secs[0] += time.perf_counter() - t
                        for s, g in zip(rows, res.tokens):
                            text = tok.decode(g[:s.answer_tokens], skip_special_tokens=True)
                            ok.append(score(task, s.answers, text))
                            texts.append(text)
                        if arm in tokens:
                            tokens[arm] += [list(g) for g in res.tokens[:len(rows)]]
                log(f"{task} @ {ctx}: {min(b0 + batch, samples)}/{samples} samples "
                    f"({time.perf_counter() - t0:.0f}s, prefill cache {cache.counts})")
            cell = {"samples": samples, "sources": [s.source for s in smp],
                    "depths": [round(s.depth, 3) for s in smp],
                    "prompt_tokens": [len(s.prompt_ids) for s in smp],
                    "answers": [s.answers for s in smp], "arms": {}}
            for (arm, r), (ok, texts, secs) in got.items():
                cell["arms"].setdefault(arm, {})[f"{r:g}"] = _cell(ok, texts, secs[0])
            if tokens["exact"]:
                cell["exact_equals_dense"] = float(np.mean(
                    [a == b for a, b in zip(tokens["exact"], tokens["dense"])]))
            out.setdefault(str(ctx), {})[task] = cell
            if on_cell is not None:
                on_cell({"results": out})
            log(f"{task} @ {ctx}: dense {cell['arms']['dense']['1']['acc']:.2f} "
                f"({time.perf_counter() - t0:.0f}s)")
    return {"results": out}


# ----------------------------------------------------------------------------- report

def _acc(cell, arm, r):
    c = cell["arms"].get(arm, {}).get(f"{r:g}")
    return c


def _pct(c):
    if c is None:
        return "-"
    lo, hi = c["ci95"]
    return f"{c['acc']:.0%} [{lo:.0%}, {hi:.0%}]"


def _retentions(res):
    return sorted({float(r) for ctx in res["results"].values() for cell in ctx.values()
                   for arm, rs in cell["arms"].items() if arm not in ("dense", "exact")
                   for r in rs})


def pooled(res, ctx, arm, r, tasks=None):
    """Accuracy and Wilson interval pooled over the tasks of one context (all samples)."""
    k = n = 0
    for task, cell in res["results"][ctx].items():
        if tasks is not None and task not in tasks:
            continue
        c = _acc(cell, arm, r)
        if c is None:
            return None
        k, n = k + c["correct"], n + c["n"]
    if n == 0:
        return None
    lo, hi = wilson_interval(k, n)
    return {"acc": k / n, "ci95": [lo, hi], "correct": k, "n": n}


def headline_markdown(res: dict, ctx: str) -> list[str]:
    """At the reference retention, one row per arm and one column per task (and pooled):
    accuracy [Wilson 95 %]; the report's first table."""
    ref = res["meta"]["ref_retention"]
    tasks = res["results"][ctx]
    arms = ["dense", "exact"] + [a for a in ARMS if any(a in c["arms"] for c in tasks.values())]
    d = default_arm()
    L = ["| arm | " + " | ".join(f"{t} (n={c['samples']})" for t, c in tasks.items()) +
         " | pooled |", "|---|" + "---|" * (len(tasks) + 1)]
    for a in arms:
        r = 1.0 if a == "dense" else ref
        name = f"{a} (defaults)" if a == d else a
        L.append(f"| {name} | " + " | ".join(_pct(_acc(c, a, r)) for c in tasks.values()) +
                 f" | {_pct(pooled(res, ctx, a, r))} |")
    return L


def write_markdown(res: dict, path: str):
    m = res["meta"]
    rets = _retentions(res)
    arms = [a for a in ARMS if any(a in cell["arms"] for ctx in res["results"].values()
                                   for cell in ctx.values())]
    mc = m["machine"]
    machine = (f"{mc['platform']} ({mc['cpu_count']} cores), jax {mc['jax']}, Python "
               f"{mc['python']}" if isinstance(mc, dict) else str(mc))
    walls = m.get("walls_s", [m.get("wall_s", 0)] * len(m["commands"]))
    L = ["# Retrieval suite (RULER-style): SFI vs dense and equal-budget baselines", "",
         f"Model: {m['model']}. Machine: {machine}.", "", "Runs (wall time each):", ""] + [
        f"- `{c}` ({w:.0f} s)" for c, w in zip(m["commands"], walls)] + ["",
         f"Samples per task and context: {m['samples']}; contexts {m['contexts']}; retentions "
         f"{', '.join(f'{r:.0%}' for r in rets)} (budget = sink 4 + selected + recent = "
         "retention x context; selecting arms keep a recent window of min(256, budget / 2)); "
         f"arms: {', '.join(['dense', 'exact'] + arms)}. Exact mode runs at "
         f"{m['ref_retention']:.0%} only, as a check against dense. The SFI arms pin both "
         "extensions (`sfi_jax.eval.suite.ARMS`): `paper` is `SFIConfig.paper()`; "
         f"`SFIConfig()`'s defaults are arm `{default_arm()}`.", "",
         "Tasks: " + "; ".join(f"`{t}`" for t in m["tasks"]) + ". Haystacks rotate over "
         "Python standard-library source, its docstrings, license texts shipped with Python and "
         "the installed dependencies, and grammar-generated sentences (`sfi_jax/eval/"
         "haystack.py`); json_kv is a generated JSON object, code_line standard-library source. "
         "Each prompt ends with the answer's lead-in; the answer is scored by exact match "
         "(`sfi_jax.eval.ruler.score`). Cells: accuracy [Wilson 95 % interval].", ""]
    if m.get("notes"):
        L += [m["notes"], ""]
    for ctx in sorted(res["results"], key=int):
        tasks = res["results"][ctx]
        L += [f"## Context {ctx}", "", f"### Every arm at {m['ref_retention']:.0%} retention",
              ""] + headline_markdown(res, ctx) + ["", "### All tasks pooled, by retention", "",
              "| arm | " + " | ".join(f"{r:.0%}" for r in rets) + " |",
              "|---|" + "---|" * len(rets)]
        d = pooled(res, ctx, "dense", 1.0)
        L.append("| dense (100 %) | " + " | ".join(_pct(d) for _ in rets) + " |")
        for a in arms:
            L.append(f"| {a} | " + " | ".join(_pct(pooled(res, ctx, a, r)) for r in rets) + " |")
        ex = [(t, c.get("exact_equals_dense")) for t, c in tasks.items()
              if c.get("exact_equals_dense") is not None]
        if ex:
            L += ["", "Exact mode: " + ", ".join(
                f"{t} {_pct(_acc(tasks[t], 'exact', m['ref_retention']))} (token sequences equal "
                f"to dense's: {v:.0%})" for t, v in ex) + "."]
        L.append("")
        for task, cell in tasks.items():
            srcs = sorted(set(cell["sources"]))
            L += [f"### {task} (context {ctx}, n = {cell['samples']}, sources: "
                  f"{', '.join(srcs)})", "",
                  "| arm | " + " | ".join(f"{r:.0%}" for r in rets) + " |",
                  "|---|" + "---|" * len(rets)]
            L.append("| dense (100 %) | " + " | ".join(
                _pct(_acc(cell, "dense", 1.0)) for _ in rets) + " |")
            for a in arms:
                L.append(f"| {a} | " + " | ".join(_pct(_acc(cell, a, r)) for r in rets) + " |")
            dx = cell["arms"]["dense"]["1"]["examples"]
            L += ["", f"Expected {cell['answers'][0]}; dense generated {dx[0]!r}.", ""]
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def write_plot(res: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"paper": "C3", "sfi+succ3": "C9", "sfi+succ7": "C1", "sfi+succ15": "C8",
              "sfi+ew16": "C5", "sfi+succ7+ew16": "C4", "sfi+succ7+t4": "C6",
              "sfi+succ7+warm32": "C0", "sfi+succ7+warm32+mem": "m",
              "sfi+succ7+warm32+mem0": "tab:pink", "sfi+succ7+warm32+mem0+nms025": "tab:olive",
              "streaming": "C7", "prefill_only": "C2", "oracle": "k"}
    rets = _retentions(res)
    ctxs = sorted(res["results"], key=int)
    tasks = list(res["results"][ctxs[0]])
    cols = tasks + ["pooled"]
    fig, ax = plt.subplots(len(ctxs), len(cols), figsize=(3.2 * len(cols), 3.2 * len(ctxs)),
                           squeeze=False)
    for i, ctx in enumerate(ctxs):
        for j, t in enumerate(cols):
            a_ = ax[i, j]
            if t != "pooled" and t not in res["results"][ctx]:  # a task not run at ctx
                a_.axis("off")
                continue
            get = (lambda arm, r: pooled(res, ctx, arm, r)) if t == "pooled" else \
                (lambda arm, r, t=t: _acc(res["results"][ctx][t], arm, r))
            d = get("dense", 1.0)
            if d:
                a_.axhspan(100 * d["ci95"][0], 100 * d["ci95"][1], color="gray", alpha=0.2)
                a_.axhline(100 * d["acc"], ls="--", color="gray", label="dense")
            for k, arm in enumerate(ARMS):
                cs = [(r, get(arm, r)) for r in rets]
                cs = [(r, c) for r, c in cs if c]
                if not cs:
                    continue
                x = np.array([100 * r for r, _ in cs]) + 0.25 * (k - 3)
                y = np.array([100 * c["acc"] for _, c in cs])
                err = np.maximum(0.0, np.array([  # >= 0: a bound equal to acc up to rounding
                    [100 * (c["acc"] - c["ci95"][0]), 100 * (c["ci95"][1] - c["acc"])]
                    for _, c in cs]).T)
                a_.errorbar(x, y, yerr=err, fmt="o-", ms=3, lw=1, capsize=2, color=colors[arm],
                            label=arm)
            a_.set_ylim(-5, 105)
            a_.set_xlim(0, 30)
            a_.set_title(f"{t} @ {ctx}", fontsize=9)
            a_.set_xlabel("retention (%)")
            if j == 0:
                a_.set_ylabel("accuracy (%)")
    ax[0, -1].legend(fontsize=6)
    fig.suptitle("Retrieval accuracy vs retention (95 % Wilson)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(res: dict, folder: str, name: str = "retrieval"):
    """folder/name.json, .md and .png."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(res, os.path.join(folder, name + ".md"))
    write_plot(res, os.path.join(folder, name + ".png"))


def merge(results: list[dict]) -> dict:
    """Merge runs (other contexts, tasks or arms over the same samples) into one."""
    out = {"meta": dict(results[0]["meta"]), "results": {}}
    out["meta"]["commands"] = [c for r in results for c in r["meta"]["commands"]]
    out["meta"]["wall_s"] = sum(r["meta"].get("wall_s", 0) for r in results)
    out["meta"]["walls_s"] = [r["meta"].get("wall_s", 0) for r in results]
    for r in results:
        for ctx, tasks in r["results"].items():
            for task, cell in tasks.items():
                dst = out["results"].setdefault(ctx, {})
                if task not in dst:
                    dst[task] = cell
                    continue
                if dst[task]["answers"] != cell["answers"]:
                    raise ValueError(f"{task} @ {ctx}: runs used different samples")
                for arm, rs in cell["arms"].items():
                    dst[task]["arms"].setdefault(arm, {}).update(rs)
    out["meta"]["tasks"] = list(dict.fromkeys(t for ctx in out["results"].values() for t in ctx))
    return out


def config_summary(arms=ARMS) -> dict:
    """The SFIConfig fields each arm changes, for the report."""
    from sfi_jax import SFIConfig

    base = dataclasses.asdict(SFIConfig())
    return {a: {"policy": p, **o} for a, (p, o) in arms.items()} | {"defaults": base}
