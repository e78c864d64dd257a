"""Device meshes and the parameters' sharding rules.

Axes: "data" splits batch rows, "model" splits attention heads and MLP width (tensor
parallel), "expert" (optional) splits MoE experts; without it experts go over "model".
A tensor whose dimension an axis does not divide is replicated along that axis (SmolLM2's
3 KV heads on a 2-way model axis, say): any mesh runs any model, at a cost in memory.

Meshes are used with AxisType.Auto (GSPMD propagation through the model code). A mesh with
Explicit axes, the default of `jax.make_mesh` on new jax, is rebuilt as Auto over the same
devices in the same order. The decode state's shardings and the shard_map wrappers of the
decode loop are in `runtime.mesh`.
"""

from __future__ import annotations

import math
import re

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sfi_jax.models.modeling import param_shapes

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


def axis_size(mesh: Mesh, axis: str | None) -> int:
    """The size of a mesh axis (1 for None or an axis the mesh lacks)."""
    return mesh.shape[axis] if axis in mesh.shape else 1


def axis_if_divides(mesh: Mesh, axis: str, n: int) -> str | None:
    """`axis` when the mesh has it and its size divides n (size-1 axes count as dividing)."""
    return axis if axis in mesh.shape and n % mesh.shape[axis] == 0 else None


# ----------------------------------------------------------------------------- parameters

def param_specs(cfg, mesh: Mesh) -> dict:
    """PartitionSpec per parameter, matching `models.modeling.param_shapes(cfg)`."""
    mesh = as_auto_mesh(mesh)
    shapes = param_shapes(cfg)
    q_ax = axis_if_divides(mesh, "model", cfg.num_q_heads)
    kv_ax = axis_if_divides(mesh, "model", cfg.num_kv_heads)
    vocab_ax = axis_if_divides(mesh, "model", cfg.vocab_size)
    rules = {
        "attn_norm": P(), "mlp_norm": P(), "q_norm": P(), "k_norm": P(),
        "wq": P(None, None, q_ax), "wk": P(None, None, kv_ax), "wv": P(None, None, kv_ax),
        "wo": P(None, q_ax, None),
    }
    if cfg.is_moe:
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        ex_ax = axis_if_divides(mesh, "expert", E) if "expert" in mesh.shape else \
            axis_if_divides(mesh, "model", E)
        # with a separate expert axis, the expert MLP width still splits over "model"
        i_ax = axis_if_divides(mesh, "model", I) if ex_ax != "model" else None
        rules.update(router=P(), we_gate=P(None, ex_ax, None, i_ax),
                     we_up=P(None, ex_ax, None, i_ax), we_down=P(None, ex_ax, i_ax, None))
    else:
        mlp_ax = axis_if_divides(mesh, "model", cfg.intermediate_size)
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
