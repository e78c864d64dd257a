"""Checkpoint placement against a reference read: every parameter `load_model` /
`params_from_getter` places equals the tensors read with the `safetensors` library directly,
transposed, stacked and cast in numpy. For bfloat16 and float32 files, stacked and split
layers (fused q/k/v, K-major), a MoE model's experts, and meshes of 4 CPU devices (in a fresh
interpreter). Checkpoints are tiny, written here with numpy; q_proj is square, so a missed
transpose shows in the values, not only in a shape."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

H, I, D, QH, KVH, V, L = 16, 24, 4, 4, 2, 40, 3
DENSE = {"model_type": "qwen3", "num_hidden_layers": L, "hidden_size": H, "intermediate_size": I,
         "num_attention_heads": QH, "num_key_value_heads": KVH, "head_dim": D, "vocab_size": V,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
E, MI = 4, 8
MOE = {**DENSE, "model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": 2,
       "moe_intermediate_size": MI, "decoder_sparse_step": 1, "mlp_only_layers": []}


def hf_tensors(config: dict, dtype, seed: int) -> dict[str, np.ndarray]:
    """Random tensors under Hugging Face's names, in its [out, in] layout."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
              "lm_head.weight": (V, H)}
    for l in range(L):
        p = f"model.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (QH * D, H),
                       p + "self_attn.k_proj.weight": (KVH * D, H),
                       p + "self_attn.v_proj.weight": (KVH * D, H),
                       p + "self_attn.o_proj.weight": (H, QH * D),
                       p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
        if config["model_type"] == "qwen3_moe":
            shapes[p + "mlp.gate.weight"] = (E, H)
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                shapes.update({q + "gate_proj.weight": (MI, H), q + "up_proj.weight": (MI, H),
                               q + "down_proj.weight": (H, MI)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                           p + "mlp.down_proj.weight": (H, I)})
    return {n: rng.standard_normal(s).astype(np.float32).astype(dtype) for n, s in shapes.items()}


def write(directory, config: dict, tensors: dict, shards: int = 2) -> str:
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    names, weight_map = sorted(tensors), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, os.path.join(directory, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return str(directory)


def reference(directory: str, dtype, moe: bool) -> dict:
    """Our layout from the files, read with the safetensors library and built in numpy."""
    from safetensors.numpy import load_file

    t = {}
    for f in glob.glob(os.path.join(directory, "*.safetensors")):
        t.update(load_file(f))
    cast = lambda a: np.asarray(a).astype(dtype)
    per = lambda n, T=False: cast(np.stack([t[f"model.layers.{l}.{n}"].T if T else
                                            t[f"model.layers.{l}.{n}"] for l in range(L)]))
    layers = {"attn_norm": per("input_layernorm.weight"),
              "mlp_norm": per("post_attention_layernorm.weight"),
              "wq": per("self_attn.q_proj.weight", True), "wk": per("self_attn.k_proj.weight", True),
              "wv": per("self_attn.v_proj.weight", True), "wo": per("self_attn.o_proj.weight", True),
              "q_norm": per("self_attn.q_norm.weight"), "k_norm": per("self_attn.k_norm.weight")}
    if moe:
        layers["router"] = per("mlp.gate.weight", True)
        for ours, hf in (("we_gate", "gate_proj"), ("we_up", "up_proj"), ("we_down", "down_proj")):
            layers[ours] = cast(np.stack([np.stack([t[f"model.layers.{l}.mlp.experts.{e}.{hf}.weight"].T
                                                    for e in range(E)]) for l in range(L)]))
    else:
        layers.update(w_gate=per("mlp.gate_proj.weight", True), w_up=per("mlp.up_proj.weight", True),
                      w_down=per("mlp.down_proj.weight", True))
    return {"embed": cast(t["model.embed_tokens.weight"]), "final_norm": cast(t["model.norm.weight"]),
            "lm_head": cast(t["lm_head.weight"].T), "layers": layers}


def assert_same(got, want, what=""):
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.uint8),
                                  np.ascontiguousarray(want).view(np.uint8), err_msg=what)


def assert_stacked_equal(params: dict, want: dict):
    for n in ("embed", "final_norm", "lm_head"):
        assert_same(params[n], want[n], n)
    assert sorted(params["layers"]) == sorted(want["layers"])
    for n, w in want["layers"].items():
        assert_same(params["layers"][n], w, n)


@pytest.fixture(params=["host", "device"])
def layout_on(request, monkeypatch):
    """Where stacked layers are laid out: numpy on the host (what CPU devices get) or the
    device's transposes and stacks (what accelerators get), both run here on the CPU."""
    from sfi_jax.models import params

    if request.param == "device":
        monkeypatch.setattr(params, "HOST_LAYOUT_PLATFORMS", ())
    return request.param


@pytest.mark.parametrize("stored,target", [("bfloat16", "bfloat16"), ("float32", "float32"),
                                           ("float32", "bfloat16"), ("bfloat16", "float32")])
def test_stacked_load_equals_the_reference_read(tmp_path, layout_on, stored, target):
    import sfi_jax

    d = write(tmp_path / "ckpt", DENSE, hf_tensors(DENSE, np.dtype(stored), seed=3))
    model = sfi_jax.load_model(d, dtype=target, split_layers=False)
    assert_stacked_equal(model.params, reference(d, np.dtype(target), moe=False))


def test_moe_experts_equal_the_reference_read(tmp_path, layout_on):
    import sfi_jax

    d = write(tmp_path / "ckpt", MOE, hf_tensors(MOE, ml_dtypes.bfloat16, seed=4), shards=3)
    model = sfi_jax.load_model(d, dtype="bfloat16", split_layers=False)
    assert_stacked_equal(model.params, reference(d, np.dtype("bfloat16"), moe=True))


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
def test_split_layers_fused_and_k_major_equal_the_reference_read(tmp_path, stored):
    """The per-layer layout built straight from the files: q/k/v fused in that order, the
    K-major weights in the checkpoint's own [out, in] layout."""
    from sfi_jax.models.loading import _read_hf_config
    from sfi_jax.models.params import params_from_getter, safetensors_getter

    d = write(tmp_path / "ckpt", DENSE, hf_tensors(DENSE, np.dtype(stored), seed=5))
    want = reference(d, np.dtype("bfloat16"), moe=False)
    cfg = _read_hf_config(d)
    for fuse, k_major in ((False, False), (True, True)):
        params = params_from_getter(cfg, safetensors_getter(d), "bfloat16", split_layers=True,
                                    fuse_qkv=fuse, k_major=k_major)
        assert isinstance(params["layers"], list) and len(params["layers"]) == L
        for l, layer in enumerate(params["layers"]):
            w = {n: a[l] for n, a in want["layers"].items()}
            if fuse:
                w["wqkv"] = np.concatenate([w.pop("wq"), w.pop("wk"), w.pop("wv")], -1)
            if k_major:
                for n in ("wo", "w_gate", "w_up", "w_down"):
                    w[n + "_t"] = np.ascontiguousarray(w.pop(n).T)
            assert sorted(layer) == sorted(w), (fuse, sorted(layer))
            for n in w:
                assert_same(layer[n], w[n], f"layer {l} {n} fuse={fuse}")


def test_load_model_builds_the_split_layout_it_asks_for(tmp_path):
    import sfi_jax

    d = write(tmp_path / "ckpt", DENSE, hf_tensors(DENSE, ml_dtypes.bfloat16, seed=6))
    model = sfi_jax.load_model(d, split_layers=True)
    assert model.layers_split and "wqkv" in model.params["layers"][0]
    want = reference(d, np.dtype("bfloat16"), moe=False)["layers"]
    assert_same(model.params["layers"][1]["wqkv"],
                np.concatenate([want["wq"][1], want["wk"][1], want["wv"][1]], -1))


def test_unsupported_tensor_dtype_names_file_and_tensor(tmp_path):
    import sfi_jax

    tensors = hf_tensors(DENSE, np.float32, seed=7)
    tensors["model.layers.2.mlp.up_proj.weight"] = np.zeros((I, H), np.int8)
    d = write(tmp_path / "ckpt", DENSE, tensors, shards=1)
    with pytest.raises(ValueError, match=rf"^{d}/model-00001-of-00001.safetensors: tensor "
                                         r"'model.layers.2.mlp.up_proj.weight' has dtype int8; "
                                         r"expected a floating-point tensor"):
        sfi_jax.load_model(d)


MESH_CHECK = r"""
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import jax, numpy as np
jax.config.update("jax_platforms", "cpu")
sys.path.insert(0, sys.argv[1])
from test_params_placement import reference, assert_stacked_equal, assert_same
import sfi_jax
from sfi_jax.models import params
from sfi_jax.models.loading import _read_hf_config
from sfi_jax.models.sharding import make_mesh, param_shardings

def check(d, moe, spec, dtype, split):
    cfg, mesh = _read_hf_config(d), make_mesh(spec)
    model = sfi_jax.load_model(d, dtype=dtype, mesh=mesh, split_layers=split)
    want = reference(d, np.dtype(dtype), moe=moe)
    if not split:
        assert_stacked_equal(model.params, want)
        for got, sh in zip(jax.tree.leaves(model.params), jax.tree.leaves(param_shardings(cfg, mesh))):
            assert got.sharding.is_equivalent_to(sh, got.ndim), (spec, got.sharding, sh)
            for shard in got.addressable_shards:  # each device holds its own slice
                assert shard.data.shape == sh.shard_shape(got.shape)
        return
    one = param_shardings(cfg, mesh, split_layers=True)["layers"][0]
    for l, layer in enumerate(model.params["layers"]):
        assert sorted(layer) == sorted(want["layers"])
        for n, w in want["layers"].items():
            assert_same(layer[n], w[l], f"{spec} layer {l} {n}")
            assert layer[n].sharding.is_equivalent_to(one[n], layer[n].ndim), (spec, n)

dense, moe = sys.argv[2], sys.argv[3]
for platforms in (("cpu",), ()):  # laid out on the host, then by the devices
    params.HOST_LAYOUT_PLATFORMS = platforms
    check(dense, False, "1x4", "bfloat16", False)
    check(dense, False, "2x2", "float32", False)
    check(moe, True, "2x2", "bfloat16", False)  # 2 experts a shard
check(dense, False, "2x2", "bfloat16", True)
check(moe, True, "1x4", "bfloat16", True)
print("MESH OK")
"""


def test_mesh_placement_equals_the_reference_read(tmp_path):
    """On meshes of 4 CPU devices, each parameter has its sharding, each device its slice, and
    the values are the reference read's (stacked layers laid out on the host and by the
    devices, split layers; dense and MoE)."""
    dense = write(tmp_path / "dense", DENSE, hf_tensors(DENSE, ml_dtypes.bfloat16, seed=8))
    moe = write(tmp_path / "moe", MOE, hf_tensors(MOE, ml_dtypes.bfloat16, seed=9))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", MESH_CHECK, os.path.dirname(__file__), dense,
                           moe], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "MESH OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
