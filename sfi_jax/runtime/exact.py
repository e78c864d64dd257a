"""Exact mode: SFI's fast steps draft, one dense step verifies (self-speculative decoding).

A round, per row and in lock-step over the batch inside one jitted `lax.while_loop`
iteration: up to draft_len fast steps (sink + selected + recent, their K/V written to the
cache as usual) draft d1..dm; one verify step feeds [token, d1..dm] at positions
[len, len + m] through every layer with dense multi-query attention (causal among them),
overwriting their K/V with dense values; the longest prefix dense decoding would have produced
is accepted (greedy: the argmax matches; sampling: the speculative rejection rule, so tokens
are distributed as dense sampling's), and one more token comes from the verify's logits. A
row rolls back by its length alone (K/V past it are stale and overwritten later).

The verify step is also SFI's slow step: rows whose refresh is due select from the verify's
attention logits at their draft's last query (`select_query`). A trigger token, EOS or t_max
ends a row's draft early; its later draft slots are not verified.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sfi_jax.config import SFIConfig
from sfi_jax.kernels.multi_query_decode import multi_query_decode
from sfi_jax.kernels.skinny_matmul import new_sync
from sfi_jax.models.config import ModelConfig
from sfi_jax.models.modeling import (WeightLayout, attention_inputs, attention_output_and_mlp,
                                     embed_tokens, output_logits, run_layers)
from sfi_jax.options import EngineOptions
from sfi_jax.runtime.decode import (LayerCarry, attend_layer, attention_variant, run_step_layers,
                                    step_inputs, uses_fused_layers)
from sfi_jax.runtime.sampling import SamplingConfig
from sfi_jax.runtime.selection import select_all_layers
from sfi_jax.runtime.slots import refresh_slots
from sfi_jax.runtime.state import DecodeState, count_step, refresh_interval


class ExactCounts(NamedTuple):
    """Per-row bookkeeping of exact mode (int32 [B], and the acceptance estimate)."""

    remaining: jax.Array  # tokens the row may still emit
    drafted: jax.Array  # draft tokens sent to verification
    accepted: jax.Array  # of those, accepted
    verify_steps: jax.Array  # rounds (one verify step each)
    # adaptive drafts, float32: running averages of the draft tokens a verify accepted and of
    # the draft tokens it decided on (the accepted ones and the first rejected one); their
    # ratio estimates the chance that a draft token is accepted
    accepted_ema: jax.Array
    trials_ema: jax.Array

    @property
    def acceptance(self):
        return self.accepted_ema / jnp.maximum(self.trials_ema, 1e-6)


# Adaptive drafts: a new row's acceptance estimate (the prior); each verify moves the averages
# half-way to its counts; while the batch does not draft, every row's estimate drifts up towards
# 1, so the batch probes again now and then (with no acceptance: a one-token draft every few
# dozen steps on the H200's qwen3-4b rows).
ACCEPT_PRIOR, ACCEPT_STEP, ACCEPT_DRIFT = 0.6, 0.5, 0.005
# A round's cost beyond its bytes, in dense steps (the verify's extra queries, the round's
# bookkeeping): measured on the H200, rounds at acceptance 0 ran 0.83-0.87x dense when probes
# were priced at bytes alone (benchmarks/e2e_exact.md).
ROUND_OVERHEAD = 0.1


def initial_counts(batch: int, remaining) -> ExactCounts:
    def zeros():  # distinct buffers: the chunk donates each
        return jnp.zeros((batch,), jnp.int32)

    return ExactCounts(jnp.asarray(remaining, jnp.int32), zeros(), zeros(), zeros(),
                       jnp.full((batch,), ACCEPT_PRIOR, jnp.float32),
                       jnp.ones((batch,), jnp.float32))


def _drift(counts: ExactCounts, rows) -> ExactCounts:
    """The acceptance estimate of `rows` (rows that did not draft) moves towards 1."""
    acc, trials = counts.accepted_ema, counts.trials_ema
    return counts._replace(accepted_ema=jnp.where(rows, acc + ACCEPT_DRIFT * (trials - acc),
                                                  acc))


def draft_length(accept, lengths, live, *, cfg: ModelConfig, sfi: SFIConfig, dtype_bytes: int):
    """The batch's draft length 0..draft_len for the next round: the d that maximises the live
    rows' expected tokens per round (each row 1 + a + ... + a^d at its acceptance a) over the
    round's cost in dense steps (d fast steps, one verify, ROUND_OVERHEAD), 0 being one plain
    dense step. One length for the batch, because a round's fast steps and verify run for
    every row: a row drafting less than the others saves nothing and a single row's probe
    costs the whole batch a round. Costs come from the bytes a step reads: the weights once,
    plus each live row's KV, all of it for a verify, at most the SFI budget for a fast step."""
    h = cfg.hidden_size
    weights = float(cfg.param_count() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * h)) \
        * dtype_bytes
    per_position = float(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes)
    ctx = jnp.where(live, lengths, 0).astype(jnp.float32)
    fast = (weights + per_position * jnp.sum(jnp.minimum(ctx, sfi.budget))) / \
        (weights + per_position * jnp.sum(ctx))
    d = jnp.arange(sfi.draft_len + 1, dtype=jnp.float32)
    a = jnp.clip(accept, 0.0, 0.999)[:, None]
    tokens = jnp.sum(jnp.where(live[:, None], (1 - a ** (d + 1)) / (1 - a), 0.0), axis=0)
    cost = jnp.where(d > 0, 1 + ROUND_OVERHEAD + d * fast, 1.0)
    return jnp.argmax(tokens / cost).astype(jnp.int32)  # ties: the shorter draft


def sampling_logits(logits, cfg: SamplingConfig):
    """The logits `sampling.sample` draws from (temperature, then top-k, then top-p), -inf
    where excluded: speculative acceptance must compare the distributions dense sampling uses."""
    logits = logits / cfg.temperature
    if cfg.top_k:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        keep = jnp.cumsum(probs, axis=-1) - probs < cfg.top_p
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def draft_config(sfi: SFIConfig) -> SFIConfig:
    """The policy the fast steps run under: the refreshing policies read their compact buffers
    as they stand (the verify step refreshes them); the baselines run as they are."""
    return dataclasses.replace(sfi, policy="prefill_only") if sfi.refreshes else sfi


def _one_step(params, k, v, st, token, pos, *, cfg, layout, sfi, variant, options, live=None):
    """One decode step for the whole batch with the decode loop's layers (its fused kernels
    included): logits [B, V] and the updated cache/state. variant: the draft's attention
    variant for a fast (draft) step under `sfi`; "dense" for a plain dense step that keeps the
    SFI state's key norms (a round in which no row drafts); live: the rows not yet ended
    (None: all; a dense step attends only those)."""
    fused = uses_fused_layers(layout, cfg, token.shape[0], options)
    x = embed_tokens(params, token[:, None])
    carry = LayerCarry(x, k, v, st, None, None, None, new_sync() if fused else None)
    attend = attend_layer(variant, sfi=sfi, options=options)
    out, _ = run_step_layers(params, carry, step_inputs(variant, sfi, pos, live=live), cfg=cfg,
                             layout=layout, sfi=sfi, options=options, attend=attend, fused=fused)
    return output_logits(params, cfg, out.x[:, 0]), out.k, out.v, out.sfi


def _verify(params, k, v, key_norms, tokens, q_start, kv_len, slots, select_query, buf, *, cfg,
            layout, options):
    """The dense verify step: tokens [B, T] at positions q_start + [0, T) through every layer,
    their K/V (and key norms) written, attention by `multi_query_decode` over kv_len. The
    refresh slots' attention logits at their query select_query[b] go to buf
    [L, n_slots, Hq, S]. Returns logits [B, T, V], k, v, key_norms, buf."""
    B, T = tokens.shape
    S = k.shape[3]
    wpos = jnp.minimum(q_start[:, None] + jnp.arange(T, dtype=jnp.int32), S - 1)
    rows = jnp.arange(B)[:, None]
    if slots is not None:
        safe = jnp.minimum(slots, B - 1)
        # the one query per refreshed row whose logits the kernel writes (-1: none)
        logits_query = jnp.full((B,), -1, jnp.int32).at[slots].set(select_query[safe],
                                                                   mode="drop")

    def layer(carry, xs):
        x, k, v, norms, buf = carry
        w, l = xs
        with jax.named_scope("qkv"):
            q, k_new, v_new = attention_inputs(w, cfg, x, wpos, heads="xla",
                                               matmul=options.matmul, layout=layout)
        with jax.named_scope("attend"):
            at = (l, rows, slice(None), wpos)  # [B, T] positions -> values [B, T, Hkv, D]
            k = k.at[at].set(k_new.astype(k.dtype))
            v = v.at[at].set(v_new.astype(v.dtype))
            norms = norms.at[at].set(jnp.linalg.norm(k_new.astype(jnp.float32), axis=-1))
            attend = functools.partial(multi_query_decode, q, k, v, q_start, kv_len, layer=l,
                                       impl=options.attention)
            if buf is None:
                attn = attend()
            else:
                def with_logits(buf):
                    out, logits, _ = attend(return_logits=True, logits_query=logits_query)
                    return buf.at[l].set(logits[safe]), out

                buf, attn = jax.lax.cond(jnp.any(slots < B), with_logits,
                                         lambda buf: (buf, attend()), buf)
        with jax.named_scope("mlp"):
            x = attention_output_and_mlp(w, cfg, x, attn.astype(x.dtype), moe=options.moe,
                                         matmul=options.matmul, tuning=options.tuning,
                                         layout=layout, epilogue=options.epilogue)
        return (x, k, v, norms, buf), None

    with jax.named_scope("embed"):
        x = embed_tokens(params, tokens)
    (x, k, v, key_norms, buf), _ = run_layers(layer, (x, k, v, key_norms, buf), params["layers"],
                                              layout, cfg.num_layers, options.unroll)
    return output_logits(params, cfg, x), k, v, key_norms, buf


def select_query(m):
    """The verify query whose attention a refreshed row's new selection comes from: the
    draft's last (m, the row's draft length), the row's last accepted query whenever the
    verify accepts the whole draft. Chosen before the verify knows how many drafts it
    accepts, so the kernel writes one query's logits per head instead of draft_len + 1 (at
    128K, batch 6, draft_len 7: 0.6 instead of 29 GB per verify that refreshes rows);
    acceptance on SmolLM2 stayed within its intervals (benchmarks/acceptance.md)."""
    return m


def _leading(ok):
    """Length of the all-True prefix of ok [B, k]."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _accept(logits_v, drafts, q_logits, m, key, sampling, accept_rate):
    """Accepted count n [B] and the token after them [B] (greedy argmax / rejection rule)."""
    B, T, _ = logits_v.shape
    k = T - 1
    valid = jnp.arange(k)[None, :] < m[:, None]
    k_acc, k_next, k_force = jax.random.split(key, 3)
    if sampling.greedy:
        target = jnp.argmax(logits_v, axis=-1).astype(jnp.int32)  # [B, T]
        ok = (drafts == target[:, :k]) & valid
    else:
        p = jax.nn.softmax(sampling_logits(logits_v, sampling), axis=-1)  # [B, T, V]
        q = jax.nn.softmax(q_logits, axis=-1)  # [B, k, V]
        pd = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
        qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        u = jax.random.uniform(k_acc, (B, k))
        ok = (u * qd < pd) & valid  # probability min(1, p/q)
    if accept_rate is not None:  # benchmarks only: acceptance drawn, not verified
        ok = (jax.random.uniform(k_force, (B, k)) < accept_rate) & valid
    n = _leading(ok)
    if sampling.greedy:
        nxt = jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]
        return n, nxt
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    q_n = jnp.take_along_axis(q, jnp.minimum(n, k - 1)[:, None, None], axis=1)[:, 0]
    resid = jnp.maximum(p_n - q_n, 0.0)
    # after a rejection: norm(max(0, p - q)); after all m accepted: p itself
    use = (n < m)[:, None] & (jnp.sum(resid, axis=-1, keepdims=True) > 0)
    dist = jnp.where(use, resid, p_n)
    nxt = jax.random.categorical(k_next, jnp.log(dist), axis=-1).astype(jnp.int32)
    return n, nxt


@functools.partial(jax.jit, static_argnames=("cfg", "sfi", "sampling", "n_rounds", "options"),
                   donate_argnames=("state", "counts"))
def exact_chunk(params, state: DecodeState, counts: ExactCounts, eos_mask, trigger_mask,
                accept_rate=None, *, cfg: ModelConfig, sfi: SFIConfig, sampling: SamplingConfig,
                n_rounds: int, options: EngineOptions = EngineOptions()):
    """Draft + verify rounds and plain dense steps on device within a budget of
    n_rounds * (draft_len + 1) steps, a round counting draft_len + 1 and a plain dense step 1:
    n_rounds rounds, or that many times draft_len + 1 dense steps once no row drafts, so a call
    is as long as the decode loop's chunk whatever the acceptance; stops early when every row
    is done.

    Returns the new state and counts, tokens [B, n_rounds * (draft_len + 1)] (each row's
    emitted tokens first, -1 after; a round emits at most draft_len + 1, a dense step 1),
    their count per row [B] and the rounds taken (a plain dense step is one).
    accept_rate (benchmarks only): accept each draft token with this probability instead of
    verifying it (the tokens are then not dense decoding's); an argument, not static, so one
    program serves every rate."""
    if not options.is_resolved:  # (a request path passes them resolved)
        options = options.resolved()
    B = state.token.shape[0]
    layout = WeightLayout.of(params["layers"])  # (the structure of a static argument)
    one_step = functools.partial(_one_step, params, cfg=cfg, layout=layout, options=options)
    verify = functools.partial(_verify, params, cfg=cfg, layout=layout, options=options)
    k_len, T = sfi.draft_len, sfi.draft_len + 1
    length_for = functools.partial(draft_length, cfg=cfg, sfi=sfi,
                                   dtype_bytes=jnp.dtype(state.k.dtype).itemsize)
    L, S = cfg.num_layers, state.k.shape[3]
    draft_sfi = draft_config(sfi)
    draft_variant = attention_variant(draft_sfi)
    n_slots = B if sfi.refresh_rows is None else min(sfi.refresh_rows, B)
    width = n_rounds * T
    out = jnp.full((B, width), -1, jnp.int32)

    def round_length(state, counts, live):
        """This round's draft length, one for the batch (a scalar)."""
        if not sfi.adaptive_draft:
            return jnp.int32(k_len)
        return length_for(counts.acceptance, state.lengths, live)

    def wants_draft(counts, live, target):
        """Rows that would draft this round: a round runs when some row does."""
        return live & (counts.remaining >= 2) & (target > 0)

    def drafting(state, counts, live, target):
        """Rows that draft this round: a row whose refresh is due does not (its selection is
        older than t_max); the round's verify refreshes it."""
        active = wants_draft(counts, live, target)
        if sfi.refreshes:
            active = active & (state.sfi.since_slow + 1 < refresh_interval(state.sfi, sfi))
        return active

    def dense_round(carry):
        """A round in which no row drafts: one plain dense decode step (the decode loop's
        kernels, cheaper than a verify of draft_len + 1 queries); refreshes wait for the next
        verify."""
        state, counts, i, out, n_out, buf, rounds = carry
        st, live, pos = state.sfi, ~state.done, state.lengths
        if sfi.refreshes:  # (+ a 0 XLA cannot fold: the cache writes wait for the last
            # refresh's reads of the cache, else XLA copies the cache to keep them apart)
            pos = pos + jnp.minimum(jnp.min(st.c_len), 0)
        key, sub = jax.random.split(state.key)
        logits, kc, vc, st = one_step(state.k, state.v, st, state.token, pos, sfi=sfi,
                                      variant="dense", live=live)
        if sampling.greedy:
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            token = jax.random.categorical(sub, sampling_logits(logits, sampling),
                                           axis=-1).astype(jnp.int32)
        out = out.at[jnp.arange(B), jnp.where(live, n_out, width)].set(token, mode="drop")
        remaining = counts.remaining - live
        done = state.done | (live & eos_mask[token]) | (remaining <= 0)
        nonfinite = state.nonfinite
        if nonfinite is not None:
            nonfinite = nonfinite | (live & ~jnp.all(jnp.isfinite(logits), axis=-1))
            done = done | nonfinite
        if sfi.refreshes:  # no row refreshes: the next verify does
            want = (st.since_slow + live + 1 >= refresh_interval(st, sfi)) | \
                ((pos <= sfi.budget) & (pos + 1 >= sfi.budget))
            if sfi.uses_triggers:
                want = want | trigger_mask[state.token]
            st = count_step(st, refreshed=jnp.zeros((B,), bool), live=live, advanced=live,
                            wants=live & want, fast=0)
        counts = _drift(counts._replace(remaining=remaining,
                                        verify_steps=counts.verify_steps + live), live)
        state = DecodeState(k=kc, v=vc, lengths=jnp.where(live, pos + 1, pos),
                            token=jnp.where(live, token, state.token), done=done,
                            step=state.step + 1, key=key, sfi=st, diag=None, q_hist=None,
                            nonfinite=nonfinite)
        return state, counts, i + 1, out, n_out + live, buf, rounds + 1  # (a budget step)

    def some_row_drafts(carry):
        state, counts = carry[0], carry[1]
        live = ~state.done
        return jnp.any(wants_draft(counts, live, round_length(state, counts, live)))

    def dense_rounds(carry):
        """Plain dense steps while no row drafts (a loop, not a condition: no buffer copies)."""
        if not sfi.adaptive_draft:
            return carry
        return jax.lax.while_loop(lambda c: cond(c, 1) & ~some_row_drafts(c), dense_round,
                                  carry)

    def one_round(carry):
        state, counts, i, out, n_out, buf, rounds = carry
        st, live, len0 = state.sfi, ~state.done, state.lengths
        key, k_draft, k_acc = jax.random.split(state.key, 3)
        draft_keys = jax.random.split(k_draft, k_len)
        target = round_length(state, counts, live)
        t_max = refresh_interval(st, sfi) if sfi.refreshes else None  # at the round's start

        def draft_step(c):
            kc, vc, st, tok, drafts, q_logits, active, m, j = c
            pos = jnp.minimum(len0 + j, S - 1)
            logits, kc, vc, st = one_step(kc, vc, st, tok, pos, sfi=draft_sfi,
                                          variant=draft_variant)
            if sampling.greedy:
                d = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            else:
                ql = sampling_logits(logits, sampling)
                d = jax.random.categorical(draft_keys[j], ql, axis=-1).astype(jnp.int32)
                q_logits = q_logits.at[:, j].set(ql)
            drafts = drafts.at[:, j].set(d)
            m = m + active
            stop = eos_mask[d] | (m >= counts.remaining - 1) | (m >= target)
            if sfi.uses_triggers:
                stop = stop | trigger_mask[d]
            if sfi.refreshes:
                stop = stop | (st.since_slow + m + 1 >= t_max)
            return kc, vc, st, d, drafts, q_logits, active & ~stop, m, j + 1

        V = cfg.vocab_size
        q_logits = jnp.zeros((B, k_len, V) if not sampling.greedy else (B, k_len, 0),
                             jnp.float32)
        active = drafting(state, counts, live, target)
        init = (state.k, state.v, st, state.token, jnp.zeros((B, k_len), jnp.int32), q_logits,
                active, jnp.zeros((B,), jnp.int32), jnp.int32(0))
        # as many fast steps as the longest draft this round (none when no row drafts)
        steps = jnp.max(jnp.where(active, target, 0))
        kc, vc, st, _, drafts, q_logits, _, m, _ = jax.lax.while_loop(
            lambda c: c[-1] < steps, draft_step, init)

        # the rows whose selection this verify refreshes (decided before it, from everything
        # the verify may accept, so only their logits are kept)
        if sfi.refreshes:
            want = st.pending | (st.since_slow + m + 1 >= t_max) | \
                ((len0 <= sfi.budget) & (len0 + m + 1 >= sfi.budget))
            if sfi.uses_triggers:
                fed = jnp.concatenate([state.token[:, None], drafts], axis=1)
                want = want | jnp.any(trigger_mask[fed] & (jnp.arange(T) <= m[:, None]), axis=1)
            want = want & live
            slots = refresh_slots(want, ~live, n_slots)
        else:
            want, slots = None, None
        tokens_v = jnp.concatenate([state.token[:, None], drafts], axis=1)
        kv_len = jnp.where(live, len0 + m + 1, len0)
        logits_v, kc, vc, norms, buf = verify(kc, vc, st.key_norms, tokens_v, len0, kv_len,
                                              slots, select_query(m), buf)
        st = st._replace(key_norms=norms)
        n, nxt = _accept(logits_v, drafts, q_logits, m, k_acc, sampling, accept_rate)

        # emitted: d1..dn, then the next token; EOS ends the row where it stands
        t = jnp.arange(T)[None, :]
        toks = jnp.where(t < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), nxt[:, None])
        eos_at = eos_mask[toks] & (t <= n[:, None])
        n_emit = jnp.where(jnp.any(eos_at, axis=1), jnp.argmax(eos_at, axis=1) + 1, n + 1)
        n_emit = jnp.where(live, n_emit, 0).astype(jnp.int32)
        col = jnp.where(t < n_emit[:, None], n_out[:, None] + t, width)
        out = out.at[jnp.arange(B)[:, None], col].set(toks, mode="drop")

        refreshed, advanced, want = jnp.zeros((B,), bool), 0, False
        if sfi.refreshes:
            # select from the verify's logits at each refreshed row's chosen query
            sel = buf.reshape(L, n_slots, cfg.num_kv_heads, -1, S)
            st = jax.lax.cond(
                jnp.any(slots < B),
                functools.partial(select_all_layers, sfi=sfi, options=options),
                lambda st, *_: st, st, sel, kc, vc, len0 + n, slots)
            refreshed = jnp.zeros((B,), bool).at[slots].set(True, mode="drop")
            advanced, want = jnp.where(live, n + 1, 0), want & ~refreshed
        st = count_step(st, refreshed=refreshed, live=live, advanced=advanced, wants=want,
                        fast=jnp.where(live, m, 0))
        remaining = counts.remaining - n_emit
        done = state.done | (live & jnp.any(eos_at, axis=1)) | (remaining <= 0)
        nonfinite = state.nonfinite
        if nonfinite is not None:  # the verify's logits at the positions it fed
            fed_ok = jnp.all(jnp.isfinite(logits_v), axis=-1) | (t > m[:, None])
            nonfinite = nonfinite | (live & ~jnp.all(fed_ok, axis=1))
            done = done | nonfinite
        seen = live & (m > 0)
        trials = (n + (n < m)).astype(jnp.float32)  # accepted + the first rejected, if any
        acc_ema, trials_ema = counts.accepted_ema, counts.trials_ema
        counts = ExactCounts(remaining=remaining,
                             drafted=counts.drafted + jnp.where(live, m, 0),
                             accepted=counts.accepted + jnp.where(live, n, 0),
                             verify_steps=counts.verify_steps + live,
                             accepted_ema=jnp.where(seen, acc_ema + ACCEPT_STEP * (n - acc_ema),
                                                    acc_ema),
                             trials_ema=jnp.where(seen, trials_ema + ACCEPT_STEP
                                                  * (trials - trials_ema), trials_ema))
        state = DecodeState(k=kc, v=vc, lengths=jnp.where(live, len0 + n + 1, len0),
                            token=jnp.where(live, nxt, state.token), done=done,
                            step=state.step + 1, key=key, sfi=st, diag=None, q_hist=None,
                            nonfinite=nonfinite)
        return state, counts, i + T, out, n_out + n_emit, buf, rounds + 1  # (T budget steps)

    def cond(carry, cost):
        """Some row is live, and the budget has room for a step of this cost."""
        return ~jnp.all(carry[0].done) & (carry[2] + cost <= width)

    # the refresh slots' verify logits [L, n_slots, Hq, S]: written whole by every verify
    # that refreshes a row, read only then
    buf = jnp.zeros((L, n_slots, cfg.num_q_heads, S), jnp.float32) if sfi.refreshes else None
    # [dense steps] then (verify round, [dense steps]) while rounds remain and some row drafts
    carry = dense_rounds((state, counts, jnp.int32(0), out, jnp.zeros((B,), jnp.int32), buf,
                          jnp.int32(0)))
    state, counts, _, out, n_out, _, taken = jax.lax.while_loop(
        lambda c: cond(c, T) & (some_row_drafts(c) if sfi.adaptive_draft else True),
        lambda c: dense_rounds(one_round(c)), carry)
    return state, counts, out, n_out, taken
