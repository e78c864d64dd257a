"""The jitted decode loop.

Decode runs a chunk of steps inside one `lax.while_loop` on device. A step reads as: embed the
tokens, run the layers (a `lax.scan` over stacked weights, the KV cache and the SFI state in
the carry, so the cache is updated in place), the logits, sample, then the SFI bookkeeping and
the refreshed rows' selection. How a layer attends is one function per attention variant,
chosen once per program (`attention_variant`):

- "dense": every row reads its whole cache;
- "fixed": the selection made at prefill is kept ("streaming", "prefill_only");
- "oracle": every layer selects from a fresh dense pass, then reads sparsely;
- "deferred" ("sfi", "tmax"): every row decides per step whether it is slow (dense attention
  with logits, its selection made at the step's end) or fast (sparse attention over sink +
  selected + recent). A static number of refresh slots per step bounds the slow work. With the
  unconditional refresh read (the GPU kernels) the loop body is one step that may refresh
  rows, then an inner loop of steps in which no row wants a refresh, built without the refresh
  slots (no launches for them).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sfi_jax.config import SFIConfig
from sfi_jax.kernels import dense_decode, sparse_decode
from sfi_jax.kernels.common import write_new_token
from sfi_jax.kernels.skinny_matmul import new_sync
from sfi_jax.models.config import ModelConfig
from sfi_jax.models.modeling import (WeightLayout, attention_inputs, attention_output_and_mlp,
                                     decode_attention_inputs, decode_output_and_mlp, embed_tokens,
                                     fused_decode_layer, output_logits, run_layers)
from sfi_jax.options import EngineOptions
from sfi_jax.runtime import mesh
from sfi_jax.runtime.diagnostics import attention_diagnostics
from sfi_jax.runtime.sampling import SamplingConfig, sample, sample_rows
from sfi_jax.runtime.selection import allowed_range, select_all_layers, select_compact
from sfi_jax.runtime.slots import refresh_slots
from sfi_jax.runtime.state import DecodeState, SFIState, count_step, refresh_interval

VARIANTS = ("dense", "fixed", "oracle", "deferred")


def attention_variant(sfi: SFIConfig | None) -> str:
    """The attention variant a program runs for this policy (None: dense decoding)."""
    if sfi is None:
        return "dense"
    if sfi.selects_every_step:
        return "oracle"
    return "fixed" if sfi.fixed_selection else "deferred"


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


# ----------------------------------------------------------------------------- one layer

class LayerAttention(NamedTuple):
    """One layer's decode attention: the output and the state it updated."""

    attn: jax.Array  # [B, Hq, D]
    k: jax.Array  # the KV cache, this step's key and value stored
    v: jax.Array
    sfi: SFIState | None
    slow_logits: jax.Array | None  # the refreshed rows' logits scratch
    q_hist: jax.Array | None = None  # the query history (evidence_window > 1)


# Every variant takes (q, k_new, v_new, k, v, sfi_state, slow_logits, l, pos, dense_rows, slots,
# *, sfi, options, head_axis=None, q_hist=None, step=None): this step's query and new key and
# value [B, H, D] and layer l of the stacked cache, whatever is local (under shard_map a
# device's rows and KV heads, head_axis the mesh axis the KV heads are split over); slots: the
# rows that refresh (B = empty; None: no row does).

def _write(k, v, sfi_state, k_new, v_new, pos, l):
    """Store this step's key and value (and, with an SFI state, the key's norm)."""
    norms = None if sfi_state is None else sfi_state.key_norms
    k, v, norms = write_new_token(k, v, norms, (k_new, v_new), pos, l)
    return k, v, sfi_state if sfi_state is None else sfi_state._replace(key_norms=norms)


def _read_compact(q, k, v, sfi_state, l, pos, dense_rows, sfi, impl, **write):
    """Sparse attention over sink + selected (the compact buffers) + recent. A dense row
    (context within the budget) reads [0, length) as its "recent" window, so no row reads more
    than `budget` cache positions in place."""
    recent_start = jnp.where(dense_rows, 0, jnp.maximum(sfi.n_sink, pos - sfi.n_recent))
    with jax.named_scope("sparse"):
        return sparse_decode(q, sfi_state.ck, sfi_state.cv, sfi_state.c_len, k, v, recent_start,
                             pos + 1, layer=l, impl=impl, window=min(sfi.budget, k.shape[3]),
                             **write)


def _tuned(options, kind=None) -> dict:
    """The GPU kernels' sweep points from `options.tuning` (defaults: the tuned kernels): the
    dense ("dense") or sparse ("sparse") kernel's config, dependent launches, the Mosaic
    kernels' unpadded query rows (and the sparse one's own new-token stores)."""
    t = options.tuning
    kw = dict(launch_dependents=t.launch_dependents, zero_fill=t.zero_fill)
    if kind is not None:
        kw["config"] = t.dense_attention if kind == "dense" else t.sparse_attention
    if kind == "sparse":
        kw["kernel_stores"] = t.kernel_stores
    return kw


def _without_dense_rows(sfi_state, dense_rows):
    """The state with the dense rows' compact counts 0: they read no compact buffer."""
    return sfi_state._replace(c_len=jnp.where(dense_rows[None, :, None], 0, sfi_state.c_len))


def attend_dense(q, k_new, v_new, k, v, sfi_state, slow_logits, l, pos, dense_rows, slots, *, sfi,
                 options, head_axis=None, q_hist=None, step=None, live=None) -> LayerAttention:
    """Dense attention over each row's whole cache (an SFI state keeps its key norms: exact
    mode's plain dense steps). live: [B] bool, the rows whose output is used (None: all); an
    ended row (an Engine slot parked while a prompt prefills into it) attends to nothing, so
    a dense step costs only its live rows' lengths."""
    k, v, sfi_state = _write(k, v, sfi_state, k_new, v_new, pos, l)
    lengths = pos + 1 if live is None else jnp.where(live, pos + 1, 0)
    with jax.named_scope("dense"):
        attn = dense_decode(q, k, v, lengths, layer=l, impl=options.attention,
                            **_tuned(options, "dense"))
    return LayerAttention(attn, k, v, sfi_state, slow_logits, q_hist)


def attend_fixed(q, k_new, v_new, k, v, sfi_state, slow_logits, l, pos, dense_rows, slots, *, sfi,
                 options, head_axis=None, q_hist=None, step=None, live=None) -> LayerAttention:
    """Sparse attention over the selection made at prefill ("streaming", "prefill_only")."""
    k, v, sfi_state = _write(k, v, sfi_state, k_new, v_new, pos, l)
    attn = _read_compact(q, k, v, _without_dense_rows(sfi_state, dense_rows), l, pos,
                         dense_rows, sfi, options.attention, **_tuned(options, "sparse"))
    return LayerAttention(attn, k, v, sfi_state, slow_logits, q_hist)


def attend_oracle(q, k_new, v_new, k, v, sfi_state, slow_logits, l, pos, dense_rows, slots, *, sfi,
                  options, head_axis=None, q_hist=None, step=None, live=None) -> LayerAttention:
    """Select from this step's dense logits, per layer and row, then read sparsely."""
    k, v, sfi_state = _write(k, v, sfi_state, k_new, v_new, pos, l)
    B, Hq = q.shape[:2]
    Hkv, n_slots = k.shape[2], slots.shape[0]
    rows = jnp.minimum(slots, B - 1)
    lengths = pos + 1
    with jax.named_scope("select"):
        _, logits, _ = dense_decode(q[rows], k, v, jnp.where(slots < B, lengths[rows], 0),
                                    return_logits=True, layer=l, rows=rows,
                                    impl=options.attention, **_tuned(options))
        lo, hi = allowed_range(pos[rows], sfi)
        ck, cv, c_len, positions = select_compact(
            logits.reshape(n_slots, Hkv, Hq // Hkv, -1), sfi_state.key_norms[l, rows], k[l, rows],
            v[l, rows], lo, hi, lengths[rows], sfi=sfi, options=options, head_axis=head_axis)
    at = (l, slots)
    sfi_state = sfi_state._replace(
        ck=sfi_state.ck.at[at].set(ck, mode="drop"), cv=sfi_state.cv.at[at].set(cv, mode="drop"),
        c_len=sfi_state.c_len.at[at].set(c_len, mode="drop"),
        positions=sfi_state.positions.at[at].set(positions, mode="drop"))
    attn = _read_compact(q, k, v, _without_dense_rows(sfi_state, dense_rows), l, pos,
                         dense_rows, sfi, options.attention, **_tuned(options, "sparse"))
    return LayerAttention(attn, k, v, sfi_state, slow_logits, q_hist)


def attend_deferred(q, k_new, v_new, k, v, sfi_state, slow_logits, l, pos, dense_rows, slots, *,
                    sfi, options, head_axis=None, q_hist=None, step=None,
                    live=None) -> LayerAttention:
    """Every row reads sparsely (the kernel also stores this step's key and value, and the key
    norm where its launch can, see `norms_in_sparse_read`; the dense rows' compact counts are 0
    for the whole step, see `decode_chunk`); the rows in
    `slots` also attend densely, their output replacing the sparse one and their logits kept
    in `slow_logits` [L, n_slots, Hkv, G, S] for the selection at the step's end
    (`select_all_layers`: all layers at once, not per layer, as the selector is ~30 small
    kernels). slots None (the fast loop's steps): no dense launch."""
    in_read = norms_in_sparse_read(options)
    attn, k, v, norms = _read_compact(q, k, v, sfi_state, l, pos, dense_rows, sfi,
                                      options.attention, new_kv=(k_new, v_new),
                                      key_norms=sfi_state.key_norms if in_read else None,
                                      **_tuned(options, "sparse"))
    if in_read:
        sfi_state = sfi_state._replace(key_norms=norms)
    if q_hist is not None:  # evidence_window > 1: remember this step's query
        q_hist = q_hist.at[l, :, :, step % q_hist.shape[3]].set(q.astype(q_hist.dtype))
    if slots is not None:
        with jax.named_scope("refresh"):
            attn, slow_logits = _refresh(q, k, v, attn, slow_logits, l, pos, slots, options,
                                         q_hist, step)
    return LayerAttention(attn, k, v, sfi_state, slow_logits, q_hist)


def norms_in_sparse_read(options) -> bool:
    """Whether the deferred variant's sparse read stores the new key's norm in its own launch
    (the Triton kernel). Elsewhere the step stores every layer's at once after its layers
    (`store_key_norms`): one gather, reduce and scatter a step, where a per-layer store took
    two launches a layer."""
    return options.attention == "pallas_gpu"


def store_key_norms(key_norms, k, pos):
    """key_norms [L, B, Hkv, S] with every layer's float32 L2 norm of the key each row stored
    at position pos[b] this step (k [L, B, Hkv, S, D])."""
    rows = jnp.arange(pos.shape[0])
    norms = jnp.linalg.norm(k[:, rows, :, pos].astype(jnp.float32), axis=-1)  # [B, L, Hkv]
    return key_norms.at[:, rows, :, pos].set(norms.astype(key_norms.dtype))


def _refresh(q, k, v, attn, slow_logits, l, pos, slots, options, q_hist, step):
    """The refresh slots' dense read: their output into `attn`, their logits into layer l of
    `slow_logits`. The condition has the identity as its other branch and updates only
    `slow_logits` in place: a condition whose both branches update a buffer in place (e.g.
    around the whole layer stack, updating the KV cache) makes XLA copy that buffer at every
    step. One static slot count (SFIConfig.refresh_rows): an indexed lax.switch over slot
    buckets also made XLA copy buffers at every step (docs/findings.md)."""
    B, Hq = q.shape[:2]
    rows = jnp.minimum(slots, B - 1)
    row_len = jnp.where(slots < B, pos[rows] + 1, 0)  # empty slots attend to nothing
    impl = options.attention
    if q_hist is None and options.refresh == "unconditional":
        # the GPU kernel writes the logits and the refreshed rows' output in place and skips
        # empty slots: no condition (a device-to-host round trip per layer and step), no
        # logits copy, no merge launch. Its logits layout [L, slots, Hq, S] is a free reshape.
        flat = slow_logits.reshape(slow_logits.shape[:2] + (Hq, slow_logits.shape[-1]))
        attn, flat, _ = dense_decode(q, k, v, row_len, layer=l, rows=rows, impl=impl,
                                     logits_into=flat, out_into=(attn, slots), gather_q=True,
                                     **_tuned(options))
        return attn, flat.reshape(slow_logits.shape)

    def refresh(scratch):
        if q_hist is None:
            out, logits, _ = dense_decode(q[rows], k, v, row_len, return_logits=True, layer=l,
                                          rows=rows, impl=impl, **_tuned(options))
        else:
            out = dense_decode(q[rows], k, v, row_len, layer=l, rows=rows, impl=impl,
                               **_tuned(options, "dense"))
            logits = window_logits(q_hist[l, rows], k[l, rows], row_len, step)
        return scratch.at[l].set(logits.reshape(scratch.shape[1:]).astype(scratch.dtype)), out

    def without(scratch):
        return scratch, jnp.zeros((slots.shape[0],) + q.shape[1:], q.dtype)

    slow_logits, out = jax.lax.cond(jnp.any(slots < B), refresh, without, slow_logits)
    return attn.at[slots].set(out, mode="drop"), slow_logits


ATTEND = {"dense": attend_dense, "fixed": attend_fixed, "oracle": attend_oracle,
          "deferred": attend_deferred}


def attend_layer(variant: str, *, sfi, options, plan=None) -> Callable[..., LayerAttention]:
    """The layer attention function of `variant`, its static arguments bound; on a mesh
    (`plan`) wrapped in shard_map (`mesh.attend`; no query history there)."""
    fn = functools.partial(ATTEND[variant], sfi=sfi, options=options)
    if plan is None:
        return fn

    def on_mesh(q, k_new, v_new, k, v, sfi_state, slow_logits, l, pos, dense_rows, slots, **_):
        return LayerAttention(*mesh.attend(plan, fn, q, k_new, v_new, k, v, sfi_state,
                                           slow_logits, l, pos, dense_rows, slots))

    return on_mesh


class StepInputs(NamedTuple):
    """What every layer of one decode step reads besides the carry."""

    pos: jax.Array  # [B] int32: the position this step's token is stored at
    dense_rows: jax.Array | None  # [B] bool: the row's context fits the SFI budget
    slots: jax.Array | None  # [n_slots] int32: the rows that refresh (B = empty); None: none
    refreshed: jax.Array | None  # [B] bool: the rows this step takes a slow step for
    step: jax.Array | None = None  # [] int32: decode steps taken (the query history's slot)
    live: jax.Array | None = None  # [B] bool: the rows not yet ended (None: all)


def step_inputs(variant: str, sfi, pos, slots=None, step=None, live=None) -> StepInputs:
    """A step's inputs for its layers. slots: the deferred variant's refresh rows (None: no row
    refreshes); the oracle refreshes every row, the other variants none. live: the rows not
    yet ended (dense steps skip the others' attention)."""
    B = pos.shape[0]
    if variant == "dense":
        return StepInputs(pos, None, None, None, step, live)
    if variant == "oracle":
        slots = jnp.arange(B, dtype=jnp.int32)
    refreshed = jnp.zeros((B,), bool)
    if slots is not None:
        refreshed = refreshed.at[slots].set(True, mode="drop")
    return StepInputs(pos, pos + 1 <= sfi.budget, slots, refreshed, step, live)


class LayerCarry(NamedTuple):
    """The layer scan's carry."""

    x: jax.Array  # [B, 1, hidden] the residual stream
    k: jax.Array  # the KV cache [L, B, Hkv, S, D]
    v: jax.Array
    sfi: SFIState | None
    diag: jax.Array | None  # the diagnostics' previous dense top-k support
    slow_logits: jax.Array | None  # the refreshed rows' logits [L, n_slots, Hkv, G, S]
    q_hist: jax.Array | None  # the query history (evidence_window > 1)
    sync: jax.Array | None  # the fused matmul epilogues' counters (None: unfused)


def layer_step(carry: LayerCarry, xs, *, cfg, layout, options, attend, fused,
               inputs: StepInputs, sfi=None):
    """One layer of one decode step for the whole batch: qkv, attend, output + MLP.
    layout: the weights' `WeightLayout`; fused: the matmuls run with their epilogues in the
    kernel (`fused_decode_layer`)."""
    w, l = xs
    x, pos, sync = carry.x, inputs.pos, carry.sync
    with jax.named_scope("qkv"):
        if fused:
            q, k_new, v_new, sync = decode_attention_inputs(w, cfg, x, pos[:, None], sync,
                                                            tuning=options.tuning)
        else:
            q, k_new, v_new = attention_inputs(w, cfg, x, pos[:, None], heads=options.heads,
                                               matmul=options.matmul, layout=layout,
                                               epilogue=options.epilogue, tuning=options.tuning)
    with jax.named_scope("attend"):
        a = attend(q[:, 0], k_new[:, 0], v_new[:, 0], carry.k, carry.v, carry.sfi,
                   carry.slow_logits, l, pos, inputs.dense_rows, inputs.slots,
                   q_hist=carry.q_hist, step=inputs.step, live=inputs.live)
    with jax.named_scope("mlp"):  # (the attention's output projection and the MLP)
        if fused:
            x, sync = decode_output_and_mlp(w, cfg, x, a.attn[:, None], sync, moe=options.moe,
                                            tuning=options.tuning, layout=layout)
        else:
            x = attention_output_and_mlp(w, cfg, x, a.attn[:, None], moe=options.moe,
                                         matmul=options.matmul, tuning=options.tuning,
                                         layout=layout, epilogue=options.epilogue)
    carry = LayerCarry(x, a.k, a.v, a.sfi, carry.diag, a.slow_logits, a.q_hist, sync)
    if carry.diag is None:
        return carry, None
    return _diagnose(carry, q[:, 0], l, inputs, sfi)


def _diagnose(carry: LayerCarry, q, l, inputs: StepInputs, sfi):
    """Layer l's coverage and Jaccard diagnostics (`runtime.diagnostics`)."""
    pos, dense_rows, sfi_state = inputs.pos, inputs.dense_rows, carry.sfi
    recent_start = jnp.where(dense_rows, 0, jnp.maximum(sfi.n_sink, pos - sfi.n_recent))
    fast_rows = ~dense_rows & (True if sfi.selects_every_step else ~inputs.refreshed)
    positions = jnp.where(dense_rows[:, None, None], -1, sfi_state.positions[l])
    cov, jac, support = attention_diagnostics(q, carry.k[l], pos + 1, positions, fast_rows,
                                              recent_start, carry.diag[l], sfi.k_select)
    return carry._replace(diag=carry.diag.at[l].set(support)), (cov, jac)


def run_step_layers(params, carry: LayerCarry, inputs: StepInputs, *, cfg, layout, sfi,
                    options, attend, fused):
    """The layers of one decode step; returns the carry and the per-layer diagnostics."""
    body = functools.partial(layer_step, cfg=cfg, layout=layout, options=options,
                             attend=attend, fused=fused, inputs=inputs, sfi=sfi)
    return run_layers(body, carry, params["layers"], layout, cfg.num_layers, options.unroll)


def uses_fused_layers(layout: WeightLayout, cfg, batch: int, options) -> bool:
    """Whether the decode step's matmuls run with their epilogues in the kernel."""
    return fused_decode_layer(layout, cfg, batch, options.heads, options.matmul,
                              options.epilogue)


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


# ----------------------------------------------------------------------------- the loop

class LoopCarry(NamedTuple):
    """The decode loop's carry: the state, the step index and the chunk's outputs."""

    state: DecodeState
    i: jax.Array  # [] int32: steps taken in this chunk
    tokens: jax.Array  # [B, n_steps] int32, -1 after a row ended
    slow: jax.Array  # [B, n_steps] bool: the row took a slow step
    logits: jax.Array  # [B, n_steps, V] float32 (with return_logits; else [0])
    diag: jax.Array  # [2, B, n_steps, L, Hkv] coverage, jaccard (with diagnostics; else [0])
    sync: jax.Array | None  # the fused matmul epilogues' counters
    slow_logits: jax.Array | None  # the refreshed rows' logits (None in the fast loop)


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
    sfi: the policy (None: dense decoding). options: how to run, from
    `EngineOptions.resolved(mesh=...)` (resolved here if it is not). plan: a `mesh.ShardPlan`
    to run on a mesh (None: one device)."""
    if not options.is_resolved:
        options = options.resolved(mesh=None if plan is None else plan.mesh)
    elif plan is not None and options != options.resolved(mesh=plan.mesh):
        raise ValueError(f"options {options} were resolved without the mesh; pass "
                         "options.resolved(mesh=...)")
    B, L = state.token.shape[0], cfg.num_layers
    layout = WeightLayout.of(params["layers"])  # (the structure of a static argument)
    fused = uses_fused_layers(layout, cfg, B, options)
    variant = attention_variant(sfi)
    n_slots = B if sfi is None or sfi.refresh_rows is None else min(sfi.refresh_rows, B)
    attend = attend_layer(variant, sfi=sfi, options=options, plan=plan)
    layers = functools.partial(run_step_layers, params, cfg=cfg, layout=layout, sfi=sfi,
                               options=options, attend=attend, fused=fused)
    select_all = functools.partial(select_all_layers, sfi=sfi, options=options)
    if plan is not None:
        select_all = functools.partial(mesh.select_all_layers, plan, select_all)

    def wants_refresh(state):
        return (state.sfi.pending | (state.lengths == sfi.budget)) & ~state.done

    def step(carry: LoopCarry, refresh=True) -> LoopCarry:
        """One decode step; refresh=False: a step in which no row refreshes (the fast loop's),
        so no refresh-slot launch at all."""
        state, i = carry.state, carry.i
        slots = refresh_slots(wants_refresh(state), state.done, n_slots) \
            if variant == "deferred" and refresh else None
        inputs = step_inputs(variant, sfi, state.lengths, slots, state.step, ~state.done)
        with jax.named_scope("embed"):
            x = embed_tokens(params, state.token[:, None])
        out, ys = layers(LayerCarry(x, state.k, state.v, _hide_dense_rows(state.sfi, inputs,
                                                                          variant),
                                    state.diag, carry.slow_logits, state.q_hist, carry.sync),
                         inputs)
        sfi_state = out.sfi if variant != "deferred" else out.sfi._replace(c_len=state.sfi.c_len)
        if variant == "deferred" and not norms_in_sparse_read(options):
            with jax.named_scope("key_norms"):  # (before the selections read them)
                sfi_state = sfi_state._replace(key_norms=store_key_norms(
                    sfi_state.key_norms, out.k, inputs.pos))
        with jax.named_scope("logits"):
            logits = output_logits(params, cfg, out.x[:, 0])
        with jax.named_scope("sample"):
            token, key, rows = _sample(state, logits, sampling)
        token = jnp.where(forced[:, i] >= 0, forced[:, i], token)
        live = ~state.done
        carry = _record(carry, i, token, live, logits, inputs.refreshed, ys, return_logits)
        if variant != "dense":
            triggered = trigger_mask[token] if sfi.uses_triggers else False
            sfi_state = count_step(sfi_state, refreshed=inputs.refreshed, live=live, advanced=1,
                                   restart=1, wants=triggered, fast=~inputs.refreshed & live,
                                   t_max=refresh_interval(state.sfi, sfi))
        if variant == "deferred" and inputs.slots is not None:
            with jax.named_scope("select"):  # the refreshed rows' selections, all layers
                sfi_state = _apply_selections(select_all, sfi_state, out, inputs, token)
        state = _next_state(state, out, sfi_state, token, key, rows, logits, eos_mask, plan)
        return carry._replace(state=state, i=i + 1, sync=out.sync, slow_logits=out.slow_logits)

    def cond(carry: LoopCarry):
        return (carry.i < n_steps) & ~jnp.all(carry.state.done)

    carry = LoopCarry(
        state, jnp.int32(0), jnp.full((B, n_steps), -1, jnp.int32), jnp.zeros((B, n_steps), bool),
        jnp.zeros((B, n_steps, cfg.vocab_size) if return_logits else (0,), jnp.float32),
        jnp.zeros((2, B, n_steps, L, cfg.num_kv_heads) if state.diag is not None else (0,),
                  jnp.float32),
        new_sync() if fused else None,
        slow_logits_buffer(cfg, sfi, B, state.k.shape[3], plan))
    if variant != "deferred" or options.refresh != "unconditional":
        # (behind `lax.cond` a fast step launches nothing for the refresh slots: one step body,
        # half the compile time)
        carry = jax.lax.while_loop(cond, step, carry)
    else:
        # one step that may refresh rows, then fast steps (no refresh-slot launches) for as
        # long as no row wants a refresh; the refreshing step alone carries the logits scratch
        def fast_cond(fast: LoopCarry):
            return cond(fast) & ~jnp.any(wants_refresh(fast.state))

        def outer(carry: LoopCarry):
            carry = step(carry)
            fast = jax.lax.while_loop(fast_cond, functools.partial(step, refresh=False),
                                      carry._replace(slow_logits=None))
            return fast._replace(slow_logits=carry.slow_logits)

        carry = jax.lax.while_loop(cond, outer, carry)
    state = carry.state
    if plan is not None:
        state = mesh.constrain(state, mesh.decode_state_shardings(plan, state))
    out_tokens, taken, out_slow, out_logits, out_diag = mesh.replicate(
        (carry.tokens, carry.i, carry.slow, carry.logits, carry.diag), plan)
    return state, out_tokens, taken, out_slow, out_logits, out_diag


def _hide_dense_rows(sfi_state, inputs: StepInputs, variant):
    """The deferred variant's state for the layers: the dense rows' compact counts 0 (they read
    no compact buffer; no layer writes c_len). The barrier materialises the mask once: without
    it XLA re-runs this fusion once per layer (docs/findings.md)."""
    if variant != "deferred":
        return sfi_state
    return sfi_state._replace(c_len=jax.lax.optimization_barrier(
        jnp.where(inputs.dense_rows[None, :, None], 0, sfi_state.c_len)))


def _sample(state: DecodeState, logits, sampling):
    """The next token [B], the next PRNG key and the per-row controls: one sampling config for
    all rows, or per-row sampling and budgets (`state.rows`, the Engine's slots)."""
    if state.rows is None:
        key, sub = jax.random.split(state.key)
        return sample(logits, sub, sampling), key, None
    token, keys = sample_rows(logits, state.rows)
    return token, state.key, state.rows._replace(keys=keys,
                                                 remaining=state.rows.remaining - ~state.done)


def _record(carry: LoopCarry, i, token, live, logits, refreshed, ys, return_logits) -> LoopCarry:
    """Step i's outputs: the token (-1 once a row ended), slow flags, logits, diagnostics."""
    out = carry._replace(tokens=carry.tokens.at[:, i].set(jnp.where(live, token, -1)))
    if refreshed is not None:
        out = out._replace(slow=out.slow.at[:, i].set(refreshed & live))
    if return_logits:
        out = out._replace(logits=out.logits.at[:, i].set(logits))
    if ys is not None:  # coverage, jaccard, each [L, B, Hkv]
        out = out._replace(diag=out.diag.at[:, :, i].set(jnp.swapaxes(jnp.stack(ys), 1, 2)))
    return out


def _apply_selections(select_all, sfi_state, out: LayerCarry, inputs: StepInputs, token):
    """The refreshed rows get their new selections (all layers at once) before the next step
    reads the compact buffers. `+ min(token, 0)` (a 0 XLA cannot fold) makes the update wait
    for this step's token, so for every layer's read of the buffers (else XLA copies them)."""
    B = token.shape[0]
    return jax.lax.cond(jnp.any(inputs.slots < B), select_all, lambda state, *_: state,
                        sfi_state, out.slow_logits, out.k, out.v,
                        inputs.pos + jnp.minimum(token, 0), inputs.slots)


def _next_state(state: DecodeState, out: LayerCarry, sfi_state, token, key, rows, logits, eos_mask,
                plan) -> DecodeState:
    """The state after a step: a row ends at EOS, when its budget is spent (`rows`) or at a
    NaN/inf logit (when checked); rows that had ended stay where they are (an idle slot never
    outgrows the cache)."""
    live = ~state.done
    done = state.done | eos_mask[token]
    if rows is not None:
        done = done | (rows.remaining <= 0)
    nonfinite = state.nonfinite
    if nonfinite is not None:
        nonfinite = nonfinite | (live & ~jnp.all(jnp.isfinite(logits), axis=-1))
        done = done | nonfinite
    state = DecodeState(k=out.k, v=out.v, lengths=jnp.where(live, state.lengths + 1,
                                                            state.lengths),
                        token=token, done=done, step=state.step + 1, key=key, sfi=sfi_state,
                        diag=out.diag, q_hist=out.q_hist, rows=rows, nonfinite=nonfinite)
    if plan is not None:  # keep the loop carry's shardings fixed
        state = mesh.constrain(state, mesh.decode_state_shardings(plan, state))
    return state
