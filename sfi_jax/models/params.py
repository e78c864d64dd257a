"""Weights: random init on device, Hugging Face safetensors, GGUF, and the shared placement.

Every loader produces a `getter(hf_name) -> numpy array-like` in Hugging Face layout; one
planner maps those tensors onto our stacked layout and places each shard straight on its
device with `jax.make_array_from_callback`, so a mesh never needs the whole model on one host.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  numpy's 'bfloat16' for safetensors
import numpy as np

from sfi_jax.models.config import ModelConfig
from sfi_jax.models.modeling import param_shapes

Getter = Callable[[str], np.ndarray]

_NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm")


def _tree_items(shapes):
    for name, shape in shapes.items():
        if isinstance(shape, dict):
            for sub, s in shape.items():
                yield (name, sub), s
        else:
            yield (name,), shape


def _set(tree, path, value):
    node = tree
    for p in path[:-1]:
        node = node.setdefault(p, {})
    node[path[-1]] = value


def default_shardings(cfg: ModelConfig, mesh=None):
    """Sharding per parameter: replicated on one device, or the mesh rules of models.sharding."""
    if mesh is None:
        device = jax.devices()[0]
        return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device),
                            param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    from sfi_jax.models.sharding import param_shardings

    return param_shardings(cfg, mesh)


def random_params(cfg: ModelConfig, dtype="bfloat16", seed: int = 0, mesh=None) -> dict:
    """Random weights created directly on device(s) in `dtype` (no host copy of the model).
    The initialiser compiles once per (config, dtype, seed, mesh) in a process: another call
    with the same arguments makes new arrays of the same values without compiling again."""
    return _random_init(cfg, jnp.dtype(dtype), int(seed), mesh)()


@functools.lru_cache(maxsize=16)
def _random_init(cfg: ModelConfig, dtype, seed: int, mesh):
    """random_params' jitted initialiser (no arguments: the values depend on these only)."""
    shapes = param_shapes(cfg)
    shardings = default_shardings(cfg, mesh)

    def init():
        out = {}
        keys = iter(jax.random.split(jax.random.key(seed), 64))
        for path, shape in _tree_items(shapes):
            if path[-1] in _NORMS:
                value = jnp.ones(shape, dtype)
            else:
                fan_in = shape[-2] if len(shape) >= 2 else shape[-1]
                std = 0.02 if path[-1] in ("embed", "lm_head") else fan_in ** -0.5
                value = (jax.random.normal(next(keys), shape, jnp.float32) * std).astype(dtype)
            _set(out, path, value)
        return out

    return jax.jit(init, out_shardings=shardings)


def _hf_plan(cfg: ModelConfig) -> dict:
    """our path -> (function layer -> HF tensor name, transpose?) for per-layer tensors."""
    p = "model.layers.{}."
    plan = {
        "attn_norm": (p + "input_layernorm.weight", False),
        "mlp_norm": (p + "post_attention_layernorm.weight", False),
        "wq": (p + "self_attn.q_proj.weight", True), "wk": (p + "self_attn.k_proj.weight", True),
        "wv": (p + "self_attn.v_proj.weight", True), "wo": (p + "self_attn.o_proj.weight", True),
        "q_norm": (p + "self_attn.q_norm.weight", False),
        "k_norm": (p + "self_attn.k_norm.weight", False),
        "w_gate": (p + "mlp.gate_proj.weight", True), "w_up": (p + "mlp.up_proj.weight", True),
        "w_down": (p + "mlp.down_proj.weight", True),
        "router": (p + "mlp.gate.weight", True),
        "we_gate": (p + "mlp.experts.{}.gate_proj.weight", True),
        "we_up": (p + "mlp.experts.{}.up_proj.weight", True),
        "we_down": (p + "mlp.experts.{}.down_proj.weight", True),
    }
    return plan


def _read(getter: Getter, name: str, transpose: bool, index: tuple, expected: tuple):
    """The slice `index` of tensor `name` (of its transpose when `transpose`): only that slice
    is read from a lazy tensor."""
    t = getter(name)
    shape = tuple(t.shape[::-1] if transpose else t.shape)
    if shape != tuple(expected):
        where = getattr(t, "source", "checkpoint")
        raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                         f"{tuple(expected[::-1]) if transpose else tuple(expected)} from the config")
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return np.asarray(t[index[::-1]]).T if transpose else np.asarray(t[index])


def params_from_getter(cfg: ModelConfig, getter: Getter, dtype="bfloat16", mesh=None) -> dict:
    """Place checkpoint tensors (HF names and layout) into our stacked layout, shard by shard."""
    shapes = param_shapes(cfg)
    shardings = default_shardings(cfg, mesh)
    dtype = np.dtype(jnp.dtype(dtype))
    plan = _hf_plan(cfg)
    out = {}
    for path, shape in _tree_items(shapes):
        sharding = shardings[path[0]] if len(path) == 1 else shardings[path[0]][path[1]]
        if path == ("embed",):
            fn = lambda idx: _read(getter, "model.embed_tokens.weight", False, idx, shape)
        elif path == ("final_norm",):
            fn = lambda idx: _read(getter, "model.norm.weight", False, idx, shape)
        elif path == ("lm_head",):
            fn = lambda idx: _read(getter, "lm_head.weight", True, idx, shape)
        else:
            template, transpose = plan[path[1]]
            expert = path[1].startswith("we_")

            def fn(idx, template=template, transpose=transpose, expert=expert, shape=shape):
                layers = range(cfg.num_layers)[idx[0]]
                if not expert:
                    return np.stack([_read(getter, template.format(l), transpose, idx[1:],
                                           shape[1:]) for l in layers])
                experts = range(cfg.num_experts)[idx[1]]
                return np.stack([np.stack([_read(getter, template.format(l, e), transpose,
                                                 idx[2:], shape[2:]) for e in experts])
                                 for l in layers])

        cast = lambda idx, fn=fn: np.asarray(fn(idx), np.float32).astype(dtype)
        _set(out, path, jax.make_array_from_callback(shape, sharding, cast))
    return out


# ---- safetensors (the `safetensors` library: validated headers, lazy reads by slice) ----

class SafetensorsTensor:
    """One tensor of an open safetensors file: its shape, and the data of a slice read only
    when indexed (numpy's bfloat16 comes from ml_dtypes)."""

    def __init__(self, handle, name: str, path: str):
        self._handle, self.name, self.source = handle, name, path  # the handle stays open
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, index) -> np.ndarray:
        try:
            return np.asarray(self._slice[index])
        except Exception as e:  # the library's SafetensorError and numpy's errors
            raise ValueError(f"{self.source}: tensor {self.name!r} could not be read "
                             f"({type(e).__name__}: {e})") from None


def open_safetensors(path: str) -> dict[str, SafetensorsTensor]:
    """The tensors of one .safetensors file, by name (the header validated, nothing read)."""
    from safetensors import safe_open

    try:
        handle = safe_open(path, framework="numpy")
        return {name: SafetensorsTensor(handle, name, path) for name in handle.keys()}
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except Exception as e:  # SafetensorError: bad header, offsets, dtype or size
        raise ValueError(f"{path} is not a valid safetensors file ({e})") from None


def safetensors_getter(directory: str) -> Getter:
    """All tensors of a Hugging Face directory (single file or sharded with an index)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a "
                             f"'weight_map' of tensor -> file): {type(e).__name__}: {e}") from None
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    tensors = {}
    for f in files:
        path = os.path.join(directory, str(f))
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is listed in the index but missing")
        tensors.update(open_safetensors(path))

    def get(name):
        if name not in tensors:
            raise ValueError(f"tensor {name!r} missing from the checkpoint in {directory}")
        return tensors[name]

    return get
