"""EngineOptions: validated on construction, "auto" resolved per platform in one place, parsed
from "field=value" strings; no module of the package reads the old engine-switch variables."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

import sfi_jax
from sfi_jax.kernels import common
from sfi_jax.options import EngineOptions, resolve


@pytest.mark.parametrize("field, value", [("attention", "triton"), ("selector_scores", "kernel"),
                                          ("selector_topk", "sort"), ("selector_adjust", "auto"),
                                          ("moe", "yes"), ("heads", "pallas"),
                                          ("repack", "pallas"), ("refresh", "true"), ("matmul", "triton"),
                                          ("epilogue", "kernel"),
                                          ("layer_unroll", 0), ("layer_unroll", "x"),
                                          ("layer_unroll", True)])
def test_bad_values_name_field_and_allowed(field, value):
    with pytest.raises(ValueError, match=f"EngineOptions.{field}=") as err:
        EngineOptions(**{field: value})
    assert "expected" in str(err.value)


def test_resolved_per_platform(monkeypatch):
    monkeypatch.setattr(common, "hopper", lambda: False)  # Hopper: test_prefill's choice test
    gpu = EngineOptions().resolved(platform="gpu")
    assert gpu == EngineOptions(attention="pallas_gpu", prefill_attention="cudnn",
                                selector_scores="pallas_gpu",
                                selector_topk="radix_kernel", selector_adjust="xla",
                                moe="tokens", heads="kernel", repack="kernel",
                                refresh="unconditional", matmul="by_shape", epilogue="fused",
                                layer_unroll=6)
    cpu = EngineOptions().resolved(platform="cpu")
    assert cpu == EngineOptions(attention="xla", prefill_attention="xla", selector_scores="xla",
                                selector_topk="lax",
                                moe="xla", heads="xla", repack="xla", refresh="cond",
                                matmul="xla", epilogue="xla", layer_unroll=1)
    tpu = EngineOptions().resolved(platform="tpu")
    assert tpu.attention == tpu.prefill_attention == "pallas_tpu"
    assert tpu.moe == "xla" and tpu.refresh == "cond"
    # the GPU variants follow the attention kernels, asked for anywhere
    forced = EngineOptions(attention="pallas_gpu").resolved(platform="cpu")
    assert (forced.moe, forced.heads, forced.repack, forced.refresh, forced.matmul,
            forced.epilogue) == ("tokens", "kernel", "kernel", "unconditional", "by_shape", "fused")
    assert forced.selector_scores == "xla"  # the selector's defaults follow the platform
    # a Mosaic matmul's fused epilogues are taken only when asked for
    twin = EngineOptions(attention="pallas_gpu", matmul="mosaic_gpu").resolved(platform="gpu")
    assert twin.epilogue == "xla"
    assert EngineOptions(matmul="mosaic_gpu", epilogue="fused").resolved("gpu").epilogue == "fused"
    mosaic = EngineOptions(attention="mosaic_gpu").resolved(platform="gpu")  # the same variants
    assert mosaic == dataclasses.replace(gpu, attention="mosaic_gpu")
    # explicit values are kept; resolving twice changes nothing; resolved objects hash
    mixed = EngineOptions(attention="pallas_gpu", moe="xla", layer_unroll="all")
    assert mixed.resolved("gpu").moe == "xla" and mixed.resolved("gpu").unroll is True
    assert gpu.resolved("cpu") == gpu and gpu.is_resolved and not EngineOptions().is_resolved
    assert len({gpu, cpu, tpu, EngineOptions().resolved("gpu")}) == 3
    assert resolve("selector_topk", "auto", "gpu") == "radix_kernel"  # (hopper() is False)
    # on a mesh GSPMD partitions the heads, the matmuls, the experts and the prefill attention:
    # XLA's, whatever was asked; the kernels under shard_map keep theirs
    mesh = EngineOptions(heads="kernel", matmul="kernel").resolved("gpu", mesh=object())
    assert (mesh.heads, mesh.moe, mesh.matmul, mesh.epilogue, mesh.prefill_attention) == \
        ("xla",) * 5
    assert (mesh.attention, mesh.selector_topk, mesh.repack) == ("pallas_gpu", "radix_kernel",
                                                                 "kernel")
    assert mesh.resolved("gpu", mesh=object()) == mesh
    assert resolve("attention", "pallas_tpu", "gpu") == "pallas_tpu"


def test_from_strings():
    got = EngineOptions.from_strings(["moe=xla", "layer_unroll=all", "refresh=cond"])
    assert got == EngineOptions(moe="xla", layer_unroll="all", refresh="cond")
    assert EngineOptions.from_strings(["layer_unroll=3"]).layer_unroll == 3
    assert EngineOptions.from_strings(["layer_unroll=auto"]).layer_unroll is None
    base = EngineOptions(attention="xla")
    assert EngineOptions.from_strings(["heads=xla"], base=base).attention == "xla"
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        EngineOptions.from_strings(["unroll=3"])
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        EngineOptions.from_strings(["moe"])
    with pytest.raises(ValueError, match="EngineOptions.moe='yes'"):
        EngineOptions.from_strings(["moe=yes"])


def test_generate_takes_only_engine_options(tiny_qwen3):
    with pytest.raises(ValueError, match="EngineOptions"):
        sfi_jax.generate(tiny_qwen3.model, [[5, 6, 7]], max_new_tokens=2, options={"moe": "xla"})
    with pytest.raises(ValueError, match="EngineOptions.attention='cuda'"):
        sfi_jax.generate(tiny_qwen3.model, [[5, 6, 7]], max_new_tokens=2, impl="cuda")


def test_no_module_reads_engine_environment_variables():
    """The old engine switches are gone (SFI_JAX_CACHE_DIR, a cache location, is no switch)."""
    old = re.compile(r"SFI_JAX_(REFRESH_COND|REPACK|HEADS|MOE|SELECTOR_ADJUST|LAYER_UNROLL)")
    root = pathlib.Path(sfi_jax.__file__).parent
    readers = [str(p.relative_to(root)) for p in root.rglob("*.py") if old.search(p.read_text())]
    assert readers == []


def test_kernel_tuning_is_part_of_the_options():
    """The kernels' sweep points ride in the options (so in every program's key), survive
    `resolved`, and are not settable from strings; anything but a KernelTuning is refused."""
    from sfi_jax.options import KernelTuning

    tuning = KernelTuning(fused_programs_per_sm=2, launch_dependents=False)
    plain, tuned = EngineOptions(), EngineOptions(tuning=tuning)
    assert plain != tuned and hash(plain) != hash(tuned)
    assert tuned.resolved("gpu").tuning == tuning and plain.resolved("gpu").tuning == KernelTuning()
    with pytest.raises(ValueError, match="tuning"):
        EngineOptions(tuning={"launch_dependents": False})
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        EngineOptions.from_strings(["tuning=x"])
