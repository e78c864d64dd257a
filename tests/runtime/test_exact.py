"""Exact mode: SFI fast steps draft, a dense verify step accepts. Greedy tokens equal dense
decoding's (random Qwen3 / Qwen3-MoE, SmolLM2 real weights at several budgets), sampled tokens
follow dense sampling's distribution, and the acceptance bookkeeping adds up."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import sfi_jax
from conftest import (TINY_EOS, assert_close_logits, assert_same_greedy, make_hf_checkpoint,
                      near_tie)
from sfi_jax.runtime.exact import sampling_logits
from sfi_jax.runtime.sampling import SamplingConfig, sample

NEW = 20
TRIGGER = 7


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY_EOS, n).tolist() for n in lengths]


def _same_as_dense(model, exact, prompts, what, **kw):
    """Exact mode's tokens against dense greedy decoding; returns the number of divergences
    at a near-tie of dense's logits (the only ones allowed)."""
    dense = sfi_jax.generate(model, prompts, mode="dense", return_logits=True, **kw)
    ties = 0
    for b, (got, want) in enumerate(zip(exact.tokens, dense.tokens)):
        if got != want:
            i = next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)
            ties += near_tie(dense.stats["logits"][b][i])
        assert_same_greedy(got, want, dense.stats["logits"][b], what=f"{what} row {b}")
    return ties


def _check_counts(stats, tokens):
    drafted, accepted = np.array(stats["drafted"]), np.array(stats["accepted"])
    verify, rejected = np.array(stats["verify_steps"]), np.array(stats["rejected"])
    np.testing.assert_array_equal(drafted, accepted + rejected)
    assert np.all(accepted <= drafted) and np.all(rejected >= 0)
    # each verify step emits the accepted drafts and one more token (EOS can cut the last)
    emitted = np.array([len(t) - 1 for t in tokens])
    assert np.all(emitted <= accepted + verify) and np.all(emitted >= accepted + verify - 1)
    np.testing.assert_array_equal(stats["fast_steps"], drafted)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_greedy_equals_dense_random_models(kind, tiny_qwen3, tmp_path, xla_fast_compile):
    """Ragged batch, a budget far below the context (drafts often rejected), triggers and
    t_max ending drafts early: the tokens are dense decoding's."""
    model = tiny_qwen3.model if kind == "qwen3" else \
        sfi_jax.load_model(make_hf_checkpoint(tmp_path, kind, seed=3)[1], dtype="float32")
    prompts = _prompts([40, 66, 13, 90], seed=1)
    cfg = sfi_jax.SFIConfig(n_sink=2, k_select=8, n_recent=8, t_max=6, draft_len=3,
                            adaptive_draft=False)
    kw = dict(max_new_tokens=NEW, stop_at_eos=False)
    ex = sfi_jax.generate(model, prompts, mode="exact", sfi=cfg, trigger_ids=[TRIGGER], **kw)
    assert _same_as_dense(model, ex, prompts, kind, **kw) == 0
    _check_counts(ex.stats, ex.tokens)
    s = ex.stats
    assert sum(s["rejected"]) > 0 and sum(s["accepted"]) > 0, s
    # every row refreshed at its first verify and again within t_max tokens
    assert all(n >= 2 for n in s["slow_steps"]), s["slow_steps"]


def test_greedy_equals_dense_with_the_matmul_kernel(tiny_qwen3, xla_fast_compile):
    """Drafts and the verify step (several rows per sequence) with the weight-streaming matmul
    kernel (interpret mode), the drafts' epilogues fused (split weights, fused q/k/v, the
    heads kernel: the GPU layout): still dense decoding's tokens (computed with XLA's
    matmuls)."""
    prompts = _prompts([30, 51], seed=2)
    cfg = sfi_jax.SFIConfig(n_sink=2, k_select=8, n_recent=8, t_max=6, draft_len=3,
                            adaptive_draft=False)
    kw = dict(max_new_tokens=6, stop_at_eos=False)
    # a model of its own: split_layers works in place, and tiny_qwen3.model is shared
    split = sfi_jax.load_model(tiny_qwen3.dir, dtype="float32", split_layers=True)
    assert "wqkv" in split.params["layers"][0]
    options = sfi_jax.EngineOptions(matmul="kernel", heads="kernel", epilogue="fused")
    ex = sfi_jax.generate(split, prompts, mode="exact", sfi=cfg, trigger_ids=[TRIGGER],
                          options=options, **kw)
    assert _same_as_dense(tiny_qwen3.model, ex, prompts, "matmul kernel", **kw) == 0
    _check_counts(ex.stats, ex.tokens)


@pytest.mark.slow  # four compiles of a 30-layer model and 32 rows: minutes on a CPU
def test_greedy_equals_dense_smollm2_budgets(smol_model, smol_tokenizer):
    """SmolLM2 real weights, 32 short prompts (ragged), budgets from one covering the context
    to a tiny one; one batched call per budget."""
    base = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time,",
            "The quick brown fox", "In 1969, the first", "import numpy as np\n",
            "Water boils at", "My favourite colour is", "The sun rises in the",
            "Dear Sir or Madam,", "To make a cake you need", "The meaning of life is",
            "for i in range(10):\n", "The Eiffel Tower is located in", "Roses are red,",
            "Q: What is 2 + 2?\nA:"]
    prompts = base + [p + " and" for p in base]
    ids = [smol_tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    kw = dict(max_new_tokens=12, stop_at_eos=False)
    dense = sfi_jax.generate(smol_model, ids, mode="dense", return_logits=True, **kw)
    rates = {}
    for k_select, n_recent in ((64, 32), (4, 4), (1, 2)):
        cfg = sfi_jax.SFIConfig(n_sink=2, k_select=k_select, n_recent=n_recent, draft_len=3,
                                adaptive_draft=False)
        ex = sfi_jax.generate(smol_model, ids, mode="exact", sfi=cfg,
                              tokenizer=smol_tokenizer, **kw)
        for b, (got, want) in enumerate(zip(ex.tokens, dense.tokens)):
            assert_same_greedy(got, want, dense.stats["logits"][b], what=f"k={k_select} row {b}")
        _check_counts(ex.stats, ex.tokens)
        rates[k_select] = sum(ex.stats["accepted"]) / max(1, sum(ex.stats["drafted"]))
    assert rates[64] > 0.95, rates  # the budget covers every context: drafts are dense
    assert rates[1] < rates[64], rates


FORCED_NEW, FORCED_K = 12, 3


def _forced_run(tiny_qwen3, cfg, **extra):
    model, prompts = tiny_qwen3.model, _prompts([30, 45], seed=4)
    kw = dict(max_new_tokens=FORCED_NEW, stop_at_eos=False, trigger_ids=[])
    res = sfi_jax.generate(model, prompts, mode="exact", sfi=cfg, **extra, **kw)
    assert _same_as_dense(model, res, prompts, "forced", **kw) == 0
    _check_counts(res.stats, res.tokens)
    return res.stats


def test_forced_reject_step_counts(tiny_qwen3, xla_fast_compile):
    """accept_rate=0 rejects every draft: one token per verify step, still dense's tokens."""
    n, k = FORCED_NEW, FORCED_K
    cfg = sfi_jax.SFIConfig(n_sink=2, k_select=4, n_recent=4, t_max=64, draft_len=k,
                            adaptive_draft=False)
    s = _forced_run(tiny_qwen3, cfg, accept_rate=0.0)
    assert s["verify_steps"] == [n - 1] * 2 and s["accepted"] == [0, 0]
    # each round drafts min(k, tokens left - 1)
    assert s["drafted"] == [sum(min(k, n - 1 - r - 1) for r in range(n - 1))] * 2


def test_forced_accept_step_counts(tiny_qwen3, xla_fast_compile):
    """A budget covering the context accepts every draft: draft_len + 1 tokens per verify."""
    n, k = FORCED_NEW, FORCED_K
    cfg = sfi_jax.SFIConfig(n_sink=2, k_select=128, n_recent=16, t_max=64, draft_len=k,
                            adaptive_draft=False)
    s = _forced_run(tiny_qwen3, cfg)
    rounds = -(-(n - 1) // (k + 1))
    assert s["verify_steps"] == [rounds] * 2 and s["rejected"] == [0, 0]
    assert s["accepted"] == [n - 1 - rounds] * 2 and s["acceptance_rate"] == [1.0, 1.0]
    assert s["mean_accepted_length"] == [(n - 1 - rounds) / rounds] * 2


def test_sampling_transform_is_the_dense_one():
    """Speculative acceptance compares the distributions `sample` draws from."""
    import jax

    logits = jax.random.normal(jax.random.key(0), (64, 50)) * 3
    for cfg in (SamplingConfig(0.7, 0.9, 0), SamplingConfig(1.3, 1.0, 5),
                SamplingConfig(0.5, 0.6, 7)):
        for s in range(3):
            key = jax.random.key(s)
            got = jax.random.categorical(key, sampling_logits(logits, cfg), axis=-1)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(sample(logits, key, cfg)))


def test_sampled_tokens_follow_dense_distribution(tiny_qwen3):
    """Temperature 0.7 with top-p 0.9: the first verified token (the second new one) of 2000
    rows against its dense distribution, summed over the first token from forward passes
    (chi-square)."""
    import jax

    model = tiny_qwen3.model
    prompt = _prompts([24], seed=11)[0]
    n = 2000
    samp = SamplingConfig(temperature=0.7, top_p=0.9)
    cfg = sfi_jax.SFIConfig(n_sink=1, k_select=2, n_recent=2, draft_len=2,
                            adaptive_draft=False, refresh_rows=1,
                            policy="tmax")
    toks, rejected = [], 0
    for seed in range(n // 100):  # batches of 100 rows keep the prefill's memory small
        ex = sfi_jax.generate(model, [prompt] * 100, mode="exact", sfi=cfg, max_new_tokens=3,
                              temperature=0.7, top_p=0.9, stop_at_eos=False, seed=seed)
        toks += [t[:3] for t in ex.tokens]
        rejected += sum(ex.stats["rejected"])
    toks = np.array(toks)
    assert rejected > 0.05 * n, rejected  # the rejection path is exercised

    def probs(logits):
        return np.asarray(jax.nn.softmax(sampling_logits(jax.numpy.asarray(logits), samp), -1),
                          np.float64)

    p1 = probs(np.asarray(sfi_jax.forward(model, np.array([prompt])))[:, -1])[0]
    firsts = np.nonzero(p1)[0]
    seq = np.array([prompt + [int(a)] for a in firsts])
    p2 = probs(np.asarray(sfi_jax.forward(model, seq))[:, -1])  # [len(firsts), V]
    # the marginal of token 2 (the first verified one: an accepted draft or a resampled token)
    p_tok2 = (p1[firsts, None] * p2).sum(axis=0)
    counts = np.bincount(toks[:, 1], minlength=p_tok2.shape[0]).astype(np.float64)
    exp = n * p_tok2
    assert counts[exp == 0].sum() == 0
    big = exp >= 5  # pool the small cells into one
    obs, ex_ = counts[big], exp[big]
    if exp[~big].sum() > 0:
        obs, ex_ = np.append(obs, counts[~big].sum()), np.append(ex_, exp[~big].sum())
    assert big.sum() >= 20, big.sum()
    chi2 = float(np.sum((obs - ex_) ** 2 / ex_))
    dof = len(obs) - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)


@pytest.mark.parametrize("kw, match", [
    (dict(forced_tokens=np.zeros((1, 4), np.int32)), "forced_tokens"),
    (dict(return_logits=True), "return_logits"),
    (dict(accept_rate=1.5), "accept_rate"),
    (dict(sfi=sfi_jax.SFIConfig(evidence_window=2)), "evidence_window"),
])
def test_exact_mode_bad_input(tiny_qwen3, kw, match):
    with pytest.raises(ValueError, match=match):
        sfi_jax.generate(tiny_qwen3.model, [[1, 2, 3]], max_new_tokens=4, mode="exact", **kw)


def test_draft_len_bounds(tiny_qwen3):
    with pytest.raises(ValueError, match="draft_len"):
        sfi_jax.SFIConfig(draft_len=16)
    with pytest.raises(ValueError, match="draft_len"):
        sfi_jax.SFIConfig(draft_len=0)
    with pytest.raises(ValueError, match="accept_rate"):
        sfi_jax.generate(tiny_qwen3.model, [[1]], max_new_tokens=2, mode="dense",
                         accept_rate=0.5)


# ---------------------------------------------------------------- adaptive draft lengths

def _draft_length_reference(accept, ctx, live, cfg, sfi, db, overhead):
    """Plain Python: the d in 0..draft_len with the most expected tokens of the live rows per
    round (1 + a + ... + a^d each) per dense-step cost (d fast steps + one verify + the
    overhead; 0: one dense step), from the bytes each step reads for the whole batch."""
    h = cfg.hidden_size
    weights = (cfg.param_count() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * h)) * db
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * db
    rows = [(min(float(a), 0.999), int(c)) for a, c, x in zip(accept, ctx, live) if x]
    fast = (weights + kv * sum(min(c, sfi.budget) for _, c in rows)) / \
        (weights + kv * sum(c for _, c in rows))
    speed = [sum(sum(a ** i for i in range(d + 1)) for a, _ in rows)
             / ((1 + overhead + d * fast) if d else 1.0) for d in range(sfi.draft_len + 1)]
    return max(range(len(speed)), key=lambda d: (round(speed[d], 6), -d))


def test_draft_length_follows_acceptance_and_cost():
    from sfi_jax.models import PRESETS
    from sfi_jax.runtime.exact import ROUND_OVERHEAD, draft_length

    cfg, sfi = PRESETS["qwen3-4b"], sfi_jax.SFIConfig(draft_len=8)
    rng = np.random.default_rng(0)
    seen = set()
    for trial in range(40):
        B = int(rng.integers(1, 9))
        accept = rng.choice([0.0, 0.05, 0.2, 0.5, 0.78, 0.95, 1.0], B).astype(np.float32)
        ctx = rng.choice([1000, 2000, 8192, 32768, 131072], B).astype(np.int32)
        live = rng.random(B) < 0.8
        live[0] = True
        got = int(draft_length(accept, ctx, live, cfg=cfg, sfi=sfi, dtype_bytes=2))
        want = _draft_length_reference(accept, ctx, live, cfg, sfi, 2, ROUND_OVERHEAD)
        assert got == want, (accept, ctx, live, got, want)
        seen.add(got)
    assert len(seen) >= 3, seen  # the cases cover short, long and no drafts

    def one(a, c, n=1):
        return int(draft_length(np.full(n, a, np.float32), np.full(n, c, np.int32),
                                np.ones(n, bool), cfg=cfg, sfi=sfi, dtype_bytes=2))

    assert one(0.0, 131072) == 0 and one(0.95, 2000) == 0  # no acceptance; inside the budget
    assert [one(a, 131072, 6) for a in (0.0, 0.5, 0.78, 1.0)] == sorted(
        one(a, 131072, 6) for a in (0.0, 0.5, 0.78, 1.0))
    assert one(1.0, 131072, 6) == 8
    # one row that accepts everything among rows that accept nothing: the batch does not
    # draft for it alone at a short context, where fast steps cost nearly a dense step
    mixed = np.array([1.0] + [0.0] * 7, np.float32)
    assert int(draft_length(mixed, np.full(8, 8192, np.int32), np.ones(8, bool), cfg=cfg,
                            sfi=sfi, dtype_bytes=2)) == 0


@pytest.mark.parametrize("accept_rate, short", [(0.0, True), (1.0, False)])
def test_adaptive_drafts_shrink_when_rejected_and_grow_when_accepted(tiny_qwen3, accept_rate,
                                                                      short, xla_fast_compile):
    """Rejected drafts make rows stop drafting (a plain dense step per round, with a rare
    probe), accepted ones make them draft the whole draft_len. (Four rows of ~400 positions:
    a fast step reads about a third of a verify's bytes, so drafting pays at the prior; no
    warm-up, whose refreshes every 4 steps would cut the drafts, whatever the default.)"""
    model, prompts = tiny_qwen3.model, _prompts([380, 400, 390, 410], seed=5)
    cfg = sfi_jax.SFIConfig(n_sink=2, k_select=4, n_recent=4, t_max=64, draft_len=4,
                            warmup_steps=0)
    res = sfi_jax.generate(model, prompts, mode="exact", sfi=cfg, max_new_tokens=40,
                           stop_at_eos=False, trigger_ids=[], accept_rate=accept_rate)
    drafted, verify = np.array(res.stats["drafted"]), np.array(res.stats["verify_steps"])
    if short:
        assert (drafted <= verify / 4).all(), (drafted, verify)
    else:
        assert (drafted >= 3 * verify).all(), (drafted, verify)


@pytest.mark.parametrize("extra", [{}, {"selection_memory": 0.5, "warmup_steps": 8}],
                         ids=["defaults", "memory"])
def test_adaptive_drafts_give_dense_tokens(tiny_qwen3, extra, xla_fast_compile):
    prompts = _prompts([70, 33], seed=6)
    cfg = sfi_jax.SFIConfig(n_sink=2, k_select=6, n_recent=6, t_max=6, draft_len=3, **extra)
    kw = dict(max_new_tokens=16, stop_at_eos=False)
    ex = sfi_jax.generate(tiny_qwen3.model, prompts, mode="exact", sfi=cfg,
                          trigger_ids=[TRIGGER], **kw)
    assert _same_as_dense(tiny_qwen3.model, ex, prompts, "adaptive", **kw) == 0
    _check_counts(ex.stats, ex.tokens)


def test_rows_that_stop_drafting_take_a_whole_chunk_of_dense_steps(tiny_qwen3, monkeypatch,
                                                                    xla_fast_compile):
    """Once no row drafts, a device call runs draft_len + 1 plain dense steps per round of its
    budget (as many steps as the decode loop's chunk), not one: exact mode at acceptance 0
    makes as few device calls as dense decoding."""
    from sfi_jax.runtime.decoder import SlotDecoder

    calls = []
    step = SlotDecoder.step
    monkeypatch.setattr(SlotDecoder, "step", lambda self: (calls.append(1), step(self))[1])
    model, prompts = tiny_qwen3.model, _prompts([380, 400], seed=5)
    cfg = sfi_jax.SFIConfig(n_sink=2, k_select=4, n_recent=4, t_max=64, draft_len=3)
    res = sfi_jax.generate(model, prompts, mode="exact", sfi=cfg, max_new_tokens=65,
                           stop_at_eos=False, trigger_ids=[], accept_rate=0.0)
    assert [len(t) for t in res.tokens] == [65, 65]
    dense_calls = -(-64 // 16)  # the first token comes from the prefill; 16 steps per call
    assert len(calls) <= dense_calls + 1, (len(calls), res.stats["verify_steps"])


def test_rows_past_their_refresh_draft_again_when_acceptance_returns(tiny_qwen3, monkeypatch,
                                                                    xla_fast_compile):
    """Rows that run plain dense steps past t_max (no verify refreshes them there) are not
    locked out of drafting: once the estimate says drafts pay, the next round's verify
    refreshes them and they draft. (Prior 0 and a fast drift make the dense stretch short.)"""
    from sfi_jax.runtime import exact

    monkeypatch.setattr(exact, "ACCEPT_PRIOR", 0.0)
    monkeypatch.setattr(exact, "ACCEPT_DRIFT", 0.1)
    model, prompts = tiny_qwen3.model, _prompts([380, 400], seed=7)
    # (a config no other test compiles: the patched constants are read when tracing)
    cfg = sfi_jax.SFIConfig(n_sink=2, k_select=4, n_recent=4, t_max=5, draft_len=2)
    res = sfi_jax.generate(model, prompts, mode="exact", sfi=cfg, max_new_tokens=48,
                           stop_at_eos=False, trigger_ids=[], accept_rate=1.0)
    drafted, verify = np.array(res.stats["drafted"]), np.array(res.stats["verify_steps"])
    assert (drafted >= 16).all(), (drafted, verify)


def test_verify_keeps_each_refreshed_rows_logits_at_its_draft_end(tiny_qwen3, xla_fast_compile):
    """The verify writes the refresh slots' logits at each row's draft end (select_query) into
    the slot that refreshes it: every slot of a batch verify equals that row verified alone
    (batch 1, where no slot mapping can go wrong). An empty slot's logits are never read."""
    import jax
    import jax.numpy as jnp

    from sfi_jax.models.modeling import WeightLayout
    from sfi_jax.options import EngineOptions
    from sfi_jax.runtime import exact

    model, cfg = tiny_qwen3.model, tiny_qwen3.model.config
    params = model.params
    L, Hkv, D, Hq, S, B, T = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, \
        cfg.num_q_heads, 64, 3, 4
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.normal(size=(L, B, Hkv, S, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(L, B, Hkv, S, D)), jnp.float32)
    norms = jnp.zeros((L, B, Hkv, S), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, TINY_EOS, (B, T)), jnp.int32)
    q_start = jnp.asarray([20, 33, 9], jnp.int32)
    m = jnp.asarray([2, 0, 3], jnp.int32)  # each row's draft length
    kv_len = q_start + m + 1
    kw = dict(cfg=cfg, layout=WeightLayout.of(params["layers"]),
              options=EngineOptions().resolved())
    verify = jax.jit(functools.partial(exact._verify, params, **kw))

    def run(rows, slots, buf):
        r = jnp.asarray(rows)
        return verify(k[:, r], v[:, r], norms[:, r], tokens[r], q_start[r], kv_len[r],
                      jnp.asarray(slots, jnp.int32), exact.select_query(m[r]), buf)[-1]

    empty = jnp.full((L, 2, Hq, S), 7.0, jnp.float32)
    buf = run([0, 1, 2], [2, B], empty)  # row 2 in slot 0, slot 1 empty
    alone = run([2], [0], jnp.zeros((L, 1, Hq, S), jnp.float32))
    assert_close_logits(buf[:, 0], alone[:, 0], 1e-5)
    buf = run([0, 1, 2], [0, 1], empty)  # rows 0 and 1
    for j in (0, 1):
        alone = run([j], [0], jnp.zeros((L, 1, Hq, S), jnp.float32))
        assert_close_logits(buf[:, j], alone[:, 0], 1e-5)
    # the draft end's query sees its own key: row 0's logits are finite up to q_start + m
    finite = np.isfinite(np.asarray(buf[0, 0, 0]))
    assert finite[:22].all() and not finite[23:].any()
