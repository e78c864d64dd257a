"""Device meshes and sharding rules.

Axes: "data" splits batch rows, "model" splits attention heads and MLP width (tensor
parallel), "expert" (optional) splits MoE experts; without it experts go over "model".
The KV cache and the SFI state are split by batch row (data) and KV head (model), and the
decode attention kernels and the selector run under `jax.shard_map`, so every device reads
only its own rows and heads; the selector's cross-head term reduces over "model".

A tensor whose dimension an axis does not divide is replicated along that axis (SmolLM2's
3 KV heads on a 2-way model axis, say): any mesh runs any model, at a cost in memory.

Meshes are used with AxisType.Auto (GSPMD propagation through the model code). A mesh with
Explicit axes, the default of `jax.make_mesh` on new jax, is rebuilt as Auto over the same
devices in the same order.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "model", "expert")


# ----------------------------------------------------------------------------- meshes

def _parse_spec(spec) -> dict[str, int]:
    if isinstance(spec, str):
        text = spec.strip().lower()
        if not re.fullmatch(r"\d+(x\d+){1,2}", text):
            raise ValueError(f"mesh spec {spec!r} is not 'DxM' or 'DxMxE' (e.g. '2x4', '1x4x2': "
                             "data x model x expert)")
        sizes = [int(n) for n in text.split("x")]
        shape = dict(zip(AXES, sizes))
    elif isinstance(spec, dict):
        unknown = sorted(set(spec) - set(AXES))
        if unknown:
            raise ValueError(f"mesh axes {unknown} are unknown; allowed axes are {AXES}")
        shape = {a: spec[a] for a in AXES if a in spec}
        shape.setdefault("data", 1)
        shape.setdefault("model", 1)
    else:
        raise ValueError(f"mesh spec must be a 'DxM' / 'DxMxE' string, a dict of axis sizes or "
                         f"a jax.sharding.Mesh, got {type(spec).__name__}")
    for name, n in shape.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"mesh axis {name!r} must have a size >= 1, got {n!r}")
    return shape


def make_mesh(spec, *, devices=None) -> Mesh | None:
    """A mesh from "DxM" / "DxMxE" (data x model x expert), a dict like {"data": 2, "model": 4},
    or an existing Mesh (checked, and rebuilt with Auto axes). None gives None (one device).

    The sizes must multiply to the number of devices (all processes' devices, multi-host)."""
    if spec is None:
        return None
    if isinstance(spec, Mesh):
        return as_auto_mesh(spec)
    shape = _parse_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    n = math.prod(shape.values())
    if n != len(devices):
        text = "x".join(str(s) for s in shape.values())
        raise ValueError(f"mesh {text} ({', '.join(shape)}) needs {n} devices but {len(devices)} "
                         f"are available; choose sizes whose product is {len(devices)}")
    names = tuple(shape)
    return jax.make_mesh(tuple(shape.values()), names, axis_types=(AxisType.Auto,) * len(names),
                         devices=devices)


def as_auto_mesh(mesh: Mesh) -> Mesh:
    """Check the axis names and return the mesh with every axis of type Auto."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    unknown = [a for a in mesh.axis_names if a not in AXES]
    if unknown:
        raise ValueError(f"mesh axes {unknown} are unknown; name the axes from {AXES} "
                         f"(got {tuple(mesh.axis_names)})")
    types = getattr(mesh, "axis_types", None)
    if types is not None and all(t == AxisType.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def mesh_of(tree) -> Mesh | None:
    """The mesh of the first NamedSharding leaf of a pytree of arrays (None: not on a mesh)."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return as_auto_mesh(sharding.mesh)
    return None


def _size(mesh: Mesh, axis: str | None) -> int:
    return mesh.shape[axis] if axis in mesh.shape else 1


axis_size = _size


def _axis_if_divides(mesh: Mesh, axis: str, n: int) -> str | None:
    """`axis` when the mesh has it and its size divides n (size-1 axes count as dividing)."""
    return axis if axis in mesh.shape and n % mesh.shape[axis] == 0 else None


# ----------------------------------------------------------------------------- parameters

def param_specs(cfg, mesh: Mesh) -> dict:
    """PartitionSpec per parameter, matching `models.modeling.param_shapes(cfg)`."""
    from sfi_jax.models.modeling import param_shapes

    mesh = as_auto_mesh(mesh)
    shapes = param_shapes(cfg)
    q_ax = _axis_if_divides(mesh, "model", cfg.num_q_heads)
    kv_ax = _axis_if_divides(mesh, "model", cfg.num_kv_heads)
    vocab_ax = _axis_if_divides(mesh, "model", cfg.vocab_size)
    rules = {
        "attn_norm": P(), "mlp_norm": P(), "q_norm": P(), "k_norm": P(),
        "wq": P(None, None, q_ax), "wk": P(None, None, kv_ax), "wv": P(None, None, kv_ax),
        "wo": P(None, q_ax, None),
    }
    if cfg.is_moe:
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        ex_ax = _axis_if_divides(mesh, "expert", E) if "expert" in mesh.shape else \
            _axis_if_divides(mesh, "model", E)
        # with a separate expert axis, the expert MLP width still splits over "model"
        i_ax = _axis_if_divides(mesh, "model", I) if ex_ax != "model" else None
        rules.update(router=P(), we_gate=P(None, ex_ax, None, i_ax),
                     we_up=P(None, ex_ax, None, i_ax), we_down=P(None, ex_ax, i_ax, None))
    else:
        mlp_ax = _axis_if_divides(mesh, "model", cfg.intermediate_size)
        rules.update(w_gate=P(None, None, mlp_ax), w_up=P(None, None, mlp_ax),
                     w_down=P(None, mlp_ax, None))
    out = {"embed": P(vocab_ax, None), "final_norm": P(),
           "layers": {name: rules[name] for name in shapes["layers"]}}
    if "lm_head" in shapes:
        out["lm_head"] = P(None, vocab_ax)
    return out


def param_shardings(cfg, mesh: Mesh, split_layers: bool = False) -> dict:
    """NamedSharding per parameter: tensor parallel over heads and MLP width, expert parallel
    for MoE, vocab-split embedding and LM head; replicated where an axis does not divide.
    split_layers: the layout with one weight dict per layer (no leading layer axis)."""
    mesh = as_auto_mesh(mesh)
    specs = param_specs(cfg, mesh)
    if split_layers:
        one = {name: P(*spec[1:]) for name, spec in specs["layers"].items()}
        specs["layers"] = [dict(one) for _ in range(cfg.num_layers)]
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, P))


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
        return _size(self.mesh, self.batch_axis) * _size(self.mesh, self.head_axis)


def plan_for(cfg, mesh: Mesh | None, batch: int) -> ShardPlan | None:
    """Batch rows over "data" when it divides the batch, KV heads over "model" when it divides
    the KV heads; otherwise that dimension is replicated (correct, with redundant work)."""
    if mesh is None:
        return None
    mesh = as_auto_mesh(mesh)
    return ShardPlan(mesh, _axis_if_divides(mesh, "data", batch),
                     _axis_if_divides(mesh, "model", cfg.num_kv_heads))


def cache_sharding(plan: ShardPlan) -> NamedSharding:
    """KV cache [L, B, Hkv, S, D]."""
    return plan.sharding(plan.per_head(5, lead=1))


def sfi_state_shardings(plan: ShardPlan):
    """SFIState of shardings: per-(row, head) arrays split, per-row counters replicated."""
    from sfi_jax.runtime.state import SFIState

    rep = plan.replicated
    return SFIState(ck=cache_sharding(plan), cv=cache_sharding(plan),
                    c_len=plan.sharding(plan.per_head(3, lead=1)),
                    positions=plan.sharding(plan.per_head(4, lead=1)),
                    key_norms=plan.sharding(plan.per_head(4, lead=1)),
                    since_slow=rep, pending=rep, slow_steps=rep, fast_steps=rep)


def decode_state_shardings(plan: ShardPlan, state):
    """Shardings for a DecodeState: the cache and SFI state split, per-row vectors replicated
    (small, and readable by the host on every process)."""
    rep = plan.replicated
    out = {f: rep for f in state._fields}
    out.update(k=cache_sharding(plan), v=cache_sharding(plan))
    if state.sfi is not None:
        out["sfi"] = sfi_state_shardings(plan)
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


def _local_slots(mask, n_slots):
    """This device's refresh rows from the global slot mask over its rows (B_local = empty)."""
    from sfi_jax.runtime.engine import unique_slots

    n = min(n_slots, mask.shape[0])
    return unique_slots(jnp.nonzero(mask, size=n, fill_value=mask.shape[0])[0], mask.shape[0])


def _big(st):
    return None if st is None else (st.ck, st.cv, st.c_len, st.positions, st.key_norms)


def _big_specs(plan):
    """Specs of `_big`'s arrays: rows over the batch axis, KV heads over the head axis."""
    h = plan.per_head
    return (h(5, lead=1), h(5, lead=1), h(3, lead=1), h(4, lead=1), h(4, lead=1))


def _with_big(st, big):
    return st._replace(ck=big[0], cv=big[1], c_len=big[2], positions=big[3], key_norms=big[4])


def attend(plan: ShardPlan, fn, q, kk, vv, k, v, st, buf, l, pos, dense_rows, slots):
    """Run engine._attend under shard_map: each device writes and attends its own rows and KV
    heads. fn(q, kk, vv, k, v, st, buf, l, pos, dense_rows, slots, head_axis=...) ->
    (attn, k, v, st, buf).

    slots: global refresh rows [n] (B = empty). Each device refreshes exactly the global slots
    that fall in its rows, with at most min(n, local rows) slots of work; `buf` (the refreshed
    rows' logits) holds each device's local slots.
    """
    from sfi_jax.runtime.state import SFIState

    B = q.shape[0]
    n_slots = None if slots is None else slots.shape[0]
    row, h = plan.rows, plan.per_head
    heads3 = h(3)  # q, kk, vv [B, H, D]
    cache = h(5, lead=1)
    big = _big(st)
    big_specs = _big_specs(plan)
    mask = None if slots is None else jnp.zeros((B,), bool).at[slots].set(True, mode="drop")

    def body(q, kk, vv, k, v, big, buf, l, pos, dense_rows, mask):
        local_st = None if big is None else SFIState(*big, None, None, None, None)
        local_slots = None if mask is None else _local_slots(mask, n_slots)
        attn, k, v, local_st, buf = fn(q, kk, vv, k, v, local_st, buf, l, pos, dense_rows,
                                       local_slots, head_axis=plan.head_axis)
        return attn, k, v, _big(local_st), buf

    big_spec = big_specs if big is not None else None
    buf_spec = None if buf is None else cache
    in_specs = (heads3, heads3, heads3, cache, cache, big_spec, buf_spec, P(), row,
                None if dense_rows is None else row, None if mask is None else row)
    out_specs = (heads3, cache, cache, big_spec, buf_spec)
    attn, k, v, big, buf = _shard_map(plan, body, in_specs, out_specs)(
        q, kk, vv, k, v, big, buf, l, pos, dense_rows, mask)
    if st is not None:
        st = _with_big(st, big)
    return attn, k, v, st, buf


def select_all_layers(plan: ShardPlan, fn, st, buf, k, v, pos, slots):
    """Run engine._select_all_layers under shard_map (each device selects for its own refreshed
    rows and KV heads; the cross-head term is reduced over the head axis)."""
    from sfi_jax.runtime.state import SFIState

    B = pos.shape[0]
    n_slots = slots.shape[0]
    row, h = plan.rows, plan.per_head
    cache = h(5, lead=1)
    big_specs = _big_specs(plan)
    mask = jnp.zeros((B,), bool).at[slots].set(True, mode="drop")

    def body(big, buf, k, v, pos, mask):
        local = SFIState(*big, None, None, None, None)
        local = fn(local, buf, k, v, pos, _local_slots(mask, n_slots), head_axis=plan.head_axis)
        return _big(local)

    big = _shard_map(plan, body, (big_specs, cache, cache, cache, row, row), big_specs)(
        _big(st), buf, k, v, pos, mask)
    return _with_big(st, big)


def select_and_compact(plan: ShardPlan, fn, logits, key_norms, k_layer, v_layer, lo, hi, lengths):
    """Run fn(logits, key_norms, k_layer, v_layer, lo, hi, lengths, head_axis=...) under
    shard_map over rows and KV heads (the prefill selection of one layer)."""
    row, h = plan.rows, plan.per_head
    in_specs = (h(4), h(3), h(4), h(4), row, row, row)
    out_specs = (h(4), h(4), h(2), h(3))

    def body(*args):
        return fn(*args, head_axis=plan.head_axis)

    return _shard_map(plan, body, in_specs, out_specs)(logits, key_norms, k_layer, v_layer, lo,
                                                       hi, lengths)
