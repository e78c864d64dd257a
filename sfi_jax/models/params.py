"""Weights: random init on device, Hugging Face safetensors, GGUF, and the shared placement.

Every loader produces a `getter(hf_name) -> numpy array-like` in Hugging Face layout; one
planner maps those tensors onto our stacked layout and places each shard straight on its
device with `jax.make_array_from_callback`, so a mesh never needs the whole model on one host.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
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

                def normal(key, shape=shape, std=std):
                    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)

                if len(shape) >= 3:  # stacked per layer: one layer's float32 draw at a time,
                    # not the whole stack's (Qwen3-30B-A3B's experts: 38 GB; the initialiser's
                    # temporaries on the CPU 294 -> 21 GiB beside 57 GiB of weights)
                    value = lax.map(lambda k, s=shape[1:]: normal(k, s),
                                    jax.random.split(next(keys), shape[0]))
                else:
                    value = normal(next(keys))
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


_GLOBALS = {"embed": ("model.embed_tokens.weight", False),
            "final_norm": ("model.norm.weight", False), "lm_head": ("lm_head.weight", True)}
# Stored dtypes placed as they are (another floating dtype is made float32 on the host first)
_DEVICE_DTYPES = ("bfloat16", "float16", "float32")
# Checkpoint bytes read ahead of the parameter being finished, and the threads reading them
READ_AHEAD_BYTES = 2 << 30
READ_THREADS = min(8, os.cpu_count() or 1)
# Platforms whose devices are the host's CPU: stacked layers are laid out there in numpy
HOST_LAYOUT_PLATFORMS = ("cpu",)


class _Source:
    """One checkpoint tensor a parameter is made of (its shape and dtype checked up front),
    and whether our layout is its transpose."""

    def __init__(self, getter: Getter, name: str, transpose: bool, expected: tuple):
        t = getter(name)
        where = getattr(t, "source", "checkpoint")
        want = tuple(expected[::-1]) if transpose else tuple(expected)
        if tuple(t.shape) != want:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                             f"{want} from the config")
        try:
            dtype = np.dtype(t.dtype)
        except TypeError:
            dtype = None
        if dtype is None or (dtype.kind != "f" and dtype.name != "bfloat16"):
            found = dtype.name if dtype is not None else t.dtype
            raise ValueError(f"{where}: tensor {name!r} has dtype {found}; expected a "
                             f"floating-point tensor ({', '.join(_DEVICE_DTYPES)})")
        self.tensor, self.name, self.transpose, self.shape = t, name, transpose, want
        self.dtype = dtype if dtype.name in _DEVICE_DTYPES else np.dtype(np.float32)
        self.nbytes = int(np.prod(want)) * self.dtype.itemsize

    def read(self, index: tuple) -> np.ndarray:
        """The slice `index` of the stored tensor, in the stored dtype."""
        return np.asarray(self.tensor[tuple(index)], self.dtype)


def _place(sources: list[_Source], experts: bool, sharding) -> jax.Array:
    """One tensor, or a layer's experts stacked on a leading axis, in the checkpoint's layout
    and dtype, placed shard by shard (a process reads only the slices its devices hold).
    `sharding` is the one of our layout; the checkpoint layout's swaps a transposed pair."""
    first = sources[0]
    shape = ((len(sources),) if experts else ()) + first.shape
    if experts:
        def read(index):
            return np.stack([s.read(index[1:]) for s in sources[index[0]]])
    else:
        read = first.read
    if isinstance(sharding, jax.sharding.NamedSharding):
        axes = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        if first.transpose:
            axes = axes[:-2] + (axes[-1], axes[-2])
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*axes))
    return jax.make_array_from_callback(shape, sharding, read)


def _ours(raw, transpose: bool, dtype):
    return (jnp.swapaxes(raw, -1, -2) if transpose else raw).astype(dtype)


def _constrain(tree, shardings):
    """`tree` placed as `shardings` (a sharding, name -> sharding pairs for a dict, or None)."""
    if shardings is None:
        return tree
    if isinstance(shardings, tuple):
        shardings = dict(shardings)
    return jax.lax.with_sharding_constraint(tree, shardings)


@functools.partial(jax.jit, static_argnames=("transposes", "dtype", "k_major", "fuse",
                                              "shardings"))
def _layer_to_ours(raw: dict, transposes: tuple, dtype: str, k_major: bool, fuse: bool,
                   shardings):
    """One layer's weights from the checkpoint's layout to ours: transposed and cast on the
    device, q/k/v fused when `fuse`; with k_major the `K_MAJOR` weights keep the checkpoint's
    [out, in] layout, which is that layout's."""
    from sfi_jax.models.modeling import K_MAJOR, T_SUFFIX, fuse_qkv_weights

    out = {}
    for name, transpose in transposes:
        if k_major and name in K_MAJOR:
            out[name + T_SUFFIX] = raw[name].astype(dtype)
        else:
            out[name] = _ours(raw[name], transpose, dtype)
    return _constrain(fuse_qkv_weights(out) if fuse else out, shardings)


@functools.partial(jax.jit, static_argnames=("transpose", "dtype", "sharding"))
def _stack_to_ours(raws: list, transpose: bool, dtype: str, sharding):
    """One parameter's per-layer tensors stacked on the layer axis, in our layout and dtype."""
    return _constrain(jnp.stack([_ours(r, transpose, dtype) for r in raws]), sharding)


@functools.partial(jax.jit, static_argnames=("transpose", "dtype", "sharding"))
def _one_to_ours(raw, transpose: bool, dtype: str, sharding):
    return _constrain(_ours(raw, transpose, dtype), sharding)


def _free(arrays):
    for a in arrays:
        if not a.is_deleted():
            a.delete()


def params_from_getter(cfg: ModelConfig, getter: Getter, dtype="bfloat16", mesh=None, *,
                       split_layers: bool = False, fuse_qkv: bool = False,
                       k_major: bool = False) -> dict:
    """Place checkpoint tensors (HF names and layout) into our layout, straight onto the
    device(s).

    Every tensor is checked (present, its shape, a floating dtype) before anything is read.
    Threads then read the tensors in their stored dtype, a few ahead, and place them shard by
    shard in the checkpoint's layout; the transposes, casts and layer stacking run on the
    device, one parameter or layer at a time, so a mesh never needs the whole model on one
    host and the host makes no copy beyond the read. split_layers: one weight dict per layer
    (`Model.split_layers`), built per layer, with fuse_qkv and k_major applied as there.
    """
    from sfi_jax.models.sharding import param_shardings

    if (fuse_qkv or k_major) and not split_layers:
        raise ValueError("fuse_qkv and k_major are layouts of split layers (split_layers=True)")
    if (fuse_qkv or k_major) and mesh is not None:
        raise ValueError("fuse_qkv and k_major are one-device layouts; they cannot be used "
                         "with a mesh")
    shapes = param_shapes(cfg)
    dtype = jnp.dtype(dtype).name
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes, is_leaf=lambda x: isinstance(x, tuple))
        layer_shardings = shardings["layers"]
    else:
        shardings = param_shardings(cfg, mesh)
        layer_shardings = param_shardings(cfg, mesh, split_layers=True)["layers"][0]
    plan = _hf_plan(cfg)
    layer_names = list(shapes["layers"])

    def sources(name, layer):
        template, transpose = plan[name]
        shape = shapes["layers"][name][1:]
        if name.startswith("we_"):
            return [_Source(getter, template.format(layer, e), transpose, shape[1:])
                    for e in range(cfg.num_experts)]
        return [_Source(getter, template.format(layer), transpose, shape)]

    globals_ = {n: _Source(getter, _GLOBALS[n][0], _GLOBALS[n][1], shapes[n])
                for n in shapes if n != "layers"}
    per_layer = [{n: sources(n, l) for n in layer_names} for l in range(cfg.num_layers)]

    devices = [jax.devices()[0]] if mesh is None else list(mesh.devices.flat)
    host = not split_layers and all(d.platform in HOST_LAYOUT_PLATFORMS for d in devices)
    work = []  # in order: (reads for the threads, a function of their arrays, bytes read)
    for n, src in globals_.items():
        if host:
            work.append(([functools.partial(_host_array, shapes[n], 0, lambda src=src: src,
                                            dtype, shardings[n])], _first, src.nbytes))
            continue
        same = not src.transpose and src.dtype.name == dtype
        work.append(([functools.partial(_place, [src], False, shardings[n])],
                     _first if same else
                     (lambda raw, n=n, src=src: _one_to_ours(
                         raw[0], src.transpose, dtype, None if mesh is None else shardings[n])),
                     src.nbytes))
    transposes = tuple((n, plan[n][1]) for n in layer_names)
    nbytes = lambda srcs: sum(s.nbytes for s in srcs)
    if split_layers:
        out_shardings = None if mesh is None else tuple(layer_shardings.items())
        for layer in per_layer:
            work.append(([functools.partial(_place, layer[n], n.startswith("we_"),
                                            layer_shardings[n]) for n in layer_names],
                         lambda raw: _layer_to_ours(dict(zip(layer_names, raw)), transposes,
                                                    dtype, k_major, fuse_qkv, out_shardings),
                         sum(nbytes(layer[n]) for n in layer_names)))
    else:
        for n in layer_names:
            size = sum(nbytes(layer[n]) for layer in per_layer)
            if host:
                at = lambda l, e=0, n=n: per_layer[l][n][e]
                lead = 2 if n.startswith("we_") else 1
                work.append(([functools.partial(_host_array, shapes["layers"][n], lead, at,
                                                dtype, shardings["layers"][n])], _first, size))
                continue
            work.append(([functools.partial(_place, layer[n], n.startswith("we_"),
                                            layer_shardings[n]) for layer in per_layer],
                         lambda raw, n=n: _stack_to_ours(
                             raw, plan[n][1], dtype,
                             None if mesh is None else shardings["layers"][n]),
                         size))

    results = _run_pipelined(work)
    out = {n: results[i] for i, n in enumerate(globals_)}
    rest = results[len(globals_):]
    out["layers"] = rest if split_layers else dict(zip(layer_names, rest))
    return out


def _first(arrays):
    return arrays[0]


def _host_array(shape: tuple, lead: int, source_at, dtype: str, sharding) -> jax.Array:
    """A parameter laid out on the host, for devices that are the host's CPU (where XLA's
    transposes and stacks were measured slower than numpy's): each shard is one array in our
    layout and dtype, filled tensor by tensor from the reads (`lead` leading axes index the
    layer and expert of `source_at(*indices)`)."""
    def read(index):
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        ranges = [range(n)[i] for n, i in zip(shape, index)]
        out = np.empty([len(r) for r in ranges], dtype)
        for pos in itertools.product(*[range(len(r)) for r in ranges[:lead]]):
            src = source_at(*[r[p] for r, p in zip(ranges, pos)])
            tail = index[lead:]
            x = src.read(tail[::-1] if src.transpose else tail)
            if src.transpose:
                _transpose_into(out[pos], x)
            else:
                out[pos] = x
        return out
    return jax.make_array_from_callback(shape, sharding, read)


def _transpose_into(out: np.ndarray, x: np.ndarray, rows: int = 64):
    """out[...] = x.T, a block of x's rows at a time (twice as fast as one strided copy)."""
    for i in range(0, x.shape[0], rows):
        out[:, i:i + rows] = x[i:i + rows].T


def _run_pipelined(work: list) -> list:
    """Each work item's reads run on threads, up to READ_AHEAD_BYTES ahead of the item being
    finished; the finishing functions (device work) run here, in order, and the arrays the
    reads placed are freed once each item's result is dispatched."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    results, queued, ahead = [], deque(), 0
    items = iter(work)
    pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="sfi-jax-load")
    try:
        for _ in work:
            while not queued or ahead < READ_AHEAD_BYTES:
                item = next(items, None)
                if item is None:
                    break
                reads, finish, size = item
                queued.append(([pool.submit(r) for r in reads], finish, size))
                ahead += size
            futures, finish, size = queued.popleft()
            raw = [f.result() for f in futures]
            result = finish(raw)
            kept = {id(a) for a in jax.tree.leaves(result)}  # an array passed through as is
            _free([a for a in raw if id(a) not in kept])
            results.append(result)
            ahead -= size
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


# ---- safetensors (the `safetensors` library: validated headers, lazy reads by slice) ----

# numpy's name of each safetensors dtype (any other is refused by name when a tensor is used)
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                       "I8": "int8", "U8": "uint8", "I16": "int16", "I32": "int32",
                       "I64": "int64", "BOOL": "bool"}


class SafetensorsTensor:
    """One tensor of an open safetensors file: its shape, and the data of a slice read only
    when indexed (numpy's bfloat16 comes from ml_dtypes)."""

    def __init__(self, handle, name: str, path: str):
        self._handle, self.name, self.source = handle, name, path  # the handle stays open
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.dtype = _SAFETENSORS_DTYPES.get(self._slice.get_dtype(), self._slice.get_dtype())

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
