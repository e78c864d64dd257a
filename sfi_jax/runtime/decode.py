"""The jitted decode loop.

Decode runs a chunk of steps inside one `lax.while_loop` on device; each step scans over the
stacked layers with the KV cache (and the SFI state) in the carry, so the cache is updated in
place. In SFI mode every row decides per step whether it is slow (dense attention + selector +
repack of its compact buffer) or fast (sparse attention over sink + selected + recent). A
static number of refresh slots per step bounds the slow work. With the unconditional refresh
read (the GPU kernels) the loop body is one step that may refresh rows, then an inner loop of
steps in which no row wants a refresh, built without the refresh slots (no launches for them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sfi_jax.config import SFIConfig
from sfi_jax.kernels import dense_decode, sparse_decode
from sfi_jax.kernels.attention import write_new_token
from sfi_jax.kernels.skinny_matmul import new_sync
from sfi_jax.models.config import ModelConfig
from sfi_jax.models.modeling import (attention_inputs, attention_output_and_mlp,
                                     decode_attention_inputs, decode_output_and_mlp, embed_tokens,
                                     fused_decode_layer, output_logits, run_layers)
from sfi_jax.options import EngineOptions
from sfi_jax.runtime import mesh
from sfi_jax.runtime.diagnostics import attention_diagnostics
from sfi_jax.runtime.sampling import SamplingConfig, sample, sample_rows
from sfi_jax.runtime.selection import (allowed_range, select_all_layers, select_compact)
from sfi_jax.runtime.slots import refresh_slots
from sfi_jax.runtime.state import DecodeState, SFIState


def _heads_impl(options, plan):
    """The heads' norm + rope on a mesh is jnp (GSPMD does not partition a Pallas call)."""
    return "xla" if plan is not None else options.heads


def _moe_impl(options, plan):
    """The expert matmuls on a mesh are `lax.ragged_dot` (as for the heads)."""
    return "xla" if plan is not None else options.moe


def matmul_impl(options, plan=None):
    """The weight matmuls on a mesh are XLA's (as for the heads)."""
    return "xla" if plan is not None else options.matmul


def _per_query_head(buf, n_q_heads):
    """The logits scratch [L, slots, Hkv, G, S] viewed as [L, slots, Hq, S] (a free reshape), the
    layout the dense kernels write."""
    return buf.reshape(buf.shape[:2] + (n_q_heads, buf.shape[-1]))


def window_logits(qh, k_rows, row_len, step):
    """Scaled logits [n, Hkv, G*W, S] of each row's last W queries qh [n, Hq, W, D] over its keys
    k_rows [n, Hkv, S, D]; -inf past row_len and for history slots not written yet (decode step
    `step` wrote slot step % W)."""
    n, Hq, W, D = qh.shape
    Hkv, S = k_rows.shape[1], k_rows.shape[2]
    qg = qh.reshape(n, Hkv, Hq // Hkv, W, D)
    s = jnp.einsum("nkgwd,nksd->nkgws", qg, k_rows, preferred_element_type=jnp.float32)
    s = s / np.sqrt(D)
    written = (jnp.arange(W) <= step) | (step >= W - 1)
    ok = (jnp.arange(S)[None, :] < row_len[:, None])[:, None, None, None, :] & \
        written[None, None, None, :, None]
    return jnp.where(ok, s, -jnp.inf).reshape(n, Hkv, Hq // Hkv * W, S)


class LayerAttention(NamedTuple):
    """One layer's decode attention: the output and the state it updated."""

    attn: jax.Array  # [B, Hq, D]
    k: jax.Array  # the KV cache, this step's key and value stored
    v: jax.Array
    st: SFIState | None
    buf: jax.Array | None  # the refreshed rows' logits scratch
    qh: jax.Array | None = None  # the query history (evidence_window > 1)


def attend_layer(q, k_new, v_new, k, v, st, buf, l, pos, dense_rows, slots, *, cfg, sfi,
                 options, head_axis=None, qh=None, step=None) -> LayerAttention:
    """Write this step's k, v [B, Hkv, D] into layer l of the cache, then attend: dense, or SFI
    (dense attention with logits for the rows in `slots`, fast reads for the rest). Shapes are
    whatever is local: under shard_map a device's rows and KV heads, with head_axis the mesh
    axis the KV heads are split over (the selector reduces over it).

    The refreshed rows' logits go to `buf` [L, n_slots, Hkv, G, S]; their selection runs at the
    end of the step, per occupied slot for all layers together (`select_all_layers`), not
    once per layer: the selector is ~30 small kernels, which per layer cost more than the
    selection itself. The fast read of a refreshed row is replaced by its dense result, so
    deferring changes nothing. The oracle policy selects before its read, per layer.

    On GPU the launches per layer are few: the sparse kernel also stores the new key, value
    and key norm; the refresh slots' dense kernel runs without a condition (empty slots cost
    next to nothing), writes its logits into `buf` and its output into the fast rows' output.
    slots None (a step of `decode_chunk`'s fast loop): no row refreshes, no dense launch."""
    B = q.shape[0]
    impl = options.attention
    tuning = options.tuning  # the GPU kernels' sweep points (defaults: the tuned kernels)
    signal = dict(launch_dependents=tuning.launch_dependents)
    lengths = pos + 1
    deferred = sfi is not None and sfi.refreshes
    if not deferred:  # write first; the deferred path's sparse kernel writes them itself
        # (a dense step over an SFI state, exact mode's rounds without drafts, keeps the norms)
        k, v, norms = write_new_token(k, v, None if st is None else st.key_norms,
                                      (k_new, v_new), pos, l)
        if st is not None:
            st = st._replace(key_norms=norms)
    if sfi is None:
        return LayerAttention(dense_decode(q, k, v, lengths, layer=l, impl=impl,
                                           config=tuning.dense_attention, **signal), k, v, st, buf)

    recent_start = jnp.where(dense_rows, 0, jnp.maximum(sfi.n_sink, pos - sfi.n_recent))

    def fast_attention(st, k, v):
        # stacked, the kernel reads layer l; the deferred policies mask the dense rows' counts
        # once per step in `decode_chunk` (here it would be one launch per layer)
        c_len = st.c_len if deferred else jnp.where(dense_rows[None, :, None], 0, st.c_len)
        # dense rows (context within the budget) read [0, length) as their "recent" window,
        # so no row reads more than `budget` cache positions in place
        kw = dict(layer=l, impl=impl, window=min(sfi.budget, k.shape[3]),
                  config=tuning.sparse_attention, **signal)
        if not deferred:
            return sparse_decode(q, st.ck, st.cv, c_len, k, v, recent_start, lengths, **kw), \
                k, v, st
        out, k, v, norms = sparse_decode(q, st.ck, st.cv, c_len, k, v, recent_start, lengths,
                                         new_kv=(k_new, v_new), key_norms=st.key_norms, **kw)
        return out, k, v, st._replace(key_norms=norms)

    def dense_rows_with_logits():
        return dense_decode(q[safe], k, v, row_len, return_logits=True, layer=l, rows=safe,
                            impl=impl, **signal)

    if slots is not None:
        n_slots = slots.shape[0]
        safe = jnp.minimum(slots, B - 1)
        # empty slots (== B) attend to nothing: the kernel reads no keys for them
        row_len = jnp.where(slots < B, lengths[safe], 0)

    if sfi.selects_every_step:
        _, logits, _ = dense_rows_with_logits()
        Hkv = k.shape[2]
        lo, hi = allowed_range(pos[safe], sfi)
        ck, cv, c_len, positions = select_compact(
            logits.reshape(n_slots, Hkv, q.shape[1] // Hkv, -1), st.key_norms[l, safe],
            k[l, safe], v[l, safe], lo, hi, lengths[safe], sfi=sfi, options=options,
            head_axis=head_axis)
        st = st._replace(ck=st.ck.at[l, slots].set(ck, mode="drop"),
                         cv=st.cv.at[l, slots].set(cv, mode="drop"),
                         c_len=st.c_len.at[l, slots].set(c_len, mode="drop"),
                         positions=st.positions.at[l, slots].set(positions, mode="drop"))
        return LayerAttention(fast_attention(st, k, v)[0], k, v, st, buf)
    if sfi.fixed_selection:
        return LayerAttention(fast_attention(st, k, v)[0], k, v, st, buf)

    attn, k, v, st = fast_attention(st, k, v)  # also stores this step's k, v, key norm
    # The condition has the identity as its other branch and updates only `buf` in place:
    # a condition whose both branches update a buffer in place (e.g. around the whole layer
    # stack, updating the KV cache) makes XLA copy that buffer at every step. One static slot
    # count (SFIConfig.refresh_rows): an indexed lax.switch over slot buckets also made XLA
    # copy buffers at every step (docs/findings.md).
    if qh is not None:  # evidence_window > 1: remember this step's query
        qh = qh.at[l, :, :, step % qh.shape[3]].set(q.astype(qh.dtype))
    if slots is None:  # a step of `decode_chunk`'s fast loop: no row refreshes, no dense launch
        return LayerAttention(attn, k, v, st, buf, qh)

    def refresh(buf):
        if qh is None:
            out_d, logits, _ = dense_rows_with_logits()
        else:
            out_d = dense_decode(q[safe], k, v, row_len, layer=l, rows=safe, impl=impl,
                                 config=tuning.dense_attention, **signal)
            logits = window_logits(qh[l, safe], k[l, safe], row_len, step)
        return buf.at[l].set(logits.reshape(buf.shape[1:]).astype(buf.dtype)), out_d

    def without(buf):
        return buf, jnp.zeros((n_slots,) + q.shape[1:], q.dtype)

    if qh is None and options.refresh == "unconditional":
        # the GPU kernel writes the logits into `buf` and the refreshed rows' output into
        # `attn` in place and skips empty slots: no condition (a device-to-host round trip per
        # layer and step), no logits copy, no merge launch
        flat = _per_query_head(buf, q.shape[1])
        attn, flat, _ = dense_decode(q, k, v, row_len, layer=l, rows=safe, impl=impl,
                                     logits_into=flat, out_into=(attn, slots), gather_q=True,
                                     **signal)
        buf = flat.reshape(buf.shape)
    else:
        buf, out_d = jax.lax.cond(jnp.any(slots < B), refresh, without, buf)
        attn = attn.at[slots].set(out_d, mode="drop")
    return LayerAttention(attn, k, v, st, buf, qh)


def layer_step(carry, xs, *, cfg, sfi, options, slots, pos, dense_rows, step=None,
                plan=None):
    """One layer of one decode step for the whole batch (attention under shard_map on a mesh).
    The carry's `sync` is the fused matmul epilogues' counters (None: unfused)."""
    x, k, v, st, diag, buf, qh, sync = carry
    w, l = xs
    B = x.shape[0]
    with jax.named_scope("qkv"):
        if sync is not None:
            q, k_new, v_new, sync = decode_attention_inputs(w, cfg, x, pos[:, None], sync,
                                                            tuning=options.tuning)
        else:
            q, k_new, v_new = attention_inputs(w, cfg, x, pos[:, None],
                                               heads=_heads_impl(options, plan),
                                               matmul=matmul_impl(options, plan))
    q, k_new, v_new = q[:, 0], k_new[:, 0], v_new[:, 0]
    attend = functools.partial(attend_layer, cfg=cfg, sfi=sfi, options=options)
    with jax.named_scope("attend"):
        if plan is None:  # the query history is single-device only (generate checks)
            attn, k, v, st, buf, qh = attend(q, k_new, v_new, k, v, st, buf, l, pos,
                                             dense_rows, slots, qh=qh, step=step)
        else:
            attn, k, v, st, buf = mesh.attend(plan, attend, q, k_new, v_new, k, v, st, buf, l,
                                              pos, dense_rows, slots)
    with jax.named_scope("mlp"):  # (the attention's output projection and the MLP)
        if sync is not None:
            x, sync = decode_output_and_mlp(w, cfg, x, attn[:, None], sync,
                                            moe=_moe_impl(options, plan), tuning=options.tuning)
        else:
            x = attention_output_and_mlp(w, cfg, x, attn[:, None], moe=_moe_impl(options, plan),
                                         matmul=matmul_impl(options, plan),
                                         tuning=options.tuning)
    if sfi is None or diag is None:
        return (x, k, v, st, diag, buf, qh, sync), None
    lengths = pos + 1
    recent_start = jnp.where(dense_rows, 0, jnp.maximum(sfi.n_sink, pos - sfi.n_recent))
    refreshed = jnp.zeros((B,), bool).at[slots].set(True, mode="drop")
    fast_rows = ~dense_rows & (True if sfi.selects_every_step else ~refreshed)
    positions = jnp.where(dense_rows[:, None, None], -1, st.positions[l])
    cov, jac, support = attention_diagnostics(q, k[l], lengths, positions, fast_rows, recent_start,
                                     diag[l], sfi.k_select)
    return (x, k, v, st, diag.at[l].set(support), buf, qh, sync), (cov, jac)


def slow_logits_buffer(cfg: ModelConfig, sfi: SFIConfig | None, batch: int, max_len: int,
                       plan=None):
    """Scratch for the refreshed rows' f32 logits of every layer [L, slots, Hkv, G, S] (None
    when the policy refreshes per layer or never). On a mesh each device holds its own slots."""
    if sfi is None or not sfi.refreshes:
        return None
    n = batch if sfi.refresh_rows is None else min(sfi.refresh_rows, batch)
    shape = (cfg.num_layers, n, cfg.num_kv_heads,
             cfg.num_q_heads // cfg.num_kv_heads * sfi.evidence_window, max_len)
    if plan is None:
        return jnp.zeros(shape, jnp.float32)
    nb = mesh.axis_size(plan.mesh, plan.batch_axis)
    n_local = min(n, batch // nb)
    shape = (shape[0], n_local * nb) + shape[2:]
    return mesh.place(lambda: jnp.zeros(shape, jnp.float32),
                          plan.sharding(plan.per_head(5, lead=1)))


@functools.partial(jax.jit, static_argnames=("cfg", "sfi", "sampling", "n_steps", "options",
                                             "return_logits", "plan"),
                   donate_argnames=("state",))
def decode_chunk(params, state: DecodeState, eos_mask, trigger_mask, forced, *, cfg: ModelConfig,
                 sfi: SFIConfig | None, sampling: SamplingConfig, n_steps: int,
                 options: EngineOptions = EngineOptions(), return_logits: bool = False,
                 plan=None):
    """Up to n_steps decode steps on device. Stops early when every row is done.

    eos_mask, trigger_mask: bool [vocab]. forced: int32 [B, n_steps] teacher-forced next tokens
    (-1 = sample). Returns the new state, tokens [B, n_steps] (-1 after a row ended), the number
    of steps taken, slow flags [B, n_steps], logits [B, n_steps, vocab] (with return_logits)
    and the diagnostics (when state.diag is set; SFI mode only).
    options: how to run (resolved here if it is not). plan: a `mesh.ShardPlan` to run on a
    mesh (None: one device)."""
    return _decode_chunk(params, state, eos_mask, trigger_mask, forced, cfg=cfg, sfi=sfi,
                         sampling=sampling, n_steps=n_steps, options=options.resolved(),
                         return_logits=return_logits, plan=plan)


def _decode_chunk(params, state: DecodeState, eos_mask, trigger_mask, forced, *, cfg, sfi,
                  sampling, n_steps, options, return_logits, plan=None):
    B = state.token.shape[0]
    n_slots = B if sfi is None or sfi.refresh_rows is None else min(sfi.refresh_rows, B)
    out_tokens = jnp.full((B, n_steps), -1, jnp.int32)
    out_slow = jnp.zeros((B, n_steps), bool)
    out_logits = jnp.zeros((B, n_steps, cfg.vocab_size) if return_logits else (0,), jnp.float32)
    diagnose = state.diag is not None
    L, Hkv = cfg.num_layers, cfg.num_kv_heads
    out_diag = jnp.zeros((2, B, n_steps, L, Hkv) if diagnose else (0,), jnp.float32)

    select_all = functools.partial(select_all_layers, sfi=sfi, options=options)
    if plan is not None:
        select_all = functools.partial(mesh.select_all_layers, plan, select_all)

    def apply_selections(st, buf, k, v, pos, slots):
        """The refreshed rows get their new selections (all layers at once) before the next
        step reads the compact buffers."""
        return jax.lax.cond(jnp.any(slots < B), select_all, lambda st, *_: st,
                            st, buf, k, v, pos, slots)

    def wants_refresh(state):
        st = state.sfi
        return (st.pending | (state.lengths == sfi.budget)) & ~state.done

    def step(carry, refresh=True):
        """One decode step; refresh=False: a step in which no row refreshes (the fast loop's),
        so no refresh-slot launch at all."""
        state, i, out_tokens, out_slow, out_logits, out_diag, sync, buf = carry
        pos = state.lengths
        st = state.sfi
        if sfi is not None:
            dense_rows = pos + 1 <= sfi.budget
            if not refresh:
                slots = None
            elif sfi.refreshes:
                slots = refresh_slots(wants_refresh(state), state.done, n_slots)
            elif sfi.selects_every_step:
                slots = jnp.arange(B, dtype=jnp.int32)
            else:
                slots = jnp.full((n_slots,), B, jnp.int32)
        else:
            dense_rows, slots = None, None
        with jax.named_scope("embed"):
            x = embed_tokens(params, state.token[:, None])
        deferred = sfi is not None and sfi.refreshes
        if deferred:  # dense rows read no compact buffer (see `_attend`); no layer writes c_len
            c_len = st.c_len
            # the barrier materialises the mask once: without it XLA re-runs this fusion once
            # per layer (docs/findings.md)
            st = st._replace(c_len=jax.lax.optimization_barrier(
                jnp.where(dense_rows[None, :, None], 0, c_len)))

        body = functools.partial(layer_step, cfg=cfg, sfi=sfi, options=options, slots=slots,
                                 pos=pos, dense_rows=dense_rows, step=state.step, plan=plan)
        (x, k, v, st, diag, buf, q_hist, sync), ys = run_layers(
            body, (x, state.k, state.v, st, state.diag, buf, state.q_hist, sync),
            params["layers"], cfg.num_layers, options.unroll)
        if deferred:
            st = st._replace(c_len=c_len)
        if diagnose:  # ys: coverage, jaccard, each [L, B, Hkv]
            out_diag = out_diag.at[:, :, i].set(jnp.swapaxes(jnp.stack(ys), 1, 2))
        with jax.named_scope("logits"):
            logits = output_logits(params, cfg, x[:, 0])
        live = ~state.done
        rows = state.rows
        with jax.named_scope("sample"):
            if rows is None:
                key, sub = jax.random.split(state.key)
                token = sample(logits, sub, sampling)
            else:  # per-row sampling and budgets (the Engine's slots)
                key = state.key
                token, keys = sample_rows(logits, rows)
                rows = rows._replace(keys=keys, remaining=rows.remaining - live)
        nonfinite = state.nonfinite
        if nonfinite is not None:  # a NaN/inf logit stops its row (the host reports it)
            nonfinite = nonfinite | (live & ~jnp.all(jnp.isfinite(logits), axis=-1))
        token = jnp.where(forced[:, i] >= 0, forced[:, i], token)
        out_tokens = out_tokens.at[:, i].set(jnp.where(live, token, -1))
        if return_logits:
            out_logits = out_logits.at[:, i].set(logits)
        if sfi is not None:
            refreshed = jnp.zeros((B,), bool)
            if slots is not None:
                refreshed = refreshed.at[slots].set(True, mode="drop")
            if sfi.selects_every_step:
                refreshed = jnp.ones((B,), bool)
            out_slow = out_slow.at[:, i].set(refreshed & live)
            since = jnp.where(refreshed, 1, st.since_slow + 1)
            pending = (st.pending & ~refreshed) | (since >= sfi.t_max)
            if sfi.uses_triggers:
                pending = pending | trigger_mask[token]
            st = st._replace(since_slow=since, pending=pending,
                             slow_steps=st.slow_steps + (refreshed & live),
                             fast_steps=st.fast_steps + (~refreshed & live))
        done = state.done | eos_mask[token]
        if rows is not None:
            done = done | (rows.remaining <= 0)
        if nonfinite is not None:
            done = done | nonfinite
        if buf is not None and slots is not None:  # this step's refreshed rows
            # + 0 that XLA cannot fold: the selection's update of the compact buffers waits for
            # this step's token, so for every layer's read of them (else XLA copies them)
            with jax.named_scope("select"):
                st = apply_selections(st, buf, k, v, pos + jnp.minimum(token, 0), slots)
        # rows that had ended stay where they are (an idle slot never outgrows the cache)
        state = DecodeState(k=k, v=v, lengths=jnp.where(live, pos + 1, pos), token=token,
                            done=done, step=state.step + 1, key=key, sfi=st, diag=diag,
                            q_hist=q_hist, rows=rows, nonfinite=nonfinite)
        if plan is not None:  # keep the loop carry's shardings fixed
            state = mesh.constrain(state, mesh.decode_state_shardings(plan, state))
        return (state, i + 1, out_tokens, out_slow, out_logits, out_diag, sync, buf)

    def cond(carry):
        state, i = carry[0], carry[1]
        return (i < n_steps) & ~jnp.all(state.done)

    buf = slow_logits_buffer(cfg, sfi, B, state.k.shape[3], plan)
    # the fused matmul epilogues' counters: zeros, and every kernel leaves them zero
    layers = params["layers"]  # (stacked: a dict; its names are a layer's)
    fused = plan is None and fused_decode_layer(
        layers if isinstance(layers, dict) else layers[0], cfg, B, options.heads,
        options.matmul, options.epilogue)
    sync = new_sync() if fused else None
    carry = (state, jnp.int32(0), out_tokens, out_slow, out_logits, out_diag, sync, buf)
    if buf is None or options.refresh != "unconditional":
        # (behind `lax.cond` a fast step launches nothing for the refresh slots: one step body,
        # half the compile time)
        carry = jax.lax.while_loop(cond, step, carry)
    else:
        # one step that may refresh rows, then fast steps (no refresh-slot launches) for as
        # long as no row wants a refresh; the refreshing step alone carries `buf`
        def fast_cond(fast):
            return cond(fast) & ~jnp.any(wants_refresh(fast[0]))

        def fast_step(fast):
            return step(fast + (None,), refresh=False)[:-1]

        def outer(carry):
            carry = step(carry)
            return jax.lax.while_loop(fast_cond, fast_step, carry[:-1]) + (carry[-1],)

        carry = jax.lax.while_loop(cond, outer, carry)
    state, taken, out_tokens, out_slow, out_logits, out_diag, _, _ = carry
    if plan is not None:
        state = mesh.constrain(state, mesh.decode_state_shardings(plan, state))
    out_tokens, taken, out_slow, out_logits, out_diag = mesh.replicate(
        (out_tokens, taken, out_slow, out_logits, out_diag), plan)
    return state, out_tokens, taken, out_slow, out_logits, out_diag
