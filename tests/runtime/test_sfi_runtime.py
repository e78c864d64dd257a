"""SFI decoding: equal to dense when the budget covers the context, per-row slow/fast decisions
that follow SFI_METHOD.md §3, refresh policies and refresh slots."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sfi_jax
from conftest import TINY_EOS, assert_same_greedy, fast_compile, hf_masked_logits, rel_err
from sfi_reference import assert_positions, sfi_reference
from sfi_jax.models.config import PRESETS
from sfi_jax.models.params import random_params
from sfi_jax.runtime import decode
from sfi_jax.runtime.sampling import SamplingConfig
from sfi_jax.runtime.state import DecodeState, empty_sfi_state
from sfi_jax.selector import trigger_token_ids

SMALL = sfi_jax.SFIConfig.paper(n_sink=2, k_select=8, n_recent=8, t_max=8)  # the reference's method
NEW = 16  # new tokens per row in the tiny-model tests (15 decode steps)
TRIGGER = 7
SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):\n",
                "Once upon a time, in a small village,"]


def expected_timeline(fed, triggers, t_max, use_triggers=True, warmup_steps=0,
                      warmup_t_max=None):
    """Slow flags per decode step from SFI_METHOD.md §3 (and §8's warm-up: the interval that
    step s - 1 ends with is warmup_t_max while s - 1 < warmup_steps). fed[s] is the token
    decode step s feeds (the token generated at the previous step; fed[0] comes from the
    prefill)."""
    out, last = np.zeros(len(fed), bool), None
    for s, tok in enumerate(fed):
        interval = warmup_t_max if s - 1 < warmup_steps else t_max
        out[s] = (s == 0 or (use_triggers and int(tok) in triggers)
                  or s - last >= min(interval, t_max))
        if out[s]:
            last = s
    return out


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY_EOS, n).tolist() for n in lengths]


def _forced_with_triggers(rows, seed=5):
    """Teacher-forced tokens [3, NEW] without triggers or EOS, plus triggers at chosen indices."""
    forced = np.random.default_rng(seed).integers(10, 250, (3, NEW)).astype(np.int32)
    for b, idx in enumerate(rows):
        forced[b, idx] = TRIGGER
    return forced


# trigger token indices (into the generated tokens) per row
TRIGGER_AT = ([3, 12], [5], [1, 2, 14])
LONG = [60, 66, 72]


# the per-row runs' policies; tmax runs with a single refresh slot per step (see
# test_tmax_one_refresh_slot); t_max = 1 makes every step slow
POLICY_RUNS = {"sfi": SMALL, "t_max=1": dataclasses.replace(SMALL, t_max=1),
               "warmup": dataclasses.replace(SMALL, warmup_steps=6, warmup_t_max=2)}
# the warm-up's refreshes, remembering what the selection in force was chosen with
POLICY_RUNS["memory"] = dataclasses.replace(POLICY_RUNS["warmup"], selection_memory=0.5)
POLICY_RUNS.update({policy: dataclasses.replace(SMALL, policy=policy,
                                                refresh_rows=1 if policy == "tmax" else None)
                    for policy in ("tmax", "streaming", "prefill_only", "oracle")})


@pytest.fixture(scope="module")
def per_row_runs(tiny_qwen3):
    """The three-row batch with triggers at different steps, under several policies, with the
    selection in force at the end (diagnostics)."""
    prompts = _prompts(LONG, seed=9)
    forced = _forced_with_triggers(TRIGGER_AT)
    runs = {}
    with fast_compile():  # the tiny model's programs (conftest.py)
        for name, cfg in POLICY_RUNS.items():
            runs[name] = sfi_jax.generate(tiny_qwen3.model, prompts, max_new_tokens=NEW,
                                          sfi=cfg, trigger_ids=[TRIGGER], forced_tokens=forced,
                                          stop_at_eos=False, return_logits=True,
                                          diagnostics=True)
        runs["dense"] = sfi_jax.generate(tiny_qwen3.model, prompts, max_new_tokens=NEW,
                                         mode="dense", forced_tokens=forced, stop_at_eos=False,
                                         return_logits=True)
    return prompts, forced, runs


# ---------------------------------------------------------------- full budget = dense

LONG_TEXT = ("The library opens at nine. Visitors may borrow up to five books; fines are small. "
             "On weekends the reading room closes early, and the archive is shut. ") * 2


def test_smollm2_full_budget_rows_equal_dense_and_long_row_is_sparse(smol_model, smol_tokenizer):
    """One batch: three short rows whose context fits the budget (n_sink + k_select + n_recent
    = 40 >= prompt + 24 new tokens) decode exactly as dense; a 70-token row goes sparse."""
    tok = smol_tokenizer
    long_ids = tok(LONG_TEXT, add_special_tokens=False)["input_ids"]
    short_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in SMOL_PROMPTS]
    assert len(long_ids) > 60 and max(map(len, short_ids)) + 24 <= 40
    cfg = sfi_jax.SFIConfig(n_sink=4, k_select=16, n_recent=20)
    kw = dict(max_new_tokens=24, tokenizer=tok, stop_at_eos=False)
    sfi = sfi_jax.generate(smol_model, short_ids + [long_ids], mode="sfi", sfi=cfg,
                           return_logits=True, **kw)
    # the dense reference: the same short prompts (a batch of them alone), and a plain forward
    # pass over the long prompt followed by the tokens SFI generated for it
    dense = sfi_jax.generate(smol_model, SMOL_PROMPTS, mode="dense", **kw)
    if sfi.tokens[:3] != dense.tokens:  # only then are the reference logits needed
        ref = sfi_jax.generate(smol_model, SMOL_PROMPTS, mode="dense", return_logits=True, **kw)
        for b in range(3):
            assert_same_greedy(sfi.tokens[b], dense.tokens[b], ref.stats["logits"][b],
                               what=f"prompt {b}")
    assert sfi.text[:3] == dense.text
    full = np.asarray([long_ids + sfi.tokens[3][:-1]])
    ref_long = np.asarray(sfi_jax.forward(smol_model, full))[0, len(long_ids) - 1:]
    lg = sfi.stats["logits"][3]
    assert np.all(np.isfinite(lg))
    # prefill and the first decode step (slow) are dense; later fast steps read 40 positions
    np.testing.assert_allclose(lg[:2], ref_long[:2], rtol=0, atol=2e-3)
    assert np.max(np.abs(lg[2:] - ref_long[2:])) > 1e-2

    # slow steps follow the tokenizer's trigger set and t_max (64) in every row
    triggers = set(trigger_token_ids(tok).tolist())
    timeline = sfi.stats["slow_timeline"]
    assert timeline.shape == (4, 23)
    for b in range(4):
        want = expected_timeline(sfi.tokens[b][:23], triggers, cfg.t_max,
                                 warmup_steps=cfg.warmup_steps, warmup_t_max=cfg.warmup_t_max)
        np.testing.assert_array_equal(timeline[b], want, err_msg=f"row {b}")
    assert sfi.stats["slow_steps"] == timeline.sum(1).tolist()
    assert [s + f for s, f in zip(sfi.stats["slow_steps"], sfi.stats["fast_steps"])] == [23] * 4
    assert timeline[1].sum() > 1  # "def fibonacci(n):\n" goes on with newlines


def test_full_budget_equals_dense_tiny_qwen3(tiny_qwen3, xla_fast_compile):
    prompts = _prompts([5, 17, 40], seed=1)
    cfg = sfi_jax.SFIConfig(n_sink=4, k_select=36, n_recent=16, t_max=4)
    assert cfg.budget == 40 + NEW  # exactly the longest context
    kw = dict(max_new_tokens=NEW, stop_at_eos=False, return_logits=True)
    dense = sfi_jax.generate(tiny_qwen3.model, prompts, mode="dense", **kw)
    # (diagnostics keep the SFI program: with every row within the budget generate would
    # otherwise run the dense program, what this test compares with)
    sfi = sfi_jax.generate(tiny_qwen3.model, prompts, mode="sfi", sfi=cfg,
                           trigger_ids=list(range(0, 256, 5)), diagnostics=True, **kw)
    assert sfi.stats["decode_path"] == "sfi"
    for b in range(3):
        assert_same_greedy(sfi.tokens[b], dense.tokens[b], dense.stats["logits"][b],
                           what=f"row {b}")
    np.testing.assert_allclose(sfi.stats["logits"], dense.stats["logits"], rtol=0, atol=1e-5)
    assert min(sfi.stats["slow_steps"]) >= 4  # t_max = 4 over 15 steps


# ---------------------------------------------------------------- small budget

def test_small_budget_runs_and_differs(per_row_runs):
    _, _, runs = per_row_runs
    sfi, dense = runs["sfi"], runs["dense"]
    steps = NEW - 1
    assert sfi.stats["decode_steps"] == steps
    lg = sfi.stats["logits"]
    assert lg.shape == (3, NEW, 256) and np.all(np.isfinite(lg))
    assert [len(t) for t in sfi.tokens] == [NEW] * 3
    slow, fast = np.asarray(sfi.stats["slow_steps"]), np.asarray(sfi.stats["fast_steps"])
    assert np.all(slow + fast == steps) and np.all(slow >= 1) and np.all(fast >= 1)
    # the first new token comes from the (dense) prefill in both modes
    np.testing.assert_allclose(lg[:, 0], dense.stats["logits"][:, 0], rtol=0, atol=1e-5)
    # fast steps read 2 + 8 + 8 of 60+ positions: the logits move away from dense
    assert np.max(np.abs(lg[:, 1:] - dense.stats["logits"][:, 1:])) > 1e-3
    # decode step 0 is slow for every row and reads a cache written by the dense prefill, so
    # its token's logits are the dense ones
    assert sfi.stats["slow_timeline"][:, 0].all()
    np.testing.assert_allclose(lg[:, 1], dense.stats["logits"][:, 1], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- per-row decisions

def test_per_row_timeline_follows_the_rules(per_row_runs):
    _, forced, runs = per_row_runs
    res = runs["sfi"]
    timeline = res.stats["slow_timeline"]
    assert timeline.shape == (3, NEW - 1)
    for b in range(3):
        assert res.tokens[b] == forced[b].tolist()
        want = expected_timeline(forced[b, :NEW - 1], {TRIGGER}, SMALL.t_max)
        np.testing.assert_array_equal(timeline[b], want, err_msg=f"row {b}")
    # the rows' decisions really differ from each other
    assert len({tuple(t) for t in timeline.tolist()}) == 3
    assert res.stats["slow_steps"] == timeline.sum(1).tolist()
    assert res.stats["fast_steps"] == (NEW - 1 - timeline.sum(1)).tolist()
    # the warm-up: every other step slow during a row's first 6 steps, then t_max = 8
    warm = runs["warmup"].stats["slow_timeline"]
    for b in range(3):
        want = expected_timeline(forced[b, :NEW - 1], {TRIGGER}, SMALL.t_max, warmup_steps=6,
                                 warmup_t_max=2)
        np.testing.assert_array_equal(warm[b], want, err_msg=f"warm-up, row {b}")
        assert want[:7].sum() >= 4 and not np.array_equal(want, timeline[b])


def test_per_row_equals_row_alone(tiny_qwen3, per_row_runs, xla_fast_compile):
    prompts, forced, runs = per_row_runs
    batch = runs["sfi"]
    for b in range(3):
        alone = sfi_jax.generate(tiny_qwen3.model, [prompts[b]], max_new_tokens=NEW, sfi=SMALL,
                                 trigger_ids=[TRIGGER], forced_tokens=forced[b:b + 1],
                                 stop_at_eos=False, return_logits=True)
        assert alone.tokens[0] == batch.tokens[b]
        np.testing.assert_array_equal(alone.stats["slow_timeline"][0],
                                      batch.stats["slow_timeline"][b])
        np.testing.assert_allclose(batch.stats["logits"][b], alone.stats["logits"][0], rtol=0,
                                   atol=1e-5, err_msg=f"row {b}")


@pytest.mark.parametrize("policy", ["streaming", "prefill_only"])
def test_policies_without_slow_steps(per_row_runs, policy):
    _, _, runs = per_row_runs
    res = runs[policy]
    assert not res.stats["slow_timeline"].any()
    assert res.stats["slow_steps"] == [0, 0, 0]
    assert res.stats["fast_steps"] == [NEW - 1] * 3
    assert np.all(np.isfinite(res.stats["logits"]))
    dense = runs["dense"].stats["logits"]
    assert np.max(np.abs(res.stats["logits"][:, 1:] - dense[:, 1:])) > 1e-3


def test_streaming_matches_a_masked_reference(tiny_qwen3, per_row_runs):
    """policy="streaming" attends to the sink, the last n_recent positions and the current
    one; transformers with that attention mask (dense over the prompt) gives the same logits."""
    prompts, forced, runs = per_row_runs
    lg = runs["streaming"].stats["logits"]
    for b, prompt in enumerate(prompts):
        seq = prompt + forced[b, :NEW - 1].tolist()
        n, P = len(seq), len(prompt)
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        allowed = (j <= i) & ((i < P) | (j < SMALL.n_sink) | (j >= i - SMALL.n_recent))
        ref = hf_masked_logits(tiny_qwen3.hf, seq, allowed)[P - 1:]
        assert rel_err(lg[b], ref) < 1e-4, f"row {b}"
        dense_ref = hf_masked_logits(tiny_qwen3.hf, seq, j <= i)[P - 1:]
        assert rel_err(dense_ref, ref) > 1e-3  # the mask matters here


@pytest.mark.parametrize("name", list(POLICY_RUNS))
def test_policy_matches_the_reference(tiny_qwen3, per_row_runs, name):
    """Each policy's logits equal transformers' with SFI's attention sets (per layer and KV
    head), whose selections the float64 selector of SFI_METHOD.md §4 makes from transformers'
    own queries and keys (tests/sfi_reference.py); the selection in force at the end equals
    the reference's. Slow steps are taken from the run (test_per_row_timeline_follows_the_rules
    and test_tmax_one_refresh_slot check them)."""
    prompts, forced, runs = per_row_runs
    res, cfg = runs[name], POLICY_RUNS[name]
    dense = runs["dense"].stats["logits"]
    for b, prompt in enumerate(prompts):
        seq = prompt + forced[b, :NEW - 1].tolist()
        ref = sfi_reference(tiny_qwen3.hf, seq, len(prompt), cfg,
                            slow=res.stats["slow_timeline"][b])
        assert rel_err(res.stats["logits"][b], ref.logits) < 1e-4, f"row {b}"
        for l, want in enumerate(ref.final):
            assert_positions(res.stats["selected_positions"][l, b], want, len(seq), cfg,
                             what=f"row {b} layer {l}")
        if name == "t_max=1":  # every step slow, so dense
            assert res.stats["slow_timeline"][b].all()
            assert rel_err(ref.logits, dense[b]) < 1e-4
        else:  # the attended sets matter
            assert rel_err(ref.logits[1:], dense[b, 1:]) > 1e-3


def test_selection_memory_changes_what_refreshes_keep(per_row_runs):
    """The same slow steps with and without the selection memory (test_policy_matches_the_
    reference checks both selections against transformers), yet other positions held at the
    end: the memory is what kept them."""
    _, _, runs = per_row_runs
    warm, memory = runs["warmup"].stats, runs["memory"].stats
    np.testing.assert_array_equal(memory["slow_timeline"], warm["slow_timeline"])
    assert np.any(memory["selected_positions"] != warm["selected_positions"])


def test_policy_oracle_all_slow(per_row_runs):
    _, _, runs = per_row_runs
    res = runs["oracle"]
    assert res.stats["slow_timeline"].all()
    assert res.stats["slow_steps"] == [NEW - 1] * 3
    assert res.stats["fast_steps"] == [0, 0, 0]
    assert np.all(np.isfinite(res.stats["logits"]))


def test_streaming_and_prefill_only_differ(per_row_runs):
    """Sink-only buffers and the prefill selection are different attended sets."""
    _, _, runs = per_row_runs
    a, b = runs["streaming"].stats["logits"], runs["prefill_only"].stats["logits"]
    assert np.max(np.abs(a[:, 1:] - b[:, 1:])) > 1e-4


def test_tmax_one_refresh_slot(per_row_runs):
    """policy="tmax" with refresh_rows=1: all three rows want a slow step at step 0; one slot
    per step serves one row per step and the others wait; t_max then counts from each row's
    own slow step, and the trigger tokens placed in every row change nothing."""
    _, _, runs = per_row_runs
    res = runs["tmax"]
    timeline = res.stats["slow_timeline"]
    assert timeline.shape == (3, NEW - 1)
    assert timeline.sum(0).max() == 1  # at most one refreshed row per step
    first = [int(np.flatnonzero(timeline[b])[0]) for b in range(3)]
    assert sorted(first) == [0, 1, 2]
    for b in range(3):
        want = np.zeros(NEW - 1, bool)
        want[[first[b], first[b] + 8]] = True
        np.testing.assert_array_equal(timeline[b], want, err_msg=f"row {b}")
    assert res.stats["slow_steps"] == [2, 2, 2]
    assert np.all(np.isfinite(res.stats["logits"]))


# ---------------------------------------------------------------- GPU kernels in the loop

def _compiles_its_own_program(options, run):
    """run() compiles a decode program for `options` (resolved), which no earlier call had."""
    from sfi_jax.runtime.generation import decode_programs

    want = options.resolved()
    before = decode_programs()
    out = run()
    new = [p for key, p in decode_programs().items() if key not in before]
    assert [p["options"] for p in new] == [want]
    return out


@pytest.mark.parametrize("refresh, repack", [("unconditional", "xla"), ("cond", "xla"),
                                             ("unconditional", "kernel")],
                         ids=["unconditional", "cond", "repack-kernel"])
def test_gpu_kernels_in_the_decode_loop(tiny_qwen3, per_row_runs, refresh, repack,
                                        xla_fast_compile):
    """The Triton kernels (interpret mode) in the decode loop: the refresh slots' dense read
    runs every step and writes the logits straight into the scratch buffer (the GPU default),
    or behind a condition (refresh="cond"), with the repack kernel (the GPU default) or the XLA
    repack, and the selector's scores kernel; each compiles its own program and all give the
    xla path's logits."""
    prompts, forced, runs = per_row_runs
    options = sfi_jax.EngineOptions(attention="pallas_gpu", selector_scores="pallas_gpu",
                                    refresh=refresh, repack=repack)
    got = _compiles_its_own_program(options, lambda: sfi_jax.generate(
        tiny_qwen3.model, prompts, max_new_tokens=NEW, sfi=SMALL, trigger_ids=[TRIGGER],
        forced_tokens=forced, stop_at_eos=False, return_logits=True, options=options))
    want = runs["sfi"]
    assert got.stats["slow_steps"] == want.stats["slow_steps"]
    assert rel_err(got.stats["logits"], want.stats["logits"]) < 1e-4


# slow: test_exact's matmul-kernel test runs the same fused layout (split weights, fused q/k/v,
# the heads kernel, fused epilogues) in the default suite; `-m gpu` runs it compiled on a GPU
@pytest.mark.slow
def test_gpu_kernels_with_fused_heads_in_the_decode_loop(tiny_qwen3, per_row_runs):
    """Split weights with the fused q/k/v matmul (the GPU layout) and every Triton kernel
    (interpret mode), the heads' norm + rope kernel and the top-k's radix-search kernel
    included (the GPU defaults): the xla path's logits, in SFI and in dense decoding.
    It compiles with XLA's full optimisations (not `fast_compile`): with
    jax_disable_most_optimizations the decode loop's top-k by the radix kernel (interpret mode)
    kept 7 of 8 positions in one call, though the kernel's k-th keys equal the jnp radix
    search's inside the same program and eager calls on the same scores are right with and
    without the flag (an interpret-mode / XLA CPU artifact; on the GPU the engine check runs
    this path)"""
    prompts, forced, runs = per_row_runs
    split = sfi_jax.load_model(tiny_qwen3.dir, dtype="float32", split_layers=True)
    assert "wqkv" in split.params["layers"][0] and "wo" in split.params["layers"][0]
    gpu_defaults = sfi_jax.EngineOptions().resolved(platform="gpu")
    assert gpu_defaults.heads == "kernel" and gpu_defaults.selector_topk == "radix_kernel"
    # the weight matmuls' kernel for every row count (by_shape takes it up to 4 rows)
    gpu_defaults = dataclasses.replace(gpu_defaults, matmul="kernel")
    kw = dict(max_new_tokens=NEW, forced_tokens=forced, stop_at_eos=False, return_logits=True,
              options=gpu_defaults)
    sfi = sfi_jax.generate(split, prompts, sfi=SMALL, trigger_ids=[TRIGGER], **kw)
    dense = sfi_jax.generate(split, prompts, mode="dense", **kw)
    for got, want in ((sfi, runs["sfi"]), (dense, runs["dense"])):
        assert got.stats.get("slow_steps") == want.stats.get("slow_steps")
        assert rel_err(got.stats["logits"], want.stats["logits"]) < 1e-4


# "kernel" (not a default anywhere) is slow here; tests/kernels checks it against ragged_dot
@pytest.mark.parametrize("moe", [pytest.param("kernel", marks=pytest.mark.slow), "tokens"])
def test_moe_kernels_in_the_decode_loop(moe, xla_fast_compile):
    """A tiny random Qwen3-MoE (expert dims multiples of 64) decoded with every Triton kernel
    (interpret mode) and the expert kernels (moe="kernel": expert-sorted rows; "tokens":
    per-expert tiles of all tokens, what "auto" resolves to with the GPU kernels), each its own
    program: the xla path's logits, in SFI and in dense decoding."""
    from sfi_jax.models.config import ModelConfig
    from sfi_jax.models.modeling import Model
    from sfi_jax.models.params import random_params

    cfg = ModelConfig(name="tiny-moe", num_layers=2, hidden_size=64, intermediate_size=128,
                      num_q_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256,
                      max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=64)
    # (the K-major layout: its output projection takes that kernel in the decode loop)
    model = Model(cfg, random_params(cfg, "float32", seed=3)).split_layers(fuse_qkv=True,
                                                                           k_major=True)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (30, 41, 26)]
    kw = dict(max_new_tokens=12, stop_at_eos=False, return_logits=True, trigger_ids=[TRIGGER],
              sfi=SMALL)
    xla = sfi_jax.EngineOptions(attention="xla", selector_scores="pallas_gpu")
    want = {m: sfi_jax.generate(model, prompts, mode=m, options=xla, **kw)
            for m in ("sfi", "dense")}
    options = sfi_jax.EngineOptions(attention="pallas_gpu", selector_scores="pallas_gpu",
                                    moe=moe)
    assert sfi_jax.EngineOptions(attention="pallas_gpu").resolved().moe == "tokens"
    for m in ("sfi", "dense"):
        got = _compiles_its_own_program(options, lambda: sfi_jax.generate(
            model, prompts, mode=m, options=options, **kw))
        assert got.tokens == want[m].tokens, m
        assert rel_err(got.stats["logits"], want[m].stats["logits"]) < 1e-4, m


# ---------------------------------------------------------------- split (per-layer) weights

def test_split_layers_give_the_same_tokens_and_logits(tiny_qwen3, per_row_runs, tmp_path,
                                                      xla_fast_compile):
    """The per-layer weight layout (the GPU default) computes what the stacked layout does,
    in prefill, dense and SFI decode; Orbax still writes the stacked format."""
    prompts, forced, runs = per_row_runs
    split = sfi_jax.load_model(tiny_qwen3.dir, dtype="float32", split_layers=True,
                               k_major=True)
    assert split.layers_split and isinstance(split.params["layers"], list)
    assert "wqkv" in split.params["layers"][0] and "wq" not in split.params["layers"][0]
    assert "w_down_t" in split.params["layers"][0] and "w_down" not in split.params["layers"][0]
    assert not tiny_qwen3.model.layers_split
    kw = dict(max_new_tokens=NEW, forced_tokens=forced, stop_at_eos=False, return_logits=True)
    sfi = sfi_jax.generate(split, prompts, sfi=SMALL, trigger_ids=[TRIGGER], **kw)
    dense = sfi_jax.generate(split, prompts, mode="dense", **kw)
    for got, want in ((sfi, runs["sfi"]), (dense, runs["dense"])):
        assert rel_err(got.stats["logits"], want.stats["logits"]) < 1e-5
        assert got.stats.get("slow_steps") == want.stats.get("slow_steps")
    restored = sfi_jax.load_model(sfi_jax.models.save_orbax(split, str(tmp_path / "o")),
                                  dtype="float32", split_layers=False)
    want = tiny_qwen3.model.params["layers"]
    assert set(restored.params["layers"]) == set(want)
    for name, stacked in restored.params["layers"].items():
        np.testing.assert_array_equal(np.asarray(stacked), np.asarray(want[name]))


def test_k_major_load_splits_and_names_bad_combinations(tiny_qwen3):
    """load_model(k_major=True) splits the layers on any platform; with a mesh or with
    split_layers=False it says why not."""
    model = sfi_jax.load_model(tiny_qwen3.dir, dtype="float32", k_major=True)
    assert model.layers_split and "w_up_t" in model.params["layers"][0]
    with pytest.raises(ValueError, match="needs split layers"):
        sfi_jax.load_model(tiny_qwen3.dir, dtype="float32", k_major=True, split_layers=False)
    with pytest.raises(ValueError, match="one-device layout"):
        sfi_jax.load_model(tiny_qwen3.dir, dtype="float32", k_major=True, mesh="1x1")
    with pytest.raises(ValueError, match="needs decode_rows"):
        sfi_jax.load_model(tiny_qwen3.dir, dtype="float32", k_major="auto")
    with pytest.raises(ValueError, match="k_major must be"):
        sfi_jax.load_model(tiny_qwen3.dir, dtype="float32", k_major="yes")
    # off the GPU "auto" keeps the platform's layout (stacked on a CPU)
    model = sfi_jax.load_model(tiny_qwen3.dir, dtype="float32", k_major="auto", decode_rows=1)
    assert not model.layers_split


def test_k_major_auto_follows_the_measured_sizes(monkeypatch):
    """k_major_pays: on one GPU for up to 4 rows of a model whose largest K-major weight is
    4-8 MB (qwen3-0.6b in bf16, measured faster), not for qwen3-4b's (measured slower), the
    embedded SmolLM2's (not measured), float32 weights twice the size, more rows, a mesh, an
    MoE model's 16 MB output projection, or a CPU."""
    from sfi_jax.models import loading
    from sfi_jax.models.config import PRESETS

    small, large, moe = PRESETS["qwen3-0.6b"], PRESETS["qwen3-4b"], PRESETS["qwen3-30b-a3b"]
    tiny = PRESETS[loading.EMBEDDED_DEFAULT]
    assert not loading.k_major_pays(small, 1)  # this CPU
    monkeypatch.setattr(loading, "on_gpu", lambda: True)
    assert loading.k_major_pays(small, 1) and loading.k_major_pays(small, 4)
    assert not loading.k_major_pays(small, 5) and not loading.k_major_pays(small, 0)
    assert not loading.k_major_pays(small, 1, dtype="float32")
    assert not loading.k_major_pays(small, 1, mesh="1x1")  # (any mesh)
    assert not loading.k_major_pays(large, 1) and not loading.k_major_pays(moe, 1)
    assert not loading.k_major_pays(tiny, 1)
    from sfi_jax.cli import build_parser

    assert build_parser().parse_args([]).k_major == "auto"
    assert build_parser().parse_args(["--k-major", "on"]).k_major == "on"


# ---------------------------------------------------------------- evidence window (W > 1)

def test_window_logits_match_numpy():
    from sfi_jax.runtime.decode import window_logits

    rng = np.random.default_rng(11)
    n, Hq, Hkv, W, D, S = 2, 4, 2, 5, 8, 30
    qh = rng.standard_normal((n, Hq, W, D)).astype(np.float32)
    k = rng.standard_normal((n, Hkv, S, D)).astype(np.float32)
    row_len = np.array([30, 17], np.int32)
    for step in (0, 2, 4, 9):
        got = np.asarray(window_logits(qh, k, row_len, step))
        assert got.shape == (n, Hkv, (Hq // Hkv) * W, S)
        for b in range(n):
            for h in range(Hq):
                kv, g = divmod(h, Hq // Hkv)
                for w in range(W):
                    want = qh[b, h, w] @ k[b, kv].T / np.sqrt(D)
                    want[row_len[b]:] = -np.inf
                    if w > step:  # slot not written yet
                        want[:] = -np.inf
                    np.testing.assert_allclose(got[b, kv, g * W + w], want, rtol=1e-5, atol=1e-5)


def test_evidence_window(tiny_qwen3, per_row_runs, xla_fast_compile):
    """W > 1: the budget covering the context still equals dense; a small budget keeps the slow
    timeline (set by triggers alone) but selects differently from W = 1."""
    prompts, forced, runs = per_row_runs
    kw = dict(max_new_tokens=NEW, forced_tokens=forced, stop_at_eos=False, return_logits=True,
              trigger_ids=[TRIGGER])
    full = sfi_jax.generate(tiny_qwen3.model, prompts,
                            sfi=sfi_jax.SFIConfig(n_sink=4, k_select=80, n_recent=16, t_max=4,
                                                  evidence_window=4), **kw)
    assert rel_err(full.stats["logits"], runs["dense"].stats["logits"]) < 1e-5
    small = sfi_jax.generate(tiny_qwen3.model, prompts,
                             sfi=dataclasses.replace(SMALL, evidence_window=4), **kw)
    np.testing.assert_array_equal(small.stats["slow_timeline"], runs["sfi"].stats["slow_timeline"])
    assert np.all(np.isfinite(small.stats["logits"]))
    assert rel_err(small.stats["logits"], runs["sfi"].stats["logits"]) > 1e-4
    with pytest.raises(ValueError, match="evidence_window"):
        sfi_jax.SFIConfig(evidence_window=0)


def test_memory_check_counts_the_held_scores():
    """The memory check's SFI state bytes include the selection memory's held scores, as big
    as the array the state holds, and nothing for them when the memory is off."""
    from sfi_jax.runtime.state import state_bytes

    cfg = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=2, num_kv_heads=2, head_dim=16)
    on = dataclasses.replace(SMALL, selection_memory=0.5)
    st = empty_sfi_state(cfg, on, 3, 64, jnp.float32)
    assert state_bytes(cfg, 3, 64, 4, on)["sfi_held_scores"] == st.scores.nbytes
    assert "sfi_held_scores" not in state_bytes(cfg, 3, 64, 4, SMALL)
    assert empty_sfi_state(cfg, SMALL, 3, 64, jnp.float32).scores is None


@pytest.mark.parametrize("attention", ["xla", "pallas_gpu"])
def test_decode_keeps_every_key_norm(attention, xla_fast_compile):
    """After decode steps the state's key norms equal the cache's keys' L2 norms at every
    position a row holds, every layer: stored in the sparse read's launch (the Triton kernel,
    interpreted here) or by the step after its layers (`decode.store_key_norms`)."""
    cfg = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=3, hidden_size=64,
                              intermediate_size=128, num_q_heads=4, num_kv_heads=2, head_dim=16,
                              vocab_size=300)
    B, S, steps = 3, 128, 5
    sfi = sfi_jax.SFIConfig(n_sink=2, k_select=16, n_recent=8, t_max=3)
    lengths = jnp.array([40, 77, 100], jnp.int32)
    shape = (cfg.num_layers, B, cfg.num_kv_heads, S, cfg.head_dim)
    k, v = (jax.random.normal(jax.random.key(i), shape, jnp.float32) for i in (1, 2))
    held = jnp.arange(S)[None, :] < lengths[:, None]  # [B, S]
    norms = jnp.where(held[None, :, None], jnp.linalg.norm(k, axis=-1), 0.0)
    st = empty_sfi_state(cfg, sfi, B, S, jnp.float32)._replace(key_norms=norms)
    state = DecodeState(k=k, v=v, lengths=lengths, token=jnp.array([5, 6, 7], jnp.int32),
                        done=jnp.zeros((B,), bool), step=jnp.int32(0),
                        key=jax.random.key_data(jax.random.key(0)), sfi=st)
    mask = jnp.zeros((cfg.vocab_size,), bool)
    options = sfi_jax.EngineOptions(attention=attention).resolved()
    out = decode.decode_chunk(random_params(cfg, "float32", 0), state, mask, mask,
                              jnp.full((B, steps), -1, jnp.int32), cfg=cfg, sfi=sfi,
                              sampling=SamplingConfig(), n_steps=steps, options=options)[0]
    assert (np.asarray(out.lengths) == np.array([40, 77, 100]) + steps).all()
    want = np.linalg.norm(np.asarray(out.k, np.float64), axis=-1)  # [L, B, Hkv, S]
    held = np.arange(S)[None, :] < np.asarray(out.lengths)[:, None]  # [B, S]
    held = np.broadcast_to(held[None, :, None], want.shape)
    err = np.abs(np.asarray(out.sfi.key_norms) - want)[held]
    assert err.max() < 1e-5 * want[held].max()
