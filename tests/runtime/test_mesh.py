"""Sharded execution: mesh specs, sharding rules, and dense / SFI generation, the selector,
checkpoint placement and an Orbax round trip on 8 simulated CPU devices compared with one
device. The 8-device checks run once, in a fresh interpreter (tests/runtime/sharded_checks.py),
because the device count is fixed when jax starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from sfi_jax.runtime import mesh as sharding

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


# two checker processes side by side (compiling is mostly single-threaded), each about half
# the work; a process computes each one-device reference once, so the checks against the same
# reference share a process (all of tiny-qwen3's in the first)
GROUPS = (["multiprocess", "generate_qwen3", "gpu_kernels", "explicit_mesh"],
          ["rules", "selector", "loading", "orbax", "generate_odd_heads", "generate_qwen3_moe"])


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # the checker imports sfi_jax from this checkout, installed or not
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT,
                                                    env.get("PYTHONPATH")) if p)
    outs = [tmp / f"results{i}.json" for i in range(len(GROUPS))]
    logs = [tmp / f"log{i}.txt" for i in range(len(GROUPS))]
    procs = []
    for out, log, group in zip(outs, logs, GROUPS):
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "sharded_checks.py"),
                                           str(out), *group], env=env, stdout=f,
                                          stderr=subprocess.STDOUT))
    for proc in procs:
        proc.wait(timeout=1200)
    results = {}
    for out, proc, log in zip(outs, procs, logs):
        if not out.exists():
            pytest.fail(f"sharded_checks.py wrote no results (exit {proc.returncode}):\n"
                        f"{log.read_text()[-5000:]}")
        results.update(json.loads(out.read_text()))
    return results


@pytest.mark.parametrize("name", ["rules", "selector", "loading", "orbax", "generate_qwen3",
                                  "generate_qwen3_moe", "generate_odd_heads", "gpu_kernels",
                                  "explicit_mesh", "multiprocess"])
def test_sharded(checks, name):
    assert name in checks, f"check {name} did not run (the checker stopped early)"
    assert checks[name]["ok"], checks[name]["detail"]


def test_make_mesh_one_process():
    n = jax.device_count()
    assert sharding.make_mesh(None) is None
    mesh = sharding.make_mesh(f"1x{n}")
    assert dict(mesh.shape) == {"data": 1, "model": n}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert sharding.make_mesh({"model": n}).shape["data"] == 1
    assert sharding.make_mesh(mesh) is mesh


@pytest.mark.parametrize("spec, message", [
    ("3x7", "needs 21 devices"), ("2*4", "is not 'DxM'"), ("0x1", "size >= 1"),
    ({"data": 1, "tensor": 1}, "unknown"), ({"data": 0}, "size >= 1"), (8, "must be a"),
])
def test_make_mesh_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(spec)


def test_mesh_axis_names_checked():
    mesh = jax.make_mesh((jax.device_count(),), ("tensor",))
    with pytest.raises(ValueError, match="'tensor'"):
        sharding.make_mesh(mesh)


def _launcher():
    import importlib.util

    path = os.path.join(ROOT, "scripts", "tpu_pod", "launch.py")
    spec = importlib.util.spec_from_file_location("tpu_pod_launch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tpu_pod_launcher_dry_run(capsys):
    launch = _launcher()
    assert [launch.devices_for(t) for t in ("v4-32", "v5p-16", "v5litepod-16", "v6e-8", "v3-8")] \
        == [16, 8, 16, 8, 8]
    assert launch.main(["--project", "proj", "--zone", "us-central2-b", "--accelerator-type",
                        "v4-32", "--name", "pod", "--dry-run", "--delete"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("+ gcloud")]
    assert [line.split()[5] for line in lines] == ["create", "scp", "ssh", "ssh", "delete"]
    assert "--accelerator-type=v4-32" in lines[0] and "--project=proj" in lines[0]
    assert all("--worker=all" in line for line in lines[1:4])
    assert "sfi_jax.generate --distributed --mesh 1x16" in lines[3]
    with pytest.raises(SystemExit, match="--command"):
        launch.main(["--zone", "z", "--accelerator-type", "tpu7x-what", "--dry-run"])
