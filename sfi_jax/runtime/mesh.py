"""Decode on a mesh: how one generate call splits its work (`ShardPlan`), the shardings of the
KV cache and the SFI state, and shard_map wrappers for the per-device parts of the decode loop.

The KV cache and the SFI state are split by batch row (data) and KV head (model), and the
decode attention kernels and the selector run under `jax.shard_map`, so every device reads
only its own rows and heads; the selector's cross-head term reduces over "model". The
wrappers take the function they run as an argument, so this module does not depend on the
decode loop. Meshes and the parameters' rules are in `models.sharding`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sfi_jax.models.sharding import (AXES, as_auto_mesh, axis_if_divides, axis_size, make_mesh,
                                     mesh_of, param_shardings, param_specs)
from sfi_jax.runtime.slots import local_slots
from sfi_jax.runtime.state import SFIState

__all__ = ["AXES", "ShardPlan", "as_auto_mesh", "attend", "axis_size", "cache_sharding",
           "constrain", "decode_state_shardings", "make_mesh", "mesh_of", "param_shardings",
           "param_specs", "place", "plan_for", "replicate", "select_all_layers",
           "select_and_compact", "sfi_state_shardings"]


# ----------------------------------------------------------------------------- decode state

@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How one generate call splits its work: the mesh, the axis batch rows go over and the axis
    KV heads go over (None: replicated). Hashable, so jitted functions take it as static."""

    mesh: Mesh
    batch_axis: str | None
    head_axis: str | None

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def rows(self) -> P:
        """Per-row vectors [B] inside shard_map (they are kept replicated outside)."""
        return P(self.batch_axis)

    def per_head(self, ndim: int, lead: int = 0) -> P:
        """Spec for an array whose axes `lead`, `lead + 1` are (batch, KV head)."""
        return P(*([None] * lead), self.batch_axis, self.head_axis, *([None] * (ndim - lead - 2)))

    @property
    def shard_factor(self) -> int:
        """How many ways the cache is split (for per-device memory estimates)."""
        return axis_size(self.mesh, self.batch_axis) * axis_size(self.mesh, self.head_axis)


def plan_for(cfg, mesh: Mesh | None, batch: int) -> ShardPlan | None:
    """Batch rows over "data" when it divides the batch, KV heads over "model" when it divides
    the KV heads; otherwise that dimension is replicated (correct, with redundant work)."""
    if mesh is None:
        return None
    mesh = as_auto_mesh(mesh)
    return ShardPlan(mesh, axis_if_divides(mesh, "data", batch),
                     axis_if_divides(mesh, "model", cfg.num_kv_heads))


def cache_sharding(plan: ShardPlan) -> NamedSharding:
    """KV cache [L, B, Hkv, S, D]."""
    return plan.sharding(plan.per_head(5, lead=1))


def sfi_state_shardings(plan: ShardPlan, remembers: bool = False):
    """SFIState of shardings: per-(row, head) arrays split, per-row counters replicated;
    remembers: the state holds the selection memory's scores (SFIConfig.remembers)."""
    rep = plan.replicated
    per_slot = plan.sharding(plan.per_head(4, lead=1))
    return SFIState(ck=cache_sharding(plan), cv=cache_sharding(plan),
                    c_len=plan.sharding(plan.per_head(3, lead=1)),
                    positions=per_slot, key_norms=plan.sharding(plan.per_head(4, lead=1)),
                    since_slow=rep, pending=rep, slow_steps=rep, fast_steps=rep,
                    scores=per_slot if remembers else None)


def decode_state_shardings(plan: ShardPlan, state):
    """Shardings for a DecodeState: the cache and SFI state split, per-row vectors replicated
    (small, and readable by the host on every process)."""
    rep = plan.replicated
    out = {f: rep for f in state._fields}
    out.update(k=cache_sharding(plan), v=cache_sharding(plan))
    if state.sfi is not None:
        out["sfi"] = sfi_state_shardings(plan, state.sfi.scores is not None)
    if getattr(state, "diag", None) is not None:
        out["diag"] = plan.sharding(plan.per_head(4, lead=1))
    return type(state)(**{f: (out[f] if getattr(state, f) is not None else None)
                          for f in state._fields})


def constrain(tree, shardings):
    """with_sharding_constraint over matching pytrees (None leaves pass through)."""
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, s), tree, shardings)


def place(make, shardings):
    """Run `make()` (which builds arrays) under jit straight into `shardings`, so a large cache
    never exists whole on one device."""
    return jax.jit(make, out_shardings=shardings)()


def replicate(tree, plan: ShardPlan | None):
    """Make host-read results fully replicated (each process can read them)."""
    if plan is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, plan.replicated), tree)


# ----------------------------------------------------------------------------- shard_map wrappers

def _shard_map(plan: ShardPlan, fn, in_specs, out_specs):
    # check_vma off: Pallas kernels inside need not declare how their outputs vary.
    return jax.shard_map(fn, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


_BIG = ("ck", "cv", "c_len", "positions", "key_norms", "scores")
"""The SFIState fields split over rows and KV heads (scores None unless the selection
remembers: an empty subtree to shard_map)."""


def _big(st):
    return None if st is None else tuple(getattr(st, f) for f in _BIG)


def _big_specs(plan):
    """Specs of `_big`'s arrays: rows over the batch axis, KV heads over the head axis."""
    h = plan.per_head
    return (h(5, lead=1), h(5, lead=1), h(3, lead=1), h(4, lead=1), h(4, lead=1), h(4, lead=1))


def _local_state(big):
    """A device's SFIState of `_big`'s arrays (no per-row counters: the callers need none)."""
    return SFIState(*big[:5], None, None, None, None, scores=big[5])


def _with_big(st, big):
    return st._replace(**dict(zip(_BIG, big)))


def attend(plan: ShardPlan, fn, q, k_new, v_new, k, v, st, buf, l, pos, dense_rows, slots):
    """Run one layer's decode attention (one of `runtime.decode`'s attention variants) under shard_map: each
    device writes and attends its own rows and KV heads. fn(q, k_new, v_new, k, v, st, buf, l, pos,
    dense_rows, slots, head_axis=...) returns a `LayerAttention` (attn, k, v, sfi, slow_logits);
    this returns those as a tuple.

    slots: global refresh rows [n] (B = empty). Each device refreshes exactly the global slots
    that fall in its rows, with at most min(n, local rows) slots of work; `buf` (the refreshed
    rows' logits) holds each device's local slots.
    """
    B = q.shape[0]
    n_slots = None if slots is None else slots.shape[0]
    row, h = plan.rows, plan.per_head
    heads3 = h(3)  # q, k_new, v_new [B, H, D]
    cache = h(5, lead=1)
    big = _big(st)
    big_specs = None if big is None else _big_specs(plan)
    mask = None if slots is None else jnp.zeros((B,), bool).at[slots].set(True, mode="drop")

    def body(q, k_new, v_new, k, v, big, buf, l, pos, dense_rows, mask):
        local_st = None if big is None else _local_state(big)
        slots_here = local_slots(mask, n_slots) if mask is not None else None
        out = fn(q, k_new, v_new, k, v, local_st, buf, l, pos, dense_rows, slots_here,
                 head_axis=plan.head_axis)
        return out.attn, out.k, out.v, _big(out.sfi), out.slow_logits

    buf_spec = None if buf is None else cache
    in_specs = (heads3, heads3, heads3, cache, cache, big_specs, buf_spec, P(), row,
                None if dense_rows is None else row, None if mask is None else row)
    out_specs = (heads3, cache, cache, big_specs, buf_spec)
    attn, k, v, big, buf = _shard_map(plan, body, in_specs, out_specs)(
        q, k_new, v_new, k, v, big, buf, l, pos, dense_rows, mask)
    if st is not None:
        st = _with_big(st, big)
    return attn, k, v, st, buf


def select_all_layers(plan: ShardPlan, fn, st, buf, k, v, pos, slots):
    """Run the deferred selection (`runtime.selection.select_all_layers`) under shard_map (each device selects for its own refreshed
    rows and KV heads; the cross-head term is reduced over the head axis)."""
    B = pos.shape[0]
    n_slots = slots.shape[0]
    row, h = plan.rows, plan.per_head
    cache = h(5, lead=1)
    big_specs = _big_specs(plan)
    mask = jnp.zeros((B,), bool).at[slots].set(True, mode="drop")

    def body(big, buf, k, v, pos, mask):
        local = _local_state(big)
        local = fn(local, buf, k, v, pos, local_slots(mask, n_slots), head_axis=plan.head_axis)
        return _big(local)

    big = _shard_map(plan, body, (big_specs, cache, cache, cache, row, row), big_specs)(
        _big(st), buf, k, v, pos, mask)
    return _with_big(st, big)


def select_and_compact(plan: ShardPlan, fn, logits, key_norms, k_layer, v_layer, lo, hi, lengths,
                       remembers: bool = False):
    """Run fn(logits, key_norms, k_layer, v_layer, lo, hi, lengths, head_axis=...) under
    shard_map over rows and KV heads (the prefill selection of one layer): (ck, cv, c_len,
    positions), and the held scores when the selection remembers."""
    row, h = plan.rows, plan.per_head
    in_specs = (h(4), h(3), h(4), h(4), row, row, row)
    out_specs = (h(4), h(4), h(2), h(3)) + ((h(3),) if remembers else ())

    def body(*args):
        return fn(*args, head_axis=plan.head_axis)

    return _shard_map(plan, body, in_specs, out_specs)(logits, key_norms, k_layer, v_layer, lo,
                                                       hi, lengths)
