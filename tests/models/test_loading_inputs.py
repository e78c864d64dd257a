"""Loading a checkpoint from the `safetensors` library, and every bad source named in one line:
damaged safetensors files, config.json errors, a directory without a tokenizer, sources that
must not go to the hub. The checkpoints are tiny Llama directories written here with numpy."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

import sfi_jax
from sfi_jax import cli
from sfi_jax.models import loading

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 16,
          "intermediate_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 40, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False}


def _tensors(seed=0, dtype=np.float32) -> dict[str, np.ndarray]:
    """HF-named random tensors of CONFIG ([out, in] linear weights)."""
    rng = np.random.default_rng(seed)
    h, f, d = CONFIG["hidden_size"], CONFIG["intermediate_size"], 4
    q, kv = CONFIG["num_attention_heads"] * d, CONFIG["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (40, h), "model.norm.weight": (h,),
              "lm_head.weight": (40, h)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    return {n: rng.standard_normal(s).astype(np.float32).astype(dtype) for n, s in shapes.items()}


def _checkpoint(directory, tensors=None, config=None, shards=1) -> str:
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = _tensors() if tensors is None else tensors
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(CONFIG if config is None else config, f)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"))
        return str(directory)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, os.path.join(directory, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return str(directory)


@pytest.mark.parametrize("dtype,shards", [(np.float32, 1), (ml_dtypes.bfloat16, 3)])
def test_safetensors_checkpoint_loads_the_written_values(tmp_path, dtype, shards):
    tensors = _tensors(seed=1, dtype=dtype)
    model = sfi_jax.load_model(_checkpoint(tmp_path / "ckpt", tensors, shards=shards),
                               dtype="float32", split_layers=False)
    p = {k: v for k, v in model.params.items()}
    f32 = {n: t.astype(np.float32) for n, t in tensors.items()}
    np.testing.assert_array_equal(np.asarray(p["embed"]), f32["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(p["lm_head"]), f32["lm_head.weight"].T)
    for i in range(2):
        pre = f"model.layers.{i}."
        np.testing.assert_array_equal(np.asarray(p["layers"]["wq"][i]),
                                      f32[pre + "self_attn.q_proj.weight"].T)
        np.testing.assert_array_equal(np.asarray(p["layers"]["w_down"][i]),
                                      f32[pre + "mlp.down_proj.weight"].T)
        np.testing.assert_array_equal(np.asarray(p["layers"]["attn_norm"][i]),
                                      f32[pre + "input_layernorm.weight"])


def _raw_safetensors(path, header, data=b""):
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize("header,data", [
    (b"[1, 2, 3]", b""),  # a JSON list
    ({"model.norm.weight": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}, b""),
    ({"model.norm.weight": {"dtype": "F32", "shape": [1000000, 1000000],
                            "data_offsets": [0, 16]}}, b"\0" * 16),  # huge shape, small data
    ({"model.norm.weight": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16),
    (b"{not json", b""),
])
def test_damaged_safetensors_names_the_file(tmp_path, header, data):
    d = _checkpoint(tmp_path / "ckpt")
    bad = os.path.join(d, "model.safetensors")
    _raw_safetensors(bad, header, data)
    with pytest.raises(ValueError, match=rf"^{bad} is not a valid safetensors file \("):
        sfi_jax.load_model(d, dtype="float32")


def test_header_only_file_names_the_missing_tensor(tmp_path):
    d = _checkpoint(tmp_path / "ckpt")
    _raw_safetensors(os.path.join(d, "model.safetensors"), {})
    with pytest.raises(ValueError, match=r"tensor 'model.embed_tokens.weight' missing from the "
                                         rf"checkpoint in {d}"):
        sfi_jax.load_model(d, dtype="float32")


def test_shape_mismatch_names_file_and_tensor(tmp_path):
    tensors = _tensors()
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((4, 16), np.float32)
    d = _checkpoint(tmp_path / "ckpt", tensors)
    with pytest.raises(ValueError, match=rf"^{d}/model.safetensors: tensor "
                                         r"'model.layers.1.self_attn.k_proj.weight' has shape "
                                         r"\(4, 16\), expected \(8, 16\) from the config"):
        sfi_jax.load_model(d, dtype="float32")


def test_bad_index_names_the_file(tmp_path):
    d = _checkpoint(tmp_path / "ckpt", shards=2)
    index = os.path.join(d, "model.safetensors.index.json")
    with open(index, "w") as f:
        f.write("[]")
    with pytest.raises(ValueError, match=rf"^{index} is not a safetensors index"):
        sfi_jax.load_model(d, dtype="float32")


@pytest.mark.parametrize("text,expected", [
    ("{bad json", r"config.json is not valid JSON \("),
    ("[1, 2]", r"config.json must hold a JSON object, got list"),
    (json.dumps({k: v for k, v in CONFIG.items() if k != "num_attention_heads"}),
     r"config.json lacks the key 'num_attention_heads'"),
    (json.dumps({**CONFIG, "model_type": "gpt2"}), r"config.json: unsupported model_type 'gpt2'"),
])
def test_config_errors_name_the_file(tmp_path, text, expected):
    d = _checkpoint(tmp_path / "ckpt")
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match=rf"^{d}/{expected}"):
        sfi_jax.load_model(d, dtype="float32")


def test_directory_without_tokenizer_fails_before_the_weights(tmp_path, monkeypatch):
    d = _checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=rf"^{d} holds no tokenizer \(none of tokenizer.json"):
        sfi_jax.load_tokenizer(d)

    def fail(*a, **k):
        raise AssertionError("weights loaded before the tokenizer was found missing")

    monkeypatch.setattr(sfi_jax, "load_model", fail)
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", d, "--prompt", "hi", "--no-compile-cache"])
    assert str(e.value.code).startswith(f"error: {d} holds no tokenizer")


@pytest.fixture()
def hub_calls(monkeypatch):
    calls = []

    def resolve(repo):
        calls.append(repo)
        raise ValueError(f"hub stand-in: {repo}")

    monkeypatch.setattr(loading, "_resolve_hub", resolve)
    return calls


@pytest.mark.parametrize("source", [
    "./models/qwen", "models/qwen.gguf", "/no/such/dir", "~/no-such-model-dir", "a/b/c",
    "local/typo", "org/model.safetensors", "win\\path"])
def test_local_looking_source_never_goes_to_the_hub(tmp_path, monkeypatch, hub_calls, source):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()  # "local/typo": its first part exists here
    for load in (sfi_jax.load_model, sfi_jax.load_tokenizer):
        with pytest.raises(ValueError, match="no such file or directory, and not a preset"):
            load(source)
    assert hub_calls == []


def test_hub_ids(tmp_path, monkeypatch, hub_calls):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()  # a local org/name, yet hub: asks the hub
    for source, repo in [("hub:org/name", "org/name"), ("someorg/model", "someorg/model")]:
        with pytest.raises(ValueError, match=f"hub stand-in: {repo}"):
            sfi_jax.load_model(source)
    assert hub_calls == ["org/name", "someorg/model"]
    with pytest.raises(ValueError, match="a hub id is hub:org/name"):
        sfi_jax.load_model("hub:just-a-name")


@pytest.mark.parametrize("source", [None, 123, ["smollm2-135m"]])
def test_source_must_be_a_string(source):
    for load in (sfi_jax.load_model, sfi_jax.load_tokenizer):
        with pytest.raises(ValueError, match=r"model source must be a preset name .*, got "):
            load(source)
