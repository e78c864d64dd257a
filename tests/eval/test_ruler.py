"""The retrieval suite: task generators, exact-match scoring, Wilson intervals and the report
(no model run: seconds)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from sfi_jax.eval import suite
from sfi_jax.eval.haystack import SOURCES, load_haystack
from sfi_jax.eval.metrics import wilson_interval
from sfi_jax.eval.ruler import TASKS, TEXT_SOURCES, make_sample, score

CTX = 1024


@pytest.fixture(scope="module")
def tok():
    import sfi_jax

    return sfi_jax.load_tokenizer("smollm2-135m")


def test_wilson_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 50, 333):
        for k in {0, n, *rng.integers(0, n + 1, size=3).tolist()}:
            ref = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
            np.testing.assert_allclose(wilson_interval(k, n), (ref.low, ref.high), atol=1e-9)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(3, 2)


@pytest.mark.parametrize("task", TASKS)
def test_sample_fits_hides_answer_and_is_deterministic(tok, task):
    for index in range(2):
        s = make_sample(task, tok, CTX, seed=3, index=index)
        again = make_sample(task, tok, CTX, seed=3, index=index)
        assert s.prompt_ids == again.prompt_ids and s.answers == again.answers
        assert s.source == TEXT_SOURCES[task][index % len(TEXT_SOURCES[task])]
        assert CTX - 120 <= len(s.prompt_ids) and len(s.prompt_ids) + s.answer_tokens <= CTX
        needles = "".join(tok.decode(s.prompt_ids[a:b]) for a, b in s.needle_spans)
        for ans in s.answers:
            assert ans in needles  # the answer is in the needle spans
        # a number answer occurs only in its needle (names of vartrack recur in the chain)
        if task not in ("vartrack", "code_line"):
            outside = tok.decode([t for i, t in enumerate(s.prompt_ids)
                                  if not any(a <= i < b for a, b in s.needle_spans)])
            assert all(ans not in outside for ans in s.answers)
    other = make_sample(task, tok, CTX, seed=4, index=0)
    assert other.prompt_ids != make_sample(task, tok, CTX, seed=3, index=0).prompt_ids


def test_samples_cover_every_source_and_depth(tok):
    got = [make_sample("niah_single", tok, CTX, seed=0, index=i, depth=d)
           for i, d in enumerate((0.1, 0.4, 0.6, 0.85))]
    assert [s.source for s in got] == list(SOURCES)
    for s, d in zip(got, (0.1, 0.4, 0.6, 0.85)):
        start = s.needle_spans[0][0] / len(s.prompt_ids)
        assert abs(start - d) < 0.15  # the needle sits near its depth in the haystack
    for src in SOURCES:
        assert len(load_haystack(src).units) > 100
    with pytest.raises(ValueError, match="unknown task"):
        make_sample("passkey2", tok, CTX, seed=0)
    with pytest.raises(ValueError, match="too short"):
        make_sample("niah_single", tok, 96, seed=0)


def test_score_is_exact():
    assert score("niah_single", ["123456"], " 123456.")
    assert not score("niah_single", ["123456"], " 12345.")  # a prefix is wrong
    assert not score("niah_single", ["123456"], " 1234567")
    assert not score("niah_single", ["123456"], " 99, then 123456")  # first number counts
    assert score("niah_multivalue", ["111111", "222222"], " 222222 and 111111.")
    assert not score("niah_multivalue", ["111111", "222222"], " 222222 and 11111.")
    assert score("vartrack", ["ABCDE", "FGHIJ"], " ABCDE, VAR FGHIJ")
    assert not score("vartrack", ["ABCDE", "FGHIJ"], " ABCDE, VAR FGHIK")
    assert score("code_line", ["self, code):"], "self, code):`\n\nThe function")
    assert score("code_line", ["self, code):"], " self, code):\nmore")
    assert not score("code_line", ["self, code):"], "self, code, x):`")
    assert not score("code_line", ["self, code):"], "\nself, code):`")  # not on its line
    with pytest.raises(ValueError, match="unknown task"):
        score("nope", ["1"], "1")


def _fake_results():
    rng = np.random.default_rng(1)
    res = {"results": {"2048": {}}}
    for task in ("niah_single", "json_kv"):
        cell = {"samples": 4, "sources": ["code"] * 4, "depths": [0.1] * 4,
                "prompt_tokens": [2000] * 4, "answers": [["1"]] * 4, "arms": {},
                "exact_equals_dense": 1.0}
        ok = rng.random(4) < 0.5
        cell["arms"]["dense"] = {"1": suite._cell(list(ok), ["x"] * 4, 1.0)}
        cell["arms"]["exact"] = {"0.15": suite._cell(list(ok), ["x"] * 4, 1.0)}
        for arm in ("paper", "sfi+succ7"):
            cell["arms"][arm] = {f"{r:g}": suite._cell(list(rng.random(4) < r * 3), ["x"] * 4, 1.0)
                                 for r in (0.05, 0.15)}
        res["results"]["2048"][task] = cell
    res["meta"] = {"model": "m", "machine": "cpu", "commands": ["cmd"], "samples": 4,
                   "contexts": [2048], "tasks": ["niah_single", "json_kv"], "ref_retention": 0.15,
                   "wall_s": 1.0}
    return res


def test_pooled_and_report(tmp_path):
    res = _fake_results()
    cells = res["results"]["2048"]
    k = sum(c["arms"]["paper"]["0.15"]["correct"] for c in cells.values())
    p = suite.pooled(res, "2048", "paper", 0.15)
    assert (p["correct"], p["n"]) == (k, 8)
    assert p["ci95"] == list(wilson_interval(k, 8))
    assert suite.pooled(res, "2048", "oracle", 0.15) is None
    suite.write_report(res, str(tmp_path))
    md = (tmp_path / "retrieval.md").read_text()
    assert "### niah_single" in md and "| sfi+succ7 |" in md and "[" in md
    assert (tmp_path / "retrieval.png").stat().st_size > 1000
    again = json.loads((tmp_path / "retrieval.json").read_text())
    merged = suite.merge([again, again])
    assert merged["results"]["2048"]["json_kv"]["arms"]["paper"] == cells["json_kv"]["arms"]["paper"]
    assert os.path.exists(tmp_path / "retrieval.md")


def test_budget_config_is_equal_budget():
    for arm, (policy, over) in suite.ARMS.items():
        for r in (0.05, 0.1, 0.15, 0.25):
            cfg = suite.budget_config(policy, r, 2048, **over)
            assert cfg.budget == round(r * 2048), (arm, r)
            assert cfg.policy == policy
            for key, v in over.items():  # a recent window is at most half the budget
                if key == "recent_share":  # or a share of it, at most 256
                    assert cfg.n_recent == min(256, round(v * cfg.budget)), (arm, r)
                    continue
                want = min(v, cfg.budget // 2) if key == "n_recent" else v
                assert getattr(cfg, key) == want, (arm, r, key)
    # the paper arm is SFIConfig.paper(); the defaults are one arm's pinned extensions
    from sfi_jax import SFIConfig

    ext = ("successor_radius", "evidence_window")
    paper = suite.budget_config("sfi", 0.15, 2048, **suite.ARMS["paper"][1])
    assert [getattr(paper, f) for f in ext] == [getattr(SFIConfig.paper(), f) for f in ext]
    d = suite.budget_config("sfi", 0.15, 2048, **suite.ARMS[suite.default_arm()][1])
    assert [getattr(d, f) for f in ext] == [getattr(SFIConfig(), f) for f in ext]


def test_script_suite_report_merges_runs(tmp_path):
    """eval_quality.py --suite retrieval --report: merges runs of other arms into one report."""
    import importlib.util
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location(
        "eval_quality_suite", os.path.join(root, "scripts", "eval_quality.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["eval_quality_suite"] = mod
    spec.loader.exec_module(mod)
    a, b = _fake_results(), _fake_results()
    for cell in b["results"]["2048"].values():
        cell["arms"] = {"oracle": cell["arms"]["paper"]}
    paths = []
    for i, r in enumerate((a, b)):
        paths.append(str(tmp_path / f"r{i}.json"))
        json.dump(r, open(paths[-1], "w"))
    res = mod.main(["--suite", "retrieval", "--report", *paths, "--out", str(tmp_path / "o")])
    arms = res["results"]["2048"]["niah_single"]["arms"]
    assert {"dense", "exact", "paper", "sfi+succ7", "oracle"} <= set(arms)
    assert res["meta"]["commands"] == ["cmd", "cmd"]
    assert "| oracle |" in (tmp_path / "o" / "retrieval.md").read_text()
    args = mod.parse_args(["--suite", "retrieval", "--smoke"])
    assert (args.contexts, args.rs_samples, args.arms) == ([1024], 2, ["paper", "sfi+succ7"])


def _whole(number, text):
    return len(re.findall(rf"(?<!\d){re.escape(number)}(?!\d)", text))


def _check_in_haystack(task, s, text):
    """From the prompt's text alone: its question has exactly one answer in its haystack, and it
    is the sample's answer."""
    hay, question = text.rsplit("\n\n", 1)
    if task in ("niah_single", "niah_multikey", "niah_multivalue"):
        key = re.search(r"magic numbers? for (.+?) mentioned", question).group(1)
        found = re.findall(rf"special magic numbers for {re.escape(key)} is: (\d+)\.", hay)
        assert sorted(found) == sorted(s.answers), (found, s.answers)
        for a in s.answers:
            assert _whole(a, hay) == 1, a
    elif task == "vartrack":
        value = re.search(r"assigned the value (\d+) ", question).group(1)
        assign = re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)\.", hay)
        names = [n for n, _ in assign]
        assert len(names) == len(set(names))  # each variable is assigned once
        env = dict(assign)

        def resolve(n, depth=0):
            v = env[n]
            return resolve(v[4:], depth + 1) if v.startswith("VAR ") and depth < 10 else v

        assert sorted(n for n in env if resolve(n) == value) == sorted(s.answers)
        assert _whole(value, hay) == 1
    elif task == "json_kv":
        key = re.search(r'value of the key "(\w+)"', question).group(1)
        pairs = json.loads(hay[hay.index("{"):], object_pairs_hook=list)
        assert [v for k, v in pairs if k == key] == [int(s.answers[0])]
        assert _whole(s.answers[0], hay) == 1
    else:  # code_line: the one line of the haystack that defines the name
        name = re.search(r"that defines `(\w+)`", question).group(1)
        lead = question.split("Answer: `", 1)[1]
        defs = [ln.strip() for ln in hay.split("\n")
                if re.match(rf"\s*(async\s+)?(def|class)\s+{name}\b", ln)]
        assert defs == [lead + s.answers[0]], (defs, lead, s.answers)


@pytest.mark.parametrize("task", TASKS)
def test_fifty_samples_at_2k_each_answer_once(tok, task):
    """The suite's size (50 samples per task at 2K) generates for every task, and each sample's
    answer is, by its prompt's text alone, the one answer in its haystack."""
    n, ctx = 50, 2048
    for i in range(n):
        s = make_sample(task, tok, ctx, seed=0, index=i, depth=0.05 + 0.85 * (i + 0.5) / n)
        assert len(s.prompt_ids) + s.answer_tokens <= ctx
        _check_in_haystack(task, s, tok.decode(s.prompt_ids))


def test_run_suite_shares_each_batch_prefill(tok, monkeypatch):
    """Every arm of a batch gets the batch's shared prefill (a prefill per arm made the suite
    several times slower on a CPU); dense, exact and each arm run once per batch."""
    import sfi_jax

    calls = []

    def fake_generate(model, prompts, *, mode, sfi, max_new_tokens, prefill_fn=None, **kw):
        calls.append((mode, sfi, prefill_fn))
        return sfi_jax.GenerateResult(tokens=[[0] * max_new_tokens for _ in prompts], text=[],
                                      stats={})

    monkeypatch.setattr(sfi_jax, "generate", fake_generate)
    res = suite.run_suite(None, tok, contexts=[1024], tasks=["niah_single"], samples=3,
                          retentions=[0.15], arms=["paper", "sfi+succ7"], batch=2,
                          log=lambda s: None)
    assert len(calls) == 2 * 4  # two batches x (dense, exact, paper, sfi+succ7)
    for batch in (calls[:4], calls[4:]):
        assert {m for m, _, _ in batch} == {"dense", "exact", "sfi"}
        fns = {id(f) for _, _, f in batch}
        assert len(fns) == 1 and batch[0][2] is not None
    assert calls[0][2] is not calls[4][2]  # a new cache per batch
    assert res["results"]["1024"]["niah_single"]["arms"]["paper"]["0.15"]["n"] == 3
