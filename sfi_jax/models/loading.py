"""`load_model` and `load_tokenizer`: presets, local HF directories, Orbax, GGUF, hub ids."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp

from sfi_jax.models import gguf_loader
from sfi_jax.models.config import PRESETS, ModelConfig
from sfi_jax.models.modeling import (K_MAJOR, STACKED, Model, WeightLayout, param_shapes,
                                     stack_layers)
from sfi_jax.models.params import params_from_getter, random_params, safetensors_getter
from sfi_jax.options import on_gpu

EMBEDDED_DEFAULT = "smollm2-135m"
ORBAX_CONFIG = "sfi_jax_model_config.json"
_DTYPES = ("float32", "bfloat16", "float16")
# Files one of which a Hugging Face tokenizer directory holds
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_dtype(dtype):
    name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {_DTYPES}")
    return name


def _resolve_hub(source: str) -> str:
    """Local snapshot of a hub id: the cache first, then a download; a clear error offline."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return snapshot_download(source, allow_patterns=patterns, local_files_only=True)
    except Exception:
        pass
    try:
        return snapshot_download(source, allow_patterns=patterns)
    except Exception as e:
        raise ValueError(
            f"model {source!r} is not a preset ({', '.join(PRESETS)}), not a local directory, "
            f"and could not be downloaded from the Hugging Face hub ({type(e).__name__}). "
            "Offline? Pass a local directory with config.json and *.safetensors.") from None


HUB_PREFIX = "hub:"
# Suffixes of checkpoint files and folders: a source ending in one names a local path
_PATH_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin", ".pt", ".pth", ".ckpt", ".npz",
                  ".msgpack", ".orbax", ".model")


def _hub_id(source: str) -> str | None:
    """The hub id `source` names, or None when it names a local path.

    `hub:org/name` is always a hub id. A plain `org/name` is one only when nothing about it is
    local: it is not an existing path, `org` is not an existing directory, and it does not
    look like a path (no leading `.`, `/` or `~`, one `/`, no backslash, no file suffix), so
    that a mistyped local path is never sent to the hub.
    """
    if source.startswith(HUB_PREFIX):
        repo = source[len(HUB_PREFIX):]
        parts = repo.split("/")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"{source!r}: a hub id is hub:org/name")
        return repo
    parts = source.split("/")
    if (len(parts) != 2 or not all(parts) or source.startswith((".", "/", "~")) or "\\" in source
            or source.lower().endswith(_PATH_SUFFIXES) or os.path.exists(source)
            or os.path.exists(parts[0])):
        return None
    return source


def _check_source(source) -> str:
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"model source must be a preset name ({', '.join(PRESETS)}), a path or "
                         f"a hub id (hub:org/name), got {source!r}")
    return os.fspath(source)


def _missing(source: str) -> ValueError:
    return ValueError(f"model {source!r}: no such file or directory, and not a preset "
                      f"({', '.join(PRESETS)}); for a Hugging Face hub id write "
                      f"hub:org/name")


def _read_hf_config(path: str) -> ModelConfig:
    """config.json of a Hugging Face directory; errors name the file (and the key)."""
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(raw).__name__}")
    try:
        return ModelConfig.from_hf(raw, name=os.path.basename(os.path.normpath(path)))
    except KeyError as e:
        raise ValueError(f"{config_path} lacks the key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{config_path}: {e}") from None


# Where the layout was measured faster at batch 1: the largest K-major weight's bytes
# (kmajor.md in docs/findings.md: qwen3-0.6b's 6.3 MB; qwen3-4b's 50 MB was slower, smaller models
# were not measured)
K_MAJOR_AUTO_BYTES = (4 << 20, 8 << 20)


def k_major_pays(cfg: ModelConfig, rows: int, dtype="bfloat16", mesh=None) -> bool:
    """Whether the K-major layout was measured faster for decoding `rows` rows of this model:
    on one GPU, up to 4 rows (the K-major kernel's; XLA reads the layout beyond, a little
    slower), the largest K-major weight (`modeling.K_MAJOR`) inside K_MAJOR_AUTO_BYTES."""
    if mesh is not None or not on_gpu() or not 1 <= rows <= 4:
        return False
    shapes = param_shapes(cfg)["layers"]
    largest = max(math.prod(shapes[n][1:]) for n in K_MAJOR if n in shapes) \
        * jnp.dtype(_check_dtype(dtype)).itemsize
    return K_MAJOR_AUTO_BYTES[0] <= largest <= K_MAJOR_AUTO_BYTES[1]


def load_model(source: str = EMBEDDED_DEFAULT, *, dtype="bfloat16", mesh=None, seed: int = 0,
               split_layers: bool | None = None, k_major: bool | str = False,
               decode_rows: int | None = None) -> Model:
    """Load a model from a preset name, a local HF or Orbax directory, a .gguf file or a hub id.

    Presets other than the embedded `smollm2-135m` are config-only: their weights are random,
    created on the device in `dtype` (for benchmarks). `mesh` places each shard on its devices.
    split_layers: keep one weight dict per layer (see `Model.split_layers`); None = on GPU,
    where it makes decode steps faster, and stacked elsewhere (faster compiles). Split weights
    on one device (mesh None) also get one fused q/k/v projection per layer, and with
    k_major (which splits the layers on any platform) the output and dense MLP weights stored
    transposed (`Model.split_layers`). k_major="auto": that layout where `k_major_pays` for
    `decode_rows` (the rows you will decode at once; required then).
    """
    if k_major == "auto":
        if decode_rows is None:
            raise ValueError("k_major='auto' needs decode_rows (the rows decoded at once)")
        if split_layers is False:
            k_major = False
    elif k_major not in (True, False):
        raise ValueError(f"k_major must be True, False or 'auto', got {k_major!r}")
    if k_major is True and mesh is not None:
        raise ValueError("k_major=True is a one-device layout; it cannot be used with a mesh")
    if k_major is True and split_layers is False:
        raise ValueError("k_major=True needs split layers; split_layers=False was passed")

    def layout(cfg: ModelConfig) -> WeightLayout:
        """The layer layout asked for (`params_from_getter` builds it)."""
        km = k_major_pays(cfg, decode_rows, dtype, mesh) if k_major == "auto" else k_major
        split = (on_gpu() or km) if split_layers is None else split_layers
        return WeightLayout(split=bool(split), fused_qkv=bool(split) and mesh is None,
                            k_major=bool(km) and bool(split))

    model = _load(source, dtype=dtype, mesh=mesh, seed=seed, layout=layout)
    return _maybe_split(model, layout(model.config))


def _maybe_split(model: Model, layout: WeightLayout) -> Model:
    """The model in `layout` (a no-op for layers a loader already split)."""
    if not layout.split:
        return model
    return model.split_layers(fuse_qkv=layout.fused_qkv, k_major=layout.k_major)


def _load(source: str, *, dtype, mesh, seed, layout=None) -> Model:
    """The model of `source`; checkpoints are placed in `layout(cfg)` (stacked when None)."""
    source = _check_source(source)
    dtype = _check_dtype(dtype)

    def placed(cfg, getter):
        want = layout(cfg) if layout else STACKED
        return Model(cfg, params_from_getter(cfg, getter, dtype, mesh, split_layers=want.split,
                                             fuse_qkv=want.fused_qkv, k_major=want.k_major),
                     layout=want)

    if source in PRESETS:
        cfg = PRESETS[source]
        if source == EMBEDDED_DEFAULT:
            path = gguf_loader.embedded_gguf_path()
            return placed(cfg, gguf_loader.gguf_getter(path, cfg))
        return Model(cfg, random_params(cfg, dtype, seed, mesh))
    path = os.path.expanduser(source)
    if os.path.isfile(path) and path.endswith(".gguf"):
        cfg = gguf_loader.gguf_config(path, name=os.path.basename(path))
        return placed(cfg, gguf_loader.gguf_getter(path, cfg))
    hub = _hub_id(source)
    if hub is not None:
        path = _resolve_hub(hub)
    elif not os.path.exists(path):
        raise _missing(source)
    if not os.path.isdir(path):
        raise ValueError(f"{path} is a file; expected a directory or a .gguf file")
    if os.path.exists(os.path.join(path, ORBAX_CONFIG)):
        return restore_orbax(path, dtype=dtype, mesh=mesh, split_layers=False)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has no config.json (and is not an Orbax checkpoint "
                                f"written by sfi_jax)")
    cfg = _read_hf_config(path)
    return placed(cfg, safetensors_getter(path))


def load_tokenizer(source: str = EMBEDDED_DEFAULT):
    """The transformers tokenizer that belongs to `source` (a clear error for config-only presets).

    GGUF tokenizers (the embedded default, a .gguf path) are built from the file's metadata
    with the `tokenizers` library, so no torch is needed.
    """
    source = _check_source(source)
    if source == EMBEDDED_DEFAULT:
        return gguf_loader.gguf_tokenizer(gguf_loader.embedded_gguf_path())
    if source in PRESETS:
        raise ValueError(f"preset {source!r} has random weights and no tokenizer; pass token ids, "
                         "or load a real checkpoint directory")
    path = os.path.expanduser(source)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return gguf_loader.gguf_tokenizer(path)
    from sfi_jax.models.tokenizer import import_transformers

    AutoTokenizer = import_transformers().AutoTokenizer

    hub = _hub_id(source)
    if hub is not None:
        path = _resolve_hub(hub)
    elif not os.path.exists(path):
        raise _missing(source)
    if os.path.exists(os.path.join(path, ORBAX_CONFIG)):
        tok_dir = os.path.join(path, "tokenizer")
        if os.path.isdir(tok_dir):
            return AutoTokenizer.from_pretrained(tok_dir)
        raise ValueError(f"Orbax checkpoint {path} was saved without a tokenizer")
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f))
                                       for f in TOKENIZER_FILES):
        raise ValueError(f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         "pass --tokenizer / load_tokenizer(...) a directory that has one")
    return AutoTokenizer.from_pretrained(path)


def save_orbax(model: Model, directory: str, tokenizer=None) -> str:
    """Write `model` as an Orbax checkpoint (+ its config, + the tokenizer when given)."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    ckpt = ocp.StandardCheckpointer()
    params = model.params
    params["layers"] = stack_layers(params["layers"], model.config, model.layout)  # as saved
    ckpt.save(os.path.join(directory, "params"), params, force=True)
    ckpt.wait_until_finished()
    with open(os.path.join(directory, ORBAX_CONFIG), "w") as f:
        json.dump(dataclasses.asdict(model.config), f, indent=1)
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(directory, "tokenizer"))
    return directory


def restore_orbax(directory: str, *, dtype="bfloat16", mesh=None,
                  split_layers: bool | None = None) -> Model:
    """Restore an Orbax checkpoint, each shard straight onto its devices (split_layers: as in
    `load_model`)."""
    import orbax.checkpoint as ocp

    from sfi_jax.models.params import default_shardings

    directory = os.path.abspath(directory)
    with open(os.path.join(directory, ORBAX_CONFIG)) as f:
        raw = json.load(f)
    raw["eos_token_ids"] = tuple(raw.get("eos_token_ids") or ())
    if raw.get("rope_scaling"):
        raw["rope_scaling"] = tuple(tuple(kv) for kv in raw["rope_scaling"])
    cfg = ModelConfig(**raw)
    shardings = default_shardings(cfg, mesh)
    target = jax.tree.map(lambda shape, sh: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sh),
                          param_shapes(cfg), shardings, is_leaf=lambda x: isinstance(x, tuple))
    params = ocp.StandardCheckpointer().restore(os.path.join(directory, "params"), target)
    split = on_gpu() if split_layers is None else bool(split_layers)
    layout = WeightLayout(split=split, fused_qkv=split and mesh is None)
    return _maybe_split(Model(cfg, params, layout=STACKED), layout)
