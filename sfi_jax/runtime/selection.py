"""Which positions each row's compact buffer holds: the initial selection from the prefill
window (SFI_METHOD.md §5), the streaming baseline's sink-only buffers, and the deferred
selection of the rows a decode step refreshed; the packing of sink + selected positions and
the gather of their keys and values."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sfi_jax.config import SFIConfig
from sfi_jax.kernels.attention import repack
from sfi_jax.models.config import ModelConfig
from sfi_jax.options import EngineOptions
from sfi_jax.runtime import mesh
from sfi_jax.runtime.state import SFIState
from sfi_jax.selector.select import selector_scores, selector_scores_at, topk_positions


def allowed_range(lengths, sfi: SFIConfig):
    """J = [n_sink, t - n_recent) for a step whose current position is t = lengths[b]."""
    lo = jnp.full_like(lengths, sfi.n_sink)
    return lo, jnp.maximum(lo, lengths - sfi.n_recent)


def compact_positions(sel, lengths, sfi: SFIConfig, sel_scores=None):
    """Sink + selected positions [..., B, Hkv, C], valid first (order kept), -1 padded, and the
    valid counts. sel [..., B, Hkv, K] holds positions ascending with -1 padding. With
    sel_scores (sel's scores), also those scores in the same slots (-inf for sinks and padding)."""
    # The valid sinks are a prefix of [0, n_sink) and the valid selections a prefix of sel, so
    # the packed list is closed-form: slot j holds sink j, then sel[j - n_sinks] (no sort).
    n_sinks = jnp.minimum(lengths, sfi.n_sink).astype(jnp.int32)[..., None, None]
    n_sinks = jnp.broadcast_to(n_sinks, sel.shape[:-1] + (1,))
    n_sel = jnp.sum(sel >= 0, axis=-1, keepdims=True, dtype=jnp.int32)
    j = jnp.arange(sfi.n_sink + sel.shape[-1], dtype=jnp.int32)
    src = jnp.clip(j - n_sinks, 0, sel.shape[-1] - 1)
    from_sel = (j >= n_sinks) & (j < n_sinks + n_sel)
    pos = jnp.where(j < n_sinks, j, jnp.where(from_sel, jnp.take_along_axis(sel, src, axis=-1),
                                              -1))
    if sel_scores is None:
        return pos, (n_sinks + n_sel)[..., 0]
    scores = jnp.where(from_sel, jnp.take_along_axis(sel_scores, src, axis=-1), -jnp.inf)
    return pos, (n_sinks + n_sel)[..., 0], scores


def remembered_scores(z, held, held_scores, lo, hi, decay: float):
    """z [..., S] raised, at each held position inside J = [lo, hi), to its remembered score
    less `decay` (SFIConfig.selection_memory): held [..., C] positions (-1 = empty),
    held_scores [..., C]; lo, hi broadcast against held."""
    S = z.shape[-1]
    at = jnp.where((held >= lo) & (held < hi), held, S)  # S: dropped

    def one(zz, i, v):
        return zz.at[i].max(v, mode="drop")

    for _ in range(z.ndim - 1):
        one = jax.vmap(one)
    return one(z, at, held_scores - decay)


def _top(z, sfi: SFIConfig, options):
    """The top-k positions of z and, when the selection remembers, their scores."""
    sel = topk_positions(z, sfi.k_select, impl=options.selector_topk)
    if not sfi.remembers:
        return sel, None
    picked = jnp.take_along_axis(z, jnp.maximum(sel, 0), axis=-1)
    return sel, jnp.where(sel >= 0, picked, -jnp.inf)


def compact(k_layer, v_layer, sel, lengths, sfi: SFIConfig, sel_scores=None):
    """Compact sink+selected buffers [B, Hkv, C, D] from one layer's cache [B, Hkv, S, D], their
    counts and positions, and (with sel_scores) the held positions' scores."""
    pos, c_len, *scores = compact_positions(sel, lengths, sfi, sel_scores)
    idx = jnp.maximum(pos, 0)[..., None]
    ck = jnp.take_along_axis(k_layer, idx, axis=2)
    cv = jnp.take_along_axis(v_layer, idx, axis=2)
    return (ck, cv, c_len, pos, *scores)


def select_compact(logits, key_norms, k_layer, v_layer, lo, hi, lengths, *, sfi, options,
                    head_axis=None):
    """(ck, cv, c_len, positions), and the held scores when the selection remembers."""
    z = selector_scores(logits, key_norms, lo, hi, sfi, cross_head_reduce=head_axis,
                        impl=options.selector_scores, adjust=options.selector_adjust)
    sel, sel_scores = _top(z, sfi, options)
    return compact(k_layer, v_layer, sel, lengths, sfi, sel_scores)


def window_logits(window_q, k_layer, lengths):
    """Scaled logits of each row's last W prompt queries over its cache, for the selector:
    window_q [B, W, Hq, D] (query w at position lengths[b] - W + w), k_layer [B, Hkv, S, D].
    Returns float32 [B, Hkv, G * W, S] (rows g-major), -inf where a key is after the query
    or past the prompt, and for whole rows whose position is < 0 (prompt shorter than W)."""
    B, W, Hq, D = window_q.shape
    Hkv, S = k_layer.shape[1], k_layer.shape[2]
    qg = window_q.reshape(B, W, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bwkgd,bksd->bkgws", qg, k_layer, preferred_element_type=jnp.float32)
    s = s / np.sqrt(D)
    q_pos = lengths[:, None] - W + jnp.arange(W, dtype=jnp.int32)[None, :]  # [B, W]
    key = jnp.arange(S)[None, None, :]
    mask = (key <= q_pos[:, :, None]) & (key < lengths[:, None, None]) & \
        (q_pos >= 0)[:, :, None]  # [B, W, S]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    return s.reshape(B, Hkv, (Hq // Hkv) * W, S)


def layer_rows(x, l, row, batch, length):
    """Layer l of a stacked cache x [L, R, Hkv, S, ...]: rows row .. row + batch - 1 (row None:
    all R rows) and their first `length` positions."""
    if row is None:
        return x[l, :, :, :length]
    at = (l, row) + (0,) * (x.ndim - 2)
    return jax.lax.dynamic_slice(x, at, (1, batch, x.shape[2], length) + x.shape[4:])[0]


@functools.partial(jax.jit, static_argnames=("sfi", "options", "plan"),
                   donate_argnames=("state",))
def prefill_selection(state: SFIState, k, v, window_q, lengths, row=None, *, sfi: SFIConfig,
                      options: EngineOptions, plan=None) -> SFIState:
    """Initial selection (SFI_METHOD.md §5): per layer, select from the logits of the prefill's
    own queries at each row's last W prompt positions (window_q [L, B, W, Hq, D], kept by
    `prefill.prefill_chunk`) over the prompt; no pass through the layers. On a mesh, under
    shard_map with the cross-head term reduced over the devices holding the KV heads.
    `options` must be resolved. row (one device): state's B rows are rows row .. row + B - 1
    of the cache k, v (an Engine's slot), read one layer at a time over state's positions."""
    lo, hi = allowed_range(lengths, sfi)
    fn = functools.partial(select_compact, sfi=sfi, options=options)
    B, T = window_q.shape[1], state.key_norms.shape[-1]

    def layer(st, l):
        k_l, v_l = layer_rows(k, l, row, B, T), layer_rows(v, l, row, B, T)
        logits = window_logits(window_q[l], k_l, lengths)
        args = (logits, st.key_norms[l], k_l, v_l, lo, hi, lengths)
        if plan is None:
            ck, cv, c_len, pos, *scores = fn(*args)
        else:
            ck, cv, c_len, pos, *scores = mesh.select_and_compact(plan, fn, *args,
                                                                  remembers=sfi.remembers)
        st = st._replace(ck=st.ck.at[l].set(ck), cv=st.cv.at[l].set(cv),
                         c_len=st.c_len.at[l].set(c_len), positions=st.positions.at[l].set(pos))
        if scores:
            st = st._replace(scores=st.scores.at[l].set(scores[0]))
        return st, None

    state, _ = jax.lax.scan(layer, state, jnp.arange(window_q.shape[0], dtype=jnp.int32))
    if plan is not None:
        state = mesh.constrain(state, mesh.sfi_state_shardings(plan, sfi.remembers))
    return state


@functools.partial(jax.jit, static_argnames=("cfg", "sfi", "plan"), donate_argnames=("state",))
def sink_only_selection(state: SFIState, k, v, lengths, row=None, *, cfg: ModelConfig,
                        sfi: SFIConfig, plan=None):
    """Compact buffers holding the sink alone (the StreamingLLM baseline); row as in
    `prefill_selection`."""
    L, B, Hkv = state.c_len.shape
    T = state.key_norms.shape[-1]
    empty = jnp.full((B, Hkv, sfi.k_select), -1, jnp.int32)

    def one(l):
        return compact(layer_rows(k, l, row, B, T), layer_rows(v, l, row, B, T), empty,
                       lengths, sfi)

    ck, cv, c_len, pos = jax.lax.map(one, jnp.arange(L))
    state = state._replace(ck=ck, cv=cv, c_len=c_len, positions=pos)
    if plan is not None:
        state = mesh.constrain(state, mesh.sfi_state_shardings(plan, sfi.remembers))
    return state


def select_all_layers(st, buf, k, v, pos, slots, *, sfi, options, head_axis=None):
    """Selection for the refreshed rows of every layer (logits from `buf`), repacked into their
    compact buffers. The selector runs once per occupied slot (one `lax.cond` each, all layers
    together), so its cost follows the slow rows, not `refresh_rows`; the repack is one
    gather + scatter for all slots (per-slot in-place updates of the compact buffers inside the
    conditions made XLA copy them). Shapes are local as in `decode`'s attention variants."""
    L, n_slots, Hkv, _, _ = buf.shape
    B = pos.shape[0]
    shape = (L, n_slots, Hkv, sfi.compact_size)
    # (positions, counts, held scores or None) of every slot's selection
    picked = (jnp.full(shape, -1, jnp.int32), jnp.zeros(shape[:3], jnp.int32),
              jnp.full(shape, -jnp.inf, jnp.float32) if sfi.remembers else None)
    for j in range(n_slots):
        picked = jax.lax.cond(
            slots[j] < B, functools.partial(_select_slot, j=j, sfi=sfi, options=options,
                                            head_axis=head_axis),
            lambda picked, *_: picked, picked, buf, st.key_norms,
            (st.positions, st.scores) if sfi.remembers else None, pos, slots)
    positions, c_len, scores = picked
    ck, cv = repack(st.ck, st.cv, k, v, positions, slots, impl=options.repack)
    kw = dict(mode="drop", unique_indices=True, indices_are_sorted=True)
    st = st._replace(ck=ck, cv=cv, c_len=st.c_len.at[:, slots].set(c_len, **kw),
                     positions=st.positions.at[:, slots].set(positions, **kw))
    if scores is not None:
        st = st._replace(scores=st.scores.at[:, slots].set(scores, **kw))
    return st


def _select_slot(picked, buf, key_norms, held, pos, slots, *, j, sfi, options, head_axis):
    """Slot j's (occupied) selection for all layers: packed positions, counts and (when the
    selection remembers) held scores; held: the state's (positions, scores) when it does."""
    positions, c_len, scores = picked
    L = buf.shape[0]
    row = slots[j]
    lo, hi = allowed_range(jnp.full((L,), pos[row]), sfi)
    # with scores_impl="pallas_gpu" the kernels read slot j's logits and the row's key norms
    # in place (a sliced operand of a custom call is a copy)
    z = selector_scores_at(buf, j, key_norms, row, lo, hi, sfi, cross_head_reduce=head_axis,
                           impl=options.selector_scores, adjust=options.selector_adjust)
    if held is not None:  # [L, Hkv, S]: what the row's last selection saw, decayed
        z = remembered_scores(z, held[0][:, row], held[1][:, row], lo[:, None, None],
                              hi[:, None, None], sfi.selection_memory)
    sel, sel_scores = _top(z, sfi, options)  # [L, Hkv, K]
    p, c, *s = compact_positions(sel, jnp.full((L,), pos[row] + 1), sfi, sel_scores)
    if s:
        scores = scores.at[:, j].set(s[0])
    return positions.at[:, j].set(p), c_len.at[:, j].set(c), scores
