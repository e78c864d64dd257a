"""Jitted prefill and decode.

Prefill is dense and chunked (memory-bounded). Decode runs a chunk of steps inside one
`lax.while_loop` on device; each step scans over the stacked layers with the KV cache (and the
SFI state) in the carry, so the cache is updated in place. In SFI mode every row decides per
step whether it is slow (dense attention + selector + repack of its compact buffer) or fast
(sparse attention over sink + selected + recent). A static number of refresh slots per step
bounds the slow work; `lax.cond` skips it when no row needs it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sfi_jax.kernels import dense_decode, sparse_decode
from sfi_jax.kernels.api import repack, write_new_token
from sfi_jax.options import EngineOptions

from sfi_jax.config import SFIConfig
from sfi_jax.models.config import ModelConfig
from sfi_jax.models.modeling import (attention_inputs, attention_output_and_mlp, embed_tokens,
                                     output_logits, run_layers)
from sfi_jax.runtime import sharding
from sfi_jax.runtime.sampling import SamplingConfig, sample
from sfi_jax.runtime.state import DecodeState, SFIState
from sfi_jax.selector.select import selector_scores, selector_scores_at, topk_positions


def _heads_impl(options, plan):
    """The heads' norm + rope on a mesh is jnp (GSPMD does not partition a Pallas call)."""
    return "xla" if plan is not None else options.heads


def _moe_impl(options, plan):
    """The expert matmuls on a mesh are `lax.ragged_dot` (as for the heads)."""
    return "xla" if plan is not None else options.moe


# ----------------------------------------------------------------------------- prefill

def prefill_chunk_size(cfg: ModelConfig, batch: int, max_len: int, longest_prompt: int,
                       budget_bytes: int = 1 << 30) -> int:
    """Largest power-of-2 chunk (16..1024) whose float32 attention scores fit `budget_bytes`."""
    chunk = 1024
    while chunk > 16 and batch * cfg.num_q_heads * chunk * max_len * 4 > budget_bytes:
        chunk //= 2
    while chunk > 16 and chunk // 2 >= longest_prompt:
        chunk //= 2
    return chunk


def _cache_attention(q, k_cache, v_cache, q_pos, kv_len):
    """Attention of queries at positions q_pos [B, T] over cache [B, Hkv, S, D] positions
    <= q_pos and < kv_len[b]. Returns out [B, T, Hq, D] and f32 logits [B, Hkv, G, T, S]."""
    B, T, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    s = s / np.sqrt(D)
    pos = jnp.arange(S)
    mask = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] < kv_len[:, None, None])
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("bkgts,bksd->btkgd", p.astype(v_cache.dtype), v_cache,
                     preferred_element_type=jnp.float32)
    return out.reshape(B, T, Hq, D).astype(q.dtype), s


def _write_rows(cache, layer, new, start):
    """cache [L, B, Hkv, S, D] <- new [B, T, Hkv, D] at positions start[b] + t (in place)."""
    new = jnp.swapaxes(new, 1, 2).astype(cache.dtype)  # [B, Hkv, T, D]
    upd = jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=1))
    return cache.at[layer].set(upd(cache[layer], new, start))


@functools.partial(jax.jit, static_argnames=("cfg", "with_norms", "plan"),
                   donate_argnames=("k", "v", "key_norms"))
def prefill_chunk(params, k, v, key_norms, tokens, start, lengths, last_hidden, *,
                  cfg: ModelConfig, with_norms: bool, plan=None):
    """Run tokens [B, C] at positions start + [0, C) through all layers, writing the cache.

    Rows are right-padded: positions >= lengths[b] are written but never attended later
    (decode overwrites them). Returns the residual at each row's last prompt position.
    On a mesh (plan), the cache keeps its row/head split (GSPMD partitions the rest).
    """
    B, C = tokens.shape
    pos = start + jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
    starts = jnp.full((B,), start, jnp.int32)

    def layer(carry, xs):
        x, k, v, kn = carry
        w, l = xs
        q, kk, vv = attention_inputs(w, cfg, x, pos)
        k = _write_rows(k, l, kk, starts)
        v = _write_rows(v, l, vv, starts)
        if with_norms:
            norms = jnp.linalg.norm(kk.astype(jnp.float32), axis=-1)  # [B, C, Hkv]
            kn = kn.at[l].set(jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(
                c, n, s, axis=1))(kn[l], jnp.swapaxes(norms, 1, 2), starts))
        attn, _ = _cache_attention(q, k[l], v[l], pos, pos[:, -1] + 1)
        return (attention_output_and_mlp(w, cfg, x, attn), k, v, kn), None

    x = embed_tokens(params, tokens)
    (x, k, v, key_norms), _ = run_layers(layer, (x, k, v, key_norms), params["layers"],
                                         cfg.num_layers)
    last = jnp.clip(lengths - 1 - start, 0, C - 1)
    here = (lengths - 1 >= start) & (lengths - 1 < start + C)
    picked = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    if plan is not None:
        k, v = sharding.constrain((k, v), (sharding.cache_sharding(plan),) * 2)
        if with_norms:
            key_norms = sharding.constrain(key_norms, sharding.sfi_state_shardings(plan).key_norms)
    return k, v, key_norms, jnp.where(here[:, None], picked, last_hidden)


def _allowed(lengths, sfi: SFIConfig):
    """J = [n_sink, t - n_recent) for a step whose current position is t = lengths[b]."""
    lo = jnp.full_like(lengths, sfi.n_sink)
    return lo, jnp.maximum(lo, lengths - sfi.n_recent)


def _compact_positions(sel, lengths, sfi: SFIConfig):
    """Sink + selected positions [..., B, Hkv, C], valid first (order kept), -1 padded, and the
    valid counts. sel [..., B, Hkv, K] holds positions ascending with -1 padding."""
    # The valid sinks are a prefix of [0, n_sink) and the valid selections a prefix of sel, so
    # the packed list is closed-form: slot j holds sink j, then sel[j - n_sinks] (no sort).
    n_sinks = jnp.minimum(lengths, sfi.n_sink).astype(jnp.int32)[..., None, None]
    n_sinks = jnp.broadcast_to(n_sinks, sel.shape[:-1] + (1,))
    n_sel = jnp.sum(sel >= 0, axis=-1, keepdims=True, dtype=jnp.int32)
    j = jnp.arange(sfi.n_sink + sel.shape[-1], dtype=jnp.int32)
    from_sel = jnp.take_along_axis(sel, jnp.clip(j - n_sinks, 0, sel.shape[-1] - 1), axis=-1)
    pos = jnp.where(j < n_sinks, j, jnp.where(j < n_sinks + n_sel, from_sel, -1))
    return pos, (n_sinks + n_sel)[..., 0]


def _compact(k_layer, v_layer, sel, lengths, sfi: SFIConfig):
    """Compact sink+selected buffers [B, Hkv, C, D] from one layer's cache [B, Hkv, S, D]."""
    pos, c_len = _compact_positions(sel, lengths, sfi)
    idx = jnp.maximum(pos, 0)[..., None]
    ck = jnp.take_along_axis(k_layer, idx, axis=2)
    cv = jnp.take_along_axis(v_layer, idx, axis=2)
    return ck, cv, c_len, pos


def _select_compact(logits, key_norms, k_layer, v_layer, lo, hi, lengths, *, sfi, options,
                    head_axis=None):
    z = selector_scores(logits, key_norms, lo, hi, sfi, cross_head_reduce=head_axis,
                        impl=options.selector_scores, adjust=options.selector_adjust)
    sel = topk_positions(z, sfi.k_select, impl=options.selector_topk)
    return _compact(k_layer, v_layer, sel, lengths, sfi)


@functools.partial(jax.jit, static_argnames=("cfg", "sfi", "options", "plan"),
                   donate_argnames=("state",))
def prefill_selection(params, state: SFIState, k, v, tokens_window, lengths, *,
                      cfg: ModelConfig, sfi: SFIConfig, options: EngineOptions = EngineOptions(),
                      plan=None) -> SFIState:
    """Initial selection (SFI_METHOD.md §5): re-run the last W prompt positions through the
    layers, and select per layer from their logits over the prompt (under shard_map on a
    mesh, with the cross-head term reduced over the devices holding the KV heads)."""
    B, W = tokens_window.shape
    q_pos = lengths[:, None] - W + jnp.arange(W, dtype=jnp.int32)[None, :]
    valid_q = q_pos >= 0
    q_pos_c = jnp.maximum(q_pos, 0)
    lo, hi = _allowed(lengths, sfi)

    def layer(carry, xs):
        x, st = carry
        w, l = xs
        q, _, _ = attention_inputs(w, cfg, x, q_pos_c)
        attn, logits = _cache_attention(q, k[l], v[l], q_pos_c, lengths)
        # invalid window rows (prompt shorter than W) carry no evidence
        logits = jnp.where(valid_q[:, None, None, :, None], logits, -jnp.inf)
        Hkv, G = logits.shape[1], logits.shape[2]
        args = (logits.reshape(B, Hkv, G * W, -1), st.key_norms[l], k[l], v[l], lo, hi, lengths)
        fn = functools.partial(_select_compact, sfi=sfi, options=options.resolved())
        if plan is None:
            ck, cv, c_len, pos = fn(*args)
        else:
            ck, cv, c_len, pos = sharding.select_and_compact(plan, fn, *args)
        st = st._replace(ck=st.ck.at[l].set(ck), cv=st.cv.at[l].set(cv),
                         c_len=st.c_len.at[l].set(c_len), positions=st.positions.at[l].set(pos))
        return (attention_output_and_mlp(w, cfg, x, attn), st), None

    x = embed_tokens(params, jnp.where(valid_q, tokens_window, 0))
    (_, state), _ = run_layers(layer, (x, state), params["layers"], cfg.num_layers)
    if plan is not None:
        state = sharding.constrain(state, sharding.sfi_state_shardings(plan))
    return state


@functools.partial(jax.jit, static_argnames=("cfg", "sfi", "plan"), donate_argnames=("state",))
def sink_only_selection(state: SFIState, k, v, lengths, *, cfg: ModelConfig, sfi: SFIConfig,
                        plan=None):
    """Compact buffers holding the sink alone (the StreamingLLM baseline)."""
    L, B, Hkv = state.c_len.shape
    empty = jnp.full((B, Hkv, sfi.k_select), -1, jnp.int32)

    def one(l):
        return _compact(k[l], v[l], empty, lengths, sfi)

    ck, cv, c_len, pos = jax.lax.map(one, jnp.arange(L))
    state = state._replace(ck=ck, cv=cv, c_len=c_len, positions=pos)
    if plan is not None:
        state = sharding.constrain(state, sharding.sfi_state_shardings(plan))
    return state


# ----------------------------------------------------------------------------- decode

def _refresh_slots(slow, done, n_slots):
    """Up to n_slots rows that take a slow step now (others wait), ascending; empty slots hold
    B, B+1, ... (out of range, dropped by scatters; unique, so scatters need no atomics)."""
    return unique_slots(jnp.nonzero(slow & ~done, size=n_slots, fill_value=slow.shape[0])[0],
                        slow.shape[0])


def unique_slots(idx, size):
    """Replace the fill value `size` of a nonzero(...) result by size, size+1, ..."""
    idx = idx.astype(jnp.int32)
    return jnp.where(idx >= size, size + jnp.arange(idx.shape[0], dtype=jnp.int32), idx)


def _diagnostics(q, k_layer, lengths, st_layer_pos, fast_rows, recent_start, prev, k_support):
    """Per KV head: the dense attention mass the step's attended set covers, and the Jaccard
    overlap of the dense top-k support with the previous step's (for quality evaluation)."""
    from sfi_jax.kernels import reference

    B, Hq, _ = q.shape
    Hkv, S = k_layer.shape[1], k_layer.shape[2]
    _, logits, lse = reference.dense_decode(q, k_layer, k_layer, lengths, return_logits=True)
    p = jnp.exp(logits - lse[..., None]).reshape(B, Hkv, Hq // Hkv, S)
    pos = jnp.arange(S)
    in_set = jnp.zeros((B, Hkv, S + 1), bool)
    in_set = in_set.at[jnp.arange(B)[:, None, None], jnp.arange(Hkv)[None, :, None],
                       jnp.where(st_layer_pos >= 0, st_layer_pos, S)].set(True)[..., :S]
    in_set = in_set | ((pos >= recent_start[:, None]) & (pos < lengths[:, None]))[:, None]
    covered = jnp.sum(jnp.where(in_set[:, :, None], p, 0.0), axis=-1).mean(axis=-1)
    coverage = jnp.where(fast_rows[:, None], covered, 1.0)
    mass = p.mean(axis=2)  # [B, Hkv, S]
    kk = min(k_support, S)
    top = jax.lax.top_k(mass, kk)[1]
    support = jnp.zeros((B, Hkv, S), bool).at[jnp.arange(B)[:, None, None],
                                              jnp.arange(Hkv)[None, :, None], top].set(True)
    support = support & (pos < lengths[:, None])[:, None]
    inter = jnp.sum(support & prev, axis=-1)
    union = jnp.sum(support | prev, axis=-1)
    has_prev = jnp.any(prev, axis=-1)
    jaccard = jnp.where(has_prev & (union > 0), inter / jnp.maximum(union, 1), jnp.nan)
    return coverage, jaccard.astype(jnp.float32), support


def _per_query_head(buf, n_q_heads):
    """The logits scratch [L, slots, Hkv, G, S] viewed as [L, slots, Hq, S] (a free reshape), the
    layout the dense kernels write."""
    return buf.reshape(buf.shape[:2] + (n_q_heads, buf.shape[-1]))


def _window_logits(qh, k_rows, row_len, step):
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


def _attend(q, kk, vv, k, v, st, buf, l, pos, dense_rows, slots, *, cfg, sfi, options,
            head_axis=None, qh=None, step=None):
    """Write this step's k, v [B, Hkv, D] into layer l of the cache, then attend: dense, or SFI
    (dense attention with logits for the rows in `slots`, fast reads for the rest). Shapes are
    whatever is local: under shard_map a device's rows and KV heads, with head_axis the mesh
    axis the KV heads are split over (the selector reduces over it).

    The refreshed rows' logits go to `buf` [L, n_slots, Hkv, G, S]; their selection runs at the
    next step's start, per occupied slot for all layers together (`_select_all_layers`), not
    once per layer: the selector is ~30 small kernels, which per layer cost more than the
    selection itself. The fast read of a refreshed row is replaced by its dense result, so
    deferring changes nothing. The oracle policy selects before its read, per layer.

    On GPU the launches per layer are few: the sparse kernel also stores the new key, value
    and key norm; the refresh slots' dense kernel runs without a condition (empty slots cost
    next to nothing), writes its logits into `buf` and its output into the fast rows' output."""
    B = q.shape[0]
    impl = options.attention
    lengths = pos + 1
    deferred = sfi is not None and sfi.policy in ("sfi", "tmax")
    if not deferred:  # write first; the deferred path's sparse kernel writes them itself
        k, v, norms = write_new_token(k, v, None if sfi is None else st.key_norms, (kk, vv),
                                      pos, l)
        if sfi is not None:
            st = st._replace(key_norms=norms)
    if sfi is None:
        return dense_decode(q, k, v, lengths, layer=l, impl=impl), k, v, st, buf

    recent_start = jnp.where(dense_rows, 0, jnp.maximum(sfi.n_sink, pos - sfi.n_recent))

    def fast_attention(st, k, v):
        # stacked, the kernel reads layer l; the deferred policies mask the dense rows' counts
        # once per step in `_decode_chunk` (here it would be one launch per layer)
        c_len = st.c_len if deferred else jnp.where(dense_rows[None, :, None], 0, st.c_len)
        # dense rows (context within the budget) read [0, length) as their "recent" window,
        # so no row reads more than `budget` cache positions in place
        kw = dict(layer=l, impl=impl, window=min(sfi.budget, k.shape[3]))
        if not deferred:
            return sparse_decode(q, st.ck, st.cv, c_len, k, v, recent_start, lengths, **kw), \
                k, v, st
        out, k, v, norms = sparse_decode(q, st.ck, st.cv, c_len, k, v, recent_start, lengths,
                                         new_kv=(kk, vv), key_norms=st.key_norms, **kw)
        return out, k, v, st._replace(key_norms=norms)

    n_slots = slots.shape[0]
    safe = jnp.minimum(slots, B - 1)
    # empty slots (== B) attend to nothing: the kernel reads no keys for them
    row_len = jnp.where(slots < B, lengths[safe], 0)

    def dense_rows_with_logits():
        return dense_decode(q[safe], k, v, row_len, return_logits=True, layer=l, rows=safe,
                            impl=impl)

    if sfi.policy == "oracle":
        _, logits, _ = dense_rows_with_logits()
        Hkv = k.shape[2]
        lo, hi = _allowed(pos[safe], sfi)
        ck, cv, c_len, positions = _select_compact(
            logits.reshape(n_slots, Hkv, q.shape[1] // Hkv, -1), st.key_norms[l, safe],
            k[l, safe], v[l, safe], lo, hi, lengths[safe], sfi=sfi, options=options,
            head_axis=head_axis)
        st = st._replace(ck=st.ck.at[l, slots].set(ck, mode="drop"),
                         cv=st.cv.at[l, slots].set(cv, mode="drop"),
                         c_len=st.c_len.at[l, slots].set(c_len, mode="drop"),
                         positions=st.positions.at[l, slots].set(positions, mode="drop"))
        return fast_attention(st, k, v)[0], k, v, st, buf
    if sfi.policy in ("streaming", "prefill_only"):
        return fast_attention(st, k, v)[0], k, v, st, buf

    attn, k, v, st = fast_attention(st, k, v)  # also stores this step's k, v, key norm
    # The condition has the identity as its other branch and updates only `buf` in place:
    # a condition whose both branches update a buffer in place (e.g. around the whole layer
    # stack, updating the KV cache) makes XLA copy that buffer at every step. One static slot
    # count (SFIConfig.refresh_rows): an indexed lax.switch over slot buckets also made XLA
    # copy buffers at every step (10x slower fast steps on the H200).
    if qh is not None:  # evidence_window > 1: remember this step's query
        qh = qh.at[l, :, :, step % qh.shape[3]].set(q.astype(qh.dtype))

    def refresh(buf):
        if qh is None:
            out_d, logits, _ = dense_rows_with_logits()
        else:
            out_d = dense_decode(q[safe], k, v, row_len, layer=l, rows=safe, impl=impl)
            logits = _window_logits(qh[l, safe], k[l, safe], row_len, step)
        return buf.at[l].set(logits.reshape(buf.shape[1:]).astype(buf.dtype)), out_d

    def without(buf):
        return buf, jnp.zeros((n_slots,) + q.shape[1:], q.dtype)

    if qh is None and options.refresh == "unconditional":
        # the GPU kernel writes the logits into `buf` and the refreshed rows' output into
        # `attn` in place and skips empty slots: no condition (a device-to-host round trip per
        # layer and step), no logits copy, no merge launch
        flat = _per_query_head(buf, q.shape[1])
        attn, flat, _ = dense_decode(q, k, v, row_len, layer=l, rows=safe, impl=impl,
                                     logits_into=flat, out_into=(attn, slots), gather_q=True)
        buf = flat.reshape(buf.shape)
    else:
        buf, out_d = jax.lax.cond(jnp.any(slots < B), refresh, without, buf)
        attn = attn.at[slots].set(out_d, mode="drop")
    if qh is not None:
        return attn, k, v, st, buf, qh
    return attn, k, v, st, buf


def _select_all_layers(st, buf, k, v, pos, slots, *, sfi, options, head_axis=None):
    """Selection for the refreshed rows of every layer (logits from `buf`), repacked into their
    compact buffers. The selector runs once per occupied slot (one `lax.cond` each, all layers
    together), so its cost follows the slow rows, not `refresh_rows`; the repack is one
    gather + scatter for all slots (per-slot in-place updates of the compact buffers inside the
    conditions made XLA copy them). Shapes are local as in `_attend`."""
    L, n_slots, Hkv, _, _ = buf.shape
    B = pos.shape[0]
    positions = jnp.full((L, n_slots, Hkv, sfi.compact_size), -1, jnp.int32)
    c_len = jnp.zeros((L, n_slots, Hkv), jnp.int32)
    for j in range(n_slots):
        positions, c_len = jax.lax.cond(
            slots[j] < B, functools.partial(_select_slot, j=j, sfi=sfi, options=options,
                                            head_axis=head_axis),
            lambda p, c, *_: (p, c), positions, c_len, buf, st.key_norms, pos, slots)
    ck, cv = repack(st.ck, st.cv, k, v, positions, slots, impl=options.repack)
    kw = dict(mode="drop", unique_indices=True, indices_are_sorted=True)
    return st._replace(ck=ck, cv=cv, c_len=st.c_len.at[:, slots].set(c_len, **kw),
                       positions=st.positions.at[:, slots].set(positions, **kw))


def _select_slot(positions, c_len, buf, key_norms, pos, slots, *, j, sfi, options, head_axis):
    """Slot j's (occupied) selection for all layers: packed positions and counts."""
    L = buf.shape[0]
    row = slots[j]
    lo, hi = _allowed(jnp.full((L,), pos[row]), sfi)
    # with scores_impl="pallas_gpu" the kernels read slot j's logits and the row's key norms
    # in place (a sliced operand of a custom call is a copy)
    z = selector_scores_at(buf, j, key_norms, row, lo, hi, sfi, cross_head_reduce=head_axis,
                           impl=options.selector_scores, adjust=options.selector_adjust)
    sel = topk_positions(z, sfi.k_select, impl=options.selector_topk)  # [L, Hkv, K]
    p, c = _compact_positions(sel, jnp.full((L,), pos[row] + 1), sfi)
    return positions.at[:, j].set(p), c_len.at[:, j].set(c)


def _layer_step(carry, xs, *, cfg, sfi, options, slots, pos, dense_rows, step=None,
                plan=None):
    """One layer of one decode step for the whole batch (attention under shard_map on a mesh)."""
    x, k, v, st, diag, buf, qh = carry
    w, l = xs
    B = x.shape[0]
    q, kk, vv = attention_inputs(w, cfg, x, pos[:, None], heads=_heads_impl(options, plan))
    q, kk, vv = q[:, 0], kk[:, 0], vv[:, 0]
    attend = functools.partial(_attend, cfg=cfg, sfi=sfi, options=options)
    if qh is not None:  # single device (generate checks)
        attn, k, v, st, buf, qh = attend(q, kk, vv, k, v, st, buf, l, pos, dense_rows, slots,
                                         qh=qh, step=step)
    elif plan is None:
        attn, k, v, st, buf = attend(q, kk, vv, k, v, st, buf, l, pos, dense_rows, slots)
    else:
        attn, k, v, st, buf = sharding.attend(plan, attend, q, kk, vv, k, v, st, buf, l, pos,
                                              dense_rows, slots)
    x = attention_output_and_mlp(w, cfg, x, attn[:, None], moe=_moe_impl(options, plan))
    if sfi is None or diag is None:
        return (x, k, v, st, diag, buf, qh), None
    lengths = pos + 1
    recent_start = jnp.where(dense_rows, 0, jnp.maximum(sfi.n_sink, pos - sfi.n_recent))
    refreshed = jnp.zeros((B,), bool).at[slots].set(True, mode="drop")
    fast_rows = ~dense_rows & (~refreshed if sfi.policy != "oracle" else True)
    positions = jnp.where(dense_rows[:, None, None], -1, st.positions[l])
    cov, jac, support = _diagnostics(q, k[l], lengths, positions, fast_rows, recent_start,
                                     diag[l], sfi.k_select)
    return (x, k, v, st, diag.at[l].set(support), buf, qh), (cov, jac)


def slow_logits_buffer(cfg: ModelConfig, sfi: SFIConfig | None, batch: int, max_len: int,
                       plan=None):
    """Scratch for the refreshed rows' f32 logits of every layer [L, slots, Hkv, G, S] (None
    when the policy refreshes per layer or never). On a mesh each device holds its own slots."""
    if sfi is None or sfi.policy not in ("sfi", "tmax"):
        return None
    n = batch if sfi.refresh_rows is None else min(sfi.refresh_rows, batch)
    shape = (cfg.num_layers, n, cfg.num_kv_heads,
             cfg.num_q_heads // cfg.num_kv_heads * sfi.evidence_window, max_len)
    if plan is None:
        return jnp.zeros(shape, jnp.float32)
    nb = sharding.axis_size(plan.mesh, plan.batch_axis)
    n_local = min(n, batch // nb)
    shape = (shape[0], n_local * nb) + shape[2:]
    return sharding.place(lambda: jnp.zeros(shape, jnp.float32),
                          plan.sharding(plan.per_head(5, lead=1)))


@functools.partial(jax.jit, static_argnames=("cfg", "sfi", "sampling", "n_steps", "options",
                                             "return_logits", "plan"),
                   donate_argnames=("state",))
def decode_chunk(params, state: DecodeState, eos_mask, trigger_mask, forced, *, cfg: ModelConfig,
                 sfi: SFIConfig | None, sampling: SamplingConfig, n_steps: int,
                 options: EngineOptions = EngineOptions(), return_logits: bool = False,
                 plan=None):
    """See `_decode_chunk`; diagnostics are on when state.diag is set (SFI mode only).
    options: how to run (resolved here if it is not). plan: a `sharding.ShardPlan` to run on a
    mesh (None: one device)."""
    return _decode_chunk(params, state, eos_mask, trigger_mask, forced, cfg=cfg, sfi=sfi,
                         sampling=sampling, n_steps=n_steps, options=options.resolved(),
                         return_logits=return_logits, plan=plan)


def _decode_chunk(params, state: DecodeState, eos_mask, trigger_mask, forced, *, cfg, sfi,
                  sampling, n_steps, options, return_logits, plan=None):
    """Up to n_steps decode steps on device. Stops early when every row is done.

    eos_mask, trigger_mask: bool [vocab]. forced: int32 [B, n_steps] teacher-forced next tokens
    (-1 = sample). Returns the new state, tokens [B, n_steps] (-1 after a row ended), the number
    of steps taken, slow flags [B, n_steps] and optionally logits [B, n_steps, vocab].
    """
    B = state.token.shape[0]
    n_slots = B if sfi is None or sfi.refresh_rows is None else min(sfi.refresh_rows, B)
    out_tokens = jnp.full((B, n_steps), -1, jnp.int32)
    out_slow = jnp.zeros((B, n_steps), bool)
    out_logits = jnp.zeros((B, n_steps, cfg.vocab_size) if return_logits else (0,), jnp.float32)
    diagnose = state.diag is not None
    L, Hkv = cfg.num_layers, cfg.num_kv_heads
    out_diag = jnp.zeros((2, B, n_steps, L, Hkv) if diagnose else (0,), jnp.float32)

    select_all = functools.partial(_select_all_layers, sfi=sfi, options=options)
    if plan is not None:
        select_all = functools.partial(sharding.select_all_layers, plan, select_all)

    def apply_selections(st, buf, k, v, pos, slots):
        """The previous step's refreshed rows get their new selections (all layers at once)
        before anything reads the compact buffers again: updating them after this step's
        reads instead made XLA copy them at every step."""
        return jax.lax.cond(jnp.any(slots < B), select_all, lambda st, *_: st,
                            st, buf, k, v, pos, slots)

    def step(carry):
        state, i, out_tokens, out_slow, out_logits, out_diag, buf, prev_slots = carry
        pos = state.lengths
        st = state.sfi
        if buf is not None:
            st = apply_selections(st, buf, state.k, state.v, pos - 1, prev_slots)
            # + 0 that XLA cannot fold: it makes this step's writes of `buf` wait for the
            # selection that reads it (else XLA copies `buf` at every step)
            pos = pos + jnp.minimum(st.c_len[0, 0, 0], 0)
        if sfi is not None:
            dense_rows = pos + 1 <= sfi.budget
            if sfi.policy in ("sfi", "tmax"):
                want = st.pending | (pos == sfi.budget)
                slots = _refresh_slots(want, state.done, n_slots)
            elif sfi.policy == "oracle":
                slots = jnp.arange(B, dtype=jnp.int32)
            else:
                slots = jnp.full((n_slots,), B, jnp.int32)
        else:
            dense_rows, slots = None, None
        x = embed_tokens(params, state.token[:, None])
        deferred = sfi is not None and sfi.policy in ("sfi", "tmax")
        if deferred:  # dense rows read no compact buffer (see `_attend`); no layer writes c_len
            c_len = st.c_len
            # the barrier materialises the mask once: the profile showed XLA re-running this
            # fusion once per layer (36 launches, 47 us per step at qwen3-4b 128K on the H200);
            # end to end within noise (benchmarks/e2e_ab_adjust_kernel_barrier.json)
            st = st._replace(c_len=jax.lax.optimization_barrier(
                jnp.where(dense_rows[None, :, None], 0, c_len)))

        body = functools.partial(_layer_step, cfg=cfg, sfi=sfi, options=options, slots=slots,
                                 pos=pos, dense_rows=dense_rows, step=state.step, plan=plan)
        (x, k, v, st, diag, buf, q_hist), ys = run_layers(
            body, (x, state.k, state.v, st, state.diag, buf, state.q_hist), params["layers"],
            cfg.num_layers, options.unroll)
        if deferred:
            st = st._replace(c_len=c_len)
        if diagnose:  # ys: coverage, jaccard, each [L, B, Hkv]
            out_diag = out_diag.at[:, :, i].set(jnp.swapaxes(jnp.stack(ys), 1, 2))
        logits = output_logits(params, cfg, x[:, 0])
        key, sub = jax.random.split(state.key)
        token = sample(logits, sub, sampling)
        token = jnp.where(forced[:, i] >= 0, forced[:, i], token)
        live = ~state.done
        out_tokens = out_tokens.at[:, i].set(jnp.where(live, token, -1))
        if return_logits:
            out_logits = out_logits.at[:, i].set(logits)
        if sfi is not None:
            refreshed = jnp.zeros((B,), bool).at[slots].set(True, mode="drop")
            if sfi.policy == "oracle":
                refreshed = jnp.ones((B,), bool)
            out_slow = out_slow.at[:, i].set(refreshed & live)
            since = jnp.where(refreshed, 1, st.since_slow + 1)
            pending = (st.pending & ~refreshed) | (since >= sfi.t_max)
            if sfi.policy == "sfi":
                pending = pending | trigger_mask[token]
            st = st._replace(since_slow=since, pending=pending,
                             slow_steps=st.slow_steps + (refreshed & live),
                             fast_steps=st.fast_steps + (~refreshed & live))
        done = state.done | eos_mask[token]
        state = DecodeState(k=k, v=v, lengths=pos + 1, token=token, done=done,
                            step=state.step + 1, key=key, sfi=st, diag=diag, q_hist=q_hist)
        if plan is not None:  # keep the loop carry's shardings fixed
            state = sharding.constrain(state, sharding.decode_state_shardings(plan, state))
        return (state, i + 1, out_tokens, out_slow, out_logits, out_diag, buf,
                None if buf is None else slots)

    def cond(carry):
        state, i = carry[0], carry[1]
        return (i < n_steps) & ~jnp.all(state.done)

    buf = slow_logits_buffer(cfg, sfi, B, state.k.shape[3], plan)
    no_slots = None if buf is None else B + jnp.arange(n_slots, dtype=jnp.int32)
    state, taken, out_tokens, out_slow, out_logits, out_diag, buf, last_slots = \
        jax.lax.while_loop(cond, step, (state, jnp.int32(0), out_tokens, out_slow, out_logits,
                                        out_diag, buf, no_slots))
    if buf is not None:  # the last step's refreshed rows
        state = state._replace(sfi=apply_selections(state.sfi, buf, state.k, state.v,
                                                    state.lengths - 1, last_slots))
    if plan is not None:
        state = sharding.constrain(state, sharding.decode_state_shardings(plan, state))
    out_tokens, taken, out_slow, out_logits, out_diag = sharding.replicate(
        (out_tokens, taken, out_slow, out_logits, out_diag), plan)
    return state, out_tokens, taken, out_slow, out_logits, out_diag
