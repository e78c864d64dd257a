"""Sharded-execution checks on 8 simulated CPU devices, run by tests/runtime/test_mesh.py in a fresh
interpreter (the device count must be fixed before jax starts).

    python tests/runtime/sharded_checks.py OUT.json [check ...]

Writes {check name: {"ok": bool, "detail": str, "seconds": float}} to OUT.json. Each check
compares a run on a mesh with the same run on one device: teacher-forced with the one-device
run's tokens (so a near-tie cannot end the comparison), the same slow steps and, at every step,
logits within a relative tolerance for the dtype. XLA's slower optimisations are off, and
XLA:CPU's older loop-fusion emitter is on (tests/xla_cpu_flags.py): both sides of every
comparison compile the same way, and compiling (most of the checks' time) is much faster.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback

WORKER = len(sys.argv) > 1 and sys.argv[1] == "--worker"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from xla_cpu_flags import fast_compile_flags  # noqa: E402  (tests/xla_cpu_flags.py)

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + fast_compile_flags() +
                           f" --xla_force_host_platform_device_count={4 if WORKER else 8}").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_disable_most_optimizations", True)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sfi_jax  # noqa: E402
from sfi_jax.models.config import ModelConfig  # noqa: E402
from sfi_jax.models.modeling import Model  # noqa: E402
from sfi_jax.models.params import default_shardings, random_params  # noqa: E402
from sfi_jax.runtime import mesh as sharding  # noqa: E402

TINY = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_q_heads=16, num_kv_heads=8,
            head_dim=16, vocab_size=256, max_position_embeddings=512, qk_norm=True)
CONFIGS = {
    "qwen3": ModelConfig(name="tiny-qwen3", **TINY),
    "qwen3_moe": ModelConfig(name="tiny-qwen3-moe", num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, **TINY),
    # 3 KV heads split over no mesh axis above 1: heads fall back to replication
    "odd_heads": ModelConfig(name="tiny-odd", **{**TINY, "num_q_heads": 6, "num_kv_heads": 3}),
}
# a budget of 2 + 8 + 8 positions against ~40-token prompts: real sparse steps; t_max and
# trigger tokens make several slow steps per row, and at most 2 rows refresh per step (the
# others wait), which also checks that each device refreshes exactly the globally chosen rows.
# The selection memory (the default, spelled out) with a short warm-up of frequent refreshes
# (every 2nd step for 6 steps, then t_max): the memory decides what the refreshes keep, and
# its held scores split as the held positions do (rows and KV heads) on every mesh
SFI = sfi_jax.SFIConfig(n_sink=2, n_recent=8, k_select=8, t_max=3, refresh_rows=2,
                        selection_memory=0.0, warmup_steps=6, warmup_t_max=2)
assert SFI.remembers
TRIGGERS = [3, 17, 42, 99, 200]
NEW_TOKENS = 9
BATCH = 8


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(24, 48, size=BATCH)]


# relative tolerance of a mesh run's logits against one device's, by the parameters' dtype:
# the same math, summed in another order across devices
RTOL = {"float32": 1e-4, "bfloat16": 2e-2}


def same_run(got, ref, what):
    """`got` ran teacher-forced with the reference's tokens: the same tokens, the same slow
    steps (set by the tokens), and at every step of every row the logits within RTOL of the
    reference's (||got - ref|| / ||ref|| over the vocabulary). Returns the largest error."""
    assert got.tokens == ref.tokens, f"{what}: the forced tokens were not emitted"
    assert got.stats["slow_steps"] == ref.stats["slow_steps"], (
        f"{what}: slow steps {got.stats['slow_steps']} vs {ref.stats['slow_steps']}")
    return same_logits(got.stats["logits"], ref, what)


def same_logits(logits, ref, what):
    a, b = np.asarray(logits, np.float64), np.asarray(ref.stats["logits"], np.float64)
    assert a.shape == b.shape == (BATCH, NEW_TOKENS, 256), (what, a.shape, b.shape)
    err = np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)  # [rows, steps]
    tol = RTOL[ref.stats["dtype"]]
    row, step = np.unravel_index(err.argmax(), err.shape)
    assert np.all(err <= tol), (f"{what}: logits of row {row} at step {step} differ by "
                                f"{err.max():.2e} (relative; tolerance {tol:.0e})")
    return float(err.max())


def note(what, err):
    return f"{what} {err:.1e}"


def run_generate(model, mode, mesh=None, options=None, forced=None, sfi=SFI):
    """The checks' run; forced: the reference's tokens [BATCH, NEW_TOKENS] to feed."""
    res = sfi_jax.generate(model, prompts(), max_new_tokens=NEW_TOKENS, mode=mode, sfi=sfi,
                           trigger_ids=TRIGGERS, return_logits=True, chunk_steps=16,
                           stop_at_eos=False, mesh=mesh, options=options,
                           forced_tokens=None if forced is None else np.asarray(forced))
    res.stats["dtype"] = np.dtype(model.dtype).name
    return res


_HOST_PARAMS = {}


def params(name, seed, mesh=None):
    """random_params(CONFIGS[name], "float32", seed) placed as random_params(mesh=mesh) places
    them: made once on one device, then copied from the host. Each random_params call compiles
    its initialiser anew (a second or more here) for every mesh; the placement and values are
    those of random_params(mesh=...), which the multiprocess and orbax checks still call."""
    cfg = CONFIGS[name]
    if (name, seed) not in _HOST_PARAMS:
        _HOST_PARAMS[name, seed] = jax.tree.map(np.asarray, random_params(cfg, "float32", seed))
    return jax.device_put(_HOST_PARAMS[name, seed], default_shardings(cfg, mesh))


_REFERENCES = {}


def reference(name, mode):
    """One device's run of CONFIGS[name] (seed 1) in `mode`, computed once per process: several
    checks compare against it."""
    if (name, mode) not in _REFERENCES:
        cfg = CONFIGS[name]
        _REFERENCES[name, mode] = run_generate(Model(cfg, params(name, 1)), mode)
    return _REFERENCES[name, mode]


def check_gpu_kernels():
    """The GPU path under shard_map (Triton kernels in interpret mode): the sparse kernel's
    cache stores, the unconditional refresh writing logits and outputs in place, the repack
    kernel, each on a device's rows and KV heads; the same tokens as one device's XLA path
    (the CPU default, and what every other mesh check runs, XLA's repack included)."""
    cfg = CONFIGS["qwen3"]
    ref = reference("qwen3", "sfi")
    mesh = sharding.make_mesh("2x4")
    model = Model(cfg, params("qwen3", 1, mesh))
    got = run_generate(model, "sfi", options=sfi_jax.EngineOptions(attention="pallas_gpu",
                                                                   repack="kernel"),
                       forced=ref.tokens)
    return note("pallas_gpu 2x4", same_run(got, ref, "pallas_gpu 2x4"))


def check_generation(name, runs, split=True, fused=False):
    """Generation on meshes equals one device's: `runs` is a list of (mesh spec, mode). With
    `split`, the last mesh's model split into per-layer weights (SFI) too; with `fused`, one
    device's split layout with fused q/k/v run on that mesh (SFI)."""
    cfg = CONFIGS[name]
    refs = {mode: reference(name, mode) for mode in dict.fromkeys(m for _, m in runs)}
    if "sfi" in refs:
        slow = sum(refs["sfi"].stats["slow_steps"])
        fast = sum(refs["sfi"].stats["fast_steps"])
        assert slow > BATCH and fast > 0, f"SFI run has {slow} slow / {fast} fast steps"
    notes = []

    def compare(model, mode, what, **kw):
        ref = refs.get(mode) or reference(name, mode)
        notes.append(note(what, same_run(run_generate(model, mode, forced=ref.tokens, **kw),
                                         ref, what)))

    for spec, mode in runs:
        mesh = sharding.make_mesh(spec)
        model = Model(cfg, params(name, 1, mesh))
        compare(model, mode, f"{name} {mode} {spec}")  # the mesh comes from the parameters
    if split:  # split (per-layer) weights keep their shardings and give the same result
        layer0 = model.params["layers"]["wq"].sharding.spec
        model.split_layers()
        assert tuple(model.params["layers"][0]["wq"].sharding.spec) == tuple(layer0)[1:], (
            model.params["layers"][0]["wq"].sharding.spec, layer0)
        compare(model, "sfi", f"{name} sfi {spec} split layers")
    if fused:  # one device's split layout (fused q/k/v, K-major o and MLP weights) on the
        # mesh: generate unfuses and transposes them back
        one = Model(cfg, params(name, 1)).split_layers(fuse_qkv=True, k_major=True)
        assert "wqkv" in one.params["layers"][0] and "wo_t" in one.params["layers"][0]
        compare(one, "sfi", f"{name} sfi {spec} fused q/k/v", mesh=mesh)
        # (the selection memory's held scores on a mesh: every SFI run above, SFI remembers)
        try:
            sfi_jax.generate(model, prompts(), max_new_tokens=4, mesh=mesh,
                             sfi=dataclasses.replace(SFI, evidence_window=2))
        except ValueError as e:
            assert "evidence_window" in str(e)
        else:
            raise AssertionError("evidence_window=2 on a mesh did not raise")
    return "largest relative logit errors: " + "; ".join(notes)


def check_rules():
    """Sharding rules: split where an axis divides, replicate where it does not."""
    from jax.sharding import PartitionSpec as P

    from sfi_jax.models.config import PRESETS

    smol = sharding.param_specs(PRESETS["smollm2-135m"], sharding.make_mesh("2x4"))  # 9/3 heads
    assert smol["layers"]["wq"] == P(None, None, None)
    assert smol["layers"]["wk"] == P(None, None, None)
    assert smol["layers"]["wo"] == P(None, None, None)
    assert smol["layers"]["w_gate"] == P(None, None, "model"), smol["layers"]["w_gate"]
    assert smol["embed"] == P("model", None) and "lm_head" not in smol
    big = sharding.param_specs(PRESETS["qwen3-235b-a22b"], sharding.make_mesh("1x8"))  # 64/4 heads
    assert big["layers"]["wq"] == P(None, None, "model")
    assert big["layers"]["wk"] == P(None, None, None)
    assert big["layers"]["we_gate"] == P(None, "model", None, None)
    assert big["lm_head"] == P(None, "model")
    ep = sharding.param_specs(PRESETS["qwen3-30b-a3b"], sharding.make_mesh("2x2x2"))
    assert ep["layers"]["we_up"] == P(None, "expert", None, "model")
    assert ep["layers"]["we_down"] == P(None, "expert", "model", None)
    mesh = sharding.make_mesh({"data": 2, "model": 4})
    plan = sharding.plan_for(PRESETS["smollm2-135m"], mesh, 6)
    assert (plan.batch_axis, plan.head_axis) == ("data", None)
    plan = sharding.plan_for(PRESETS["qwen3-4b"], mesh, 3)
    assert (plan.batch_axis, plan.head_axis) == (None, "model")
    assert sharding.cache_sharding(plan).spec == P(None, None, "model", None, None)
    for bad in ("2x2", "4x4", "8", "2x4x1x1", "ax4"):
        try:
            sharding.make_mesh(bad)
        except ValueError as e:
            assert repr(bad) in str(e) or "2x2" in str(e) or "4x4" in str(e), str(e)
        else:
            raise AssertionError(f"make_mesh({bad!r}) did not raise")
    return "ok"


def check_selector():
    """prefill-style selection + compaction with KV heads split over 'model' equals one device,
    and differs when the cross-head reduction is left out (so the check has teeth)."""
    import functools

    from jax.sharding import PartitionSpec as P

    from sfi_jax.runtime import selection

    B, H, R, S, D = 4, 8, 4, 96, 8
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(B, H, R, S)) * 3, jnp.float32)
    norms = jnp.asarray(rng.uniform(0.5, 2.0, size=(B, H, S)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, H, S, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, H, S, D)), jnp.float32)
    lengths = jnp.asarray([96, 70, 50, 81], jnp.int32)
    cfg = sfi_jax.SFIConfig(n_sink=2, n_recent=8, k_select=16, alpha_cross=1.0)
    lo, hi = selection.allowed_range(lengths, cfg)
    fn = functools.partial(selection.select_compact, sfi=cfg,
                           options=sfi_jax.EngineOptions().resolved())
    want = jax.jit(fn)(logits, norms, k, v, lo, hi, lengths)
    for spec in ("2x4", "1x8"):
        plan = sharding.plan_for(CONFIGS["qwen3"], sharding.make_mesh(spec), B)
        assert plan.head_axis == "model"
        got = jax.jit(lambda *a: sharding.select_and_compact(plan, fn, *a,
                                                             remembers=cfg.remembers))(
            logits, norms, k, v, lo, hi, lengths)
        assert len(got) == len(want) == 5  # (the default selection remembers its scores)
        for a, b, what in zip(got, want, ("ck", "cv", "c_len", "positions")):
            assert np.array_equal(np.asarray(a), np.asarray(b)), f"{spec}: {what} differs"
        # the scores went through the cross-head sum, reduced in another order across devices
        a, b = np.asarray(got[4]), np.asarray(want[4])
        assert np.array_equal(np.isfinite(a), np.isfinite(b)), f"{spec}: held scores differ"
        fin = np.isfinite(b)
        np.testing.assert_allclose(a[fin], b[fin], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{spec}: held scores differ")
    # without the reduction each device would see only its own heads
    mesh = sharding.make_mesh("2x4")
    local = jax.shard_map(lambda *a: fn(*a), mesh=mesh, check_vma=False,
                          in_specs=(P("data", "model"),) * 4 + (P("data"),) * 3,
                          out_specs=(P("data", "model"),) * len(want))
    wrong = jax.jit(local)(logits, norms, k, v, lo, hi, lengths)
    assert not np.array_equal(np.asarray(wrong[3]), np.asarray(want[3])), \
        "the cross-head term made no difference: the check cannot see a missing reduction"
    return "equal on 2x4 and 1x8"


def _hf_tensors(cfg, params):
    """Our stacked params back in Hugging Face names and layout (for the getter check)."""
    from sfi_jax.models.params import _hf_plan

    p = jax.tree.map(np.asarray, params)
    out = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm"]}
    if "lm_head" in p:
        out["lm_head.weight"] = p["lm_head"].T
    for name, w in p["layers"].items():
        template, transpose = _hf_plan(cfg)[name]
        for l in range(cfg.num_layers):
            if name.startswith("we_"):
                for e in range(cfg.num_experts):
                    out[template.format(l, e)] = w[l, e].T if transpose else w[l, e]
            else:
                out[template.format(l)] = w[l].T if transpose else w[l]
    return out


def check_loading():
    """Checkpoint tensors placed shard by shard on a mesh equal the one-device load."""
    from sfi_jax.models.params import params_from_getter

    for name in ("qwen3", "qwen3_moe"):
        cfg = CONFIGS[name]
        ref = random_params(cfg, "float32", seed=3)
        tensors = _hf_tensors(cfg, ref)
        for spec in ("2x4", "1x2x4"):
            mesh = sharding.make_mesh(spec)
            got = params_from_getter(cfg, tensors.__getitem__, "float32", mesh)
            want_sh = sharding.param_shardings(cfg, mesh)
            for (path, a), b, sh in zip(jax.tree_util.tree_leaves_with_path(got),
                                        jax.tree.leaves(ref), jax.tree.leaves(want_sh)):
                assert a.sharding == sh, f"{name} {spec} {path}: sharding {a.sharding} vs {sh}"
                assert np.array_equal(np.asarray(a), np.asarray(b)), f"{name} {spec} {path}"
    return "HF-layout tensors placed on 2x4 and 1x2x4 meshes"


def check_orbax():
    """Save a sharded model, restore it on other meshes (one built by jax.make_mesh with its
    default axis types): identical parameters and logits."""
    cfg = CONFIGS["qwen3_moe"]
    mesh = sharding.make_mesh("2x4")
    model = Model(cfg, random_params(cfg, "float32", seed=2, mesh=mesh))
    tokens = np.asarray(prompts(1)[0][:16])[None].repeat(2, 0)
    want = np.asarray(sfi_jax.forward(model, tokens))
    with tempfile.TemporaryDirectory() as d:
        from sfi_jax.models import save_orbax

        save_orbax(model, d)
        user_mesh = jax.make_mesh((8, 1), ("data", "model"))
        for m in (mesh, user_mesh, None):
            restored = sfi_jax.load_model(d, dtype="float32", mesh=m)
            for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(model.params)):
                assert np.array_equal(np.asarray(a), np.asarray(b)), "parameters differ"
            if m is mesh:
                got = np.asarray(sfi_jax.forward(restored, tokens))
                assert np.array_equal(got, want), "logits differ after the round trip"
        leaf = restored.params["layers"]["we_gate"]
        assert len(leaf.devices()) == 1
        r2 = sfi_jax.load_model(d, dtype="float32", mesh=user_mesh).params["layers"]["wq"]
        assert r2.sharding.spec == sharding.param_specs(cfg, user_mesh)["layers"]["wq"]
    return "round trip 2x4 -> 2x4, 8x1 (Explicit axes), one device"


def check_explicit_mesh():
    """A user mesh from jax.make_mesh (Explicit axes on new jax) works end to end, also while
    the caller has it set with jax.set_mesh."""
    cfg = CONFIGS["qwen3"]
    user_mesh = jax.make_mesh((2, 4), ("data", "model"))
    model = Model(cfg, params("qwen3", 1, user_mesh))
    single = Model(cfg, params("qwen3", 1))
    ref = reference("qwen3", "dense")
    notes = [note("explicit 2x4", same_run(run_generate(model, "dense", forced=ref.tokens), ref,
                                           "explicit 2x4"))]
    with jax.set_mesh(user_mesh):
        for m, what in ((model, "2x4"), (single, "one device")):
            what = f"under jax.set_mesh, {what}"
            notes.append(note(what, same_run(run_generate(m, "dense", forced=ref.tokens), ref,
                                             what)))
    return "largest relative logit errors: " + "; ".join(notes)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def worker(process_id: int, port: int, out_path: str, forced_path: str):
    """One of two processes (4 CPU devices each) of a multi-controller run on a 2x4 mesh,
    teacher-forced with the tokens in forced_path."""
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # newer jax: gloo is the default
        pass
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=120)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    cfg = CONFIGS["qwen3"]
    mesh = sharding.make_mesh("2x4")
    model = Model(cfg, random_params(cfg, "float32", seed=1, mesh=mesh))
    out = run_generate(model, "sfi", forced=np.load(forced_path))
    with open(out_path, "w") as f:
        json.dump({"tokens": out.tokens, "slow_steps": out.stats["slow_steps"],
                   "logits": out.stats["logits"].tolist()}, f)
    jax.distributed.shutdown()


def check_multiprocess():
    """Two processes x 4 devices (jax.distributed over localhost), teacher-forced with the
    one-device run's tokens, give its slow steps and logits, and both processes read the same
    results."""
    import subprocess

    port = _free_port()
    ref = reference("qwen3", "sfi")
    with tempfile.TemporaryDirectory() as d:
        outs = [os.path.join(d, f"p{i}.json") for i in range(2)]
        forced = os.path.join(d, "forced.npy")
        np.save(forced, np.asarray(ref.tokens, np.int32))
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), str(port),
                                   outs[i], forced],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for i in range(2)]
        logs = [p.communicate(timeout=600)[0] for p in procs]
        for p, log in zip(procs, logs):
            assert p.returncode == 0, f"worker exited with {p.returncode}:\n{log[-3000:]}"
        got = [json.load(open(o)) for o in outs]
    assert got[0] == got[1], "the two processes disagree"
    assert got[0]["tokens"] == ref.tokens, "2 processes: the forced tokens were not emitted"
    assert got[0]["slow_steps"] == ref.stats["slow_steps"], "2 processes: slow steps differ"
    return note("2 processes", same_logits(got[0]["logits"], ref, "2 processes"))


# The fewest runs that still cover each mesh shape (1x8: heads over 'model'; 2x4: rows and
# heads; 8x1: rows only) with SFI, dense on one (the MoE model's), MoE experts on a mesh, heads
# that no axis divides, split per-layer weights (both models) and fused ones (qwen3), the GPU
# kernels under shard_map, and two processes.
CHECKS = {
    "rules": check_rules,
    "selector": check_selector,
    "loading": check_loading,
    "orbax": check_orbax,
    "generate_qwen3": lambda: check_generation(
        "qwen3", [("1x8", "sfi"), ("2x4", "sfi"), ("8x1", "sfi")], fused=True),
    "generate_qwen3_moe": lambda: check_generation(
        "qwen3_moe", [("8x1", "dense"), ("2x4", "sfi")]),
    "generate_odd_heads": lambda: check_generation("odd_heads", [("2x4", "sfi")], split=False),
    "gpu_kernels": check_gpu_kernels,
    "explicit_mesh": check_explicit_mesh,
    "multiprocess": check_multiprocess,
}


def main(argv):
    if argv[0] == "--worker":
        worker(int(argv[1]), int(argv[2]), argv[3], argv[4])
        return 0
    out_path, names = argv[0], argv[1:] or list(CHECKS)
    assert jax.device_count() == 8, f"expected 8 simulated devices, got {jax.device_count()}"
    results = {}
    for name in names:
        t = time.perf_counter()
        try:
            results[name] = {"ok": True, "detail": CHECKS[name]()}
        except Exception as e:  # reported to pytest, which fails the matching test
            results[name] = {"ok": False, "detail": f"{type(e).__name__}: {e}\n"
                                                    f"{traceback.format_exc()}"}
        results[name]["seconds"] = round(time.perf_counter() - t, 1)
        print(name, results[name]["ok"], results[name]["seconds"], "s", flush=True)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
