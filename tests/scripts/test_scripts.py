"""The benchmark and diagnostic scripts run end to end on a CPU in their smoke modes (tiny
configs), and their reports say what the results say. A script runs in a process of its own
only where that is its point (the variant runner) or where it sets start-up flags (the memory
diagnostic); the others run in this process through their main(argv)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPTS = os.path.join(ROOT, "scripts")


def _run(*args, timeout=600, env=None):
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                         cwd=ROOT, env={**os.environ, **(env or {})})
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def load(rel: str):
    """scripts/<rel> as a module (once per test session). Environment defaults a script sets
    when imported (a GPU memory fraction) are undone, so they do not reach later tests."""
    if rel == "_common.py":  # the module the scripts import, not a second copy
        if SCRIPTS not in sys.path:
            sys.path.insert(0, SCRIPTS)
        return importlib.import_module("_common")
    name = "script_" + os.path.splitext(rel)[0].replace("/", "_")
    if name not in sys.modules:
        env = dict(os.environ)
        spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, rel))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        finally:
            os.environ.clear()
            os.environ.update(env)
    return sys.modules[name]


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """One bench_variants.py call, shared by the tests below: 'base' (bench_e2e.py --smoke as
    it is), 'other' (an engine option, an environment variable, extra arguments, and another
    copy of the code via --tree) and 'broken' (a checkout whose bench_e2e.py fails at once,
    before it imports anything). Compiling is most of a smoke run: XLA's slower optimisations
    are off (the timings are only checked to be positive), and the smoke processes share the
    test run's compilation cache (conftest.py)."""
    tmp = tmp_path_factory.mktemp("variants")
    out, tree, broken = tmp / "ab", tmp / "other_checkout", tmp / "broken_checkout"
    for part in ("sfi_jax", "scripts"):
        shutil.copytree(os.path.join(ROOT, part), tree / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (broken / "scripts" / "bench").mkdir(parents=True)
    (broken / "scripts" / "bench" / "bench_e2e.py").write_text(
        "import sys\nsys.exit('this checkout is broken')\n")
    text = _run(os.path.join(SCRIPTS, "bench", "bench_variants.py"), "--out", str(out),
                "--variant", "base=",
                "--variant", "other=layer_unroll=2,XLA_PYTHON_CLIENT_MEM_FRACTION=0.5",
                "--args", "other=--opt selector_topk=radix", "--tree", f"other={tree}",
                "--variant", "broken=", "--tree", f"broken={broken}", "--", "--smoke",
                env={"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"})
    return out, tree, text


def test_bench_e2e_smoke(variants):
    out, _, _ = variants
    data = json.loads((out / "base.json").read_text())
    (rec,) = data["results"]
    for key in ("dense_tokens_per_s", "sfi_tokens_per_s", "fast_step_s", "slow_step_s",
                "selector_row_s", "repack_row_s", "slow_share", "dense_attention_share",
                "pred_dense_step_s", "pred_sfi_step_s", "dense_of_floor", "sfi_of_floor"):
        assert rec[key] > 0, key
    assert 0.0 < rec["slow_share"] < 1.0
    assert abs(rec["speedup"] - rec["dense_step_s"] / rec["sfi_step_s"]) < 1e-9


def test_bench_e2e_merge(variants, tmp_path):
    """Merging runs keeps each (model, context) once (the last file's row), their commands,
    the notes, and the out-of-memory entries that no file has a row for."""
    bench_e2e = load("bench/bench_e2e.py")
    data = json.loads((variants[0] / "base.json").read_text())
    (rec,) = data["results"]
    other = dict(data, results=[dict(rec, context=1024)])
    later = dict(data, results=[dict(rec, sfi_tokens_per_s=123456.0)],
                 meta=dict(data["meta"], command="python later-run", out_of_memory=[
                     dict(model="tiny", context=1024, batches=[3]),
                     dict(model="tiny", context=512, batches=[2])]))
    paths = [str(variants[0] / "base.json")]
    for name, d in (("other", other), ("later", later)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "e2e.json").write_text(json.dumps(d))
        paths.append(str(tmp_path / name / "e2e.json"))
    notes = tmp_path / "notes.md"
    notes.write_text("## Notes\nsome analysis\n")
    merged = tmp_path / "merged"
    bench_e2e.main(["--merge", *paths, "--notes", str(notes), "--out", str(merged)])
    md = (merged / "e2e.md").read_text()
    assert md.count("| tiny | 2560 |") == 1 and md.count("| tiny | 1024 |") == 1
    assert "| 123456 |" in md and "some analysis" in md
    assert "tiny 512 (batches 2)" in md and "tiny 1024 (batches" not in md
    sfi = rec["sfi_of_floor"]
    want = f"met ({sfi:.2f}" if sfi >= 0.75 else f"missed by 2 of 2 rows: {sfi:.2f}-{sfi:.2f}"
    assert f"| SFI arm >= 0.75 of its bytes floor | {want}" in md
    rows = json.loads((merged / "e2e.json").read_text())["results"]
    assert [r["context"] for r in rows] == [2560, 1024]
    assert rows[0]["command"] == "python later-run" and "--smoke" in rows[1]["command"]
    # the report's command line names the runs of the rows it kept, not the replaced ones
    meta = json.loads((merged / "e2e.json").read_text())["meta"]
    assert meta["command"] == f"python later-run ; {rows[1]['command']}"


def test_bench_variants_runs_each_variant_in_its_own_process(variants):
    """Each variant in its own process with its engine options, environment and arguments,
    from this checkout or another: a JSON, a log and a table row each; a variant whose process
    fails is reported, not fatal."""
    out, tree, text = variants
    base = json.loads((out / "base.json").read_text())
    rec = base["results"][0]
    assert rec["model"] == "tiny" and rec["package"] == os.path.join(ROOT, "sfi_jax")
    # the record names the resolved options: the CPU defaults here
    assert rec["options"]["selector_topk"] == "lax" and rec["options"]["layer_unroll"] == 1
    assert base["meta"]["mem_fraction"] != "0.5"
    other = json.loads((out / "other.json").read_text())
    assert other["results"][0]["options"]["layer_unroll"] == 2
    assert other["results"][0]["options"]["selector_topk"] == "radix"
    assert other["meta"]["mem_fraction"] == "0.5"
    assert other["results"][0]["package"] == str(tree / "sfi_jax")
    assert "| base | tiny | 2560 | 2 |" in text and "| other | tiny | 2560 | 2 |" in text
    assert "this checkout is broken" in (out / "broken.log").read_text()
    assert not (out / "broken.json").exists()
    assert "| broken | - | - | - | - | - | - | - | - | 1 |" in text
    assert text[text.index("| variant"):].strip() in (out / "variants.md").read_text()


def test_bench_variants_parses_variants():
    bench_variants = load("bench/bench_variants.py")
    assert bench_variants.parse_variant("a=X=1,Y=2") == ("a", {"X": "1", "Y": "2"})
    # lower-case keys are engine options for bench_e2e, upper-case ones the environment
    assert bench_variants.split_settings({"repack": "xla", "XLA_FLAGS": "--f", "moe": "xla"}) == (
        {"XLA_FLAGS": "--f"}, ["--opt", "repack=xla", "--opt", "moe=xla"])
    # a comma-separated flag list stays one value
    assert bench_variants.parse_variant("c=XLA_FLAGS=--f=A,B,C,Y=2") == (
        "c", {"XLA_FLAGS": "--f=A,B,C", "Y": "2"})
    for bad in ("=X=1", "a=X"):
        with pytest.raises(SystemExit, match=bad):
            bench_variants.parse_variant(bad)


def test_diag_moe_kernel_smoke(tmp_path, capsys, xla_fast_compile):
    """The MoE kernel diagnostic checks each config against ragged_dot and writes its rows."""
    out = tmp_path / "moe.json"
    load("diag/diag_moe_kernel.py").main(["--tiny", "--interpret", "--tokens", "1,16",
                                          "--configs", "64x64x4x3,32x16x2x2", "--out", str(out)])
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tokens"], r["config"]) for r in rows] == [
        (t, c) for t in (1, 16) for c in ("ragged_dot", "64x64x4x3", "tokens:64x64x4x3",
                                           "32x16x2x2", "tokens:32x16x2x2")]
    assert all(r["ok"] and r["ms"] > 0 for r in rows), rows
    assert all(r["rel_err_out"] < 2e-2 for r in rows if r["config"] != "ragged_dot")
    assert "| 16 | 32x16x2x2 | True |" in text


def test_engine_check_moe_kernels_against_ragged_dot(xla_fast_compile):
    """bench_e2e's GPU check of the expert kernels (interpret mode here) passes on a small MoE
    config, and would catch a kernel that drops the up projection."""
    bench_e2e = load("bench/bench_e2e.py")

    from sfi_jax.kernels import moe_gpu
    from sfi_jax.models.config import ModelConfig

    cfg = ModelConfig(num_layers=1, hidden_size=128, intermediate_size=64, num_q_heads=2,
                      num_kv_heads=1, head_dim=64, vocab_size=16, max_position_embeddings=64,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    assert bench_e2e.moe_kernel_check(cfg, n_tokens=6) < 2e-2
    assert bench_e2e.moe_kernel_check(cfg, n_tokens=6, impl="tokens") < 2e-2
    real = moe_gpu.grouped_matmul

    def gate_only(x, w, sizes, w2=None, **kw):  # SiLU(x @ w) without the up product
        return real(x, w, sizes, **kw) if w2 is None else jax.nn.silu(real(x, w, sizes, **kw))

    try:
        moe_gpu.grouped_matmul = gate_only
        assert bench_e2e.moe_kernel_check(cfg, n_tokens=6) > 0.1
    finally:
        moe_gpu.grouped_matmul = real


def _scaled_sine(x, y):
    a = jnp.sin(x) * y + 1.0
    return jnp.sum(a * a, axis=-1), jnp.exp(a)


def test_kernel_sources_maps_fusions_to_lines():
    """kernel_sources: a compiled fusion's name (as a profile writes it) -> its ops and the
    source lines they come from, here this file's `_scaled_sine`."""
    import inspect
    import re

    kernel_sources = load("_common.py").kernel_sources

    x = jnp.ones((64, 128))
    hlo = jax.jit(_scaled_sine).lower(x, x).compile().as_text()
    names = [n.replace(".", "_") for n in re.findall(r"%(\S*fusion\S*) = ", hlo)]
    got = kernel_sources(hlo, names + ["no_such_kernel"], prefer="test_scripts")
    assert set(got) == set(names) and names
    first = inspect.getsourcelines(_scaled_sine)[1]
    lines = {f"test_scripts.py:{first + 1} _scaled_sine", f"test_scripts.py:{first + 2} _scaled_sine"}
    assert all(set(v["sources"]) <= lines and v["sources"] for v in got.values()), got
    assert any("sine" in v["ops"] for v in got.values())


def test_bench_selector_kernels_smoke(tmp_path, xla_fast_compile):
    """The selector-stage timing script runs (interpret mode here) and finds the kernels'
    scores (Triton's and the Mosaic GPU twin's) equal to the jnp ones."""
    load("bench/bench_selector_kernels.py").main(["--smoke", "--mosaic", "--out", str(tmp_path)])
    with open(tmp_path / "selector_kernels.json") as f:
        res = json.load(f)
    assert res["max_abs_diff"] < 1e-4 and res["mosaic_max_abs_diff"] < 1e-4
    assert all(res[k] > 0 for k in ("kernel steps 1-6", "jnp steps 1-6", "kernel steps 5-6",
                                    "mosaic steps 1-4 default", "mosaic steps 1-6"))


def test_bench_fitting_retries_fewer_rows_on_out_of_memory(monkeypatch, tmp_path):
    """When the decode loop runs out of device memory the benchmark retries with one row fewer
    and says which batches failed; when every try fails, the report lists the (model, context)
    without a row (dropped by a merge with a file that has the row); other errors propagate."""
    bench_e2e = load("bench/bench_e2e.py")

    from sfi_jax.models.config import PRESETS

    tried = []

    def fake_bench_one(name, cfg, params, ctx, args, bw, B):
        tried.append(B)
        if B > 7:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return {"batch": B}

    monkeypatch.setattr(bench_e2e, "bench_one", fake_bench_one)
    monkeypatch.setattr(bench_e2e, "pick_batch", lambda *a: 10)
    args = bench_e2e.argparse.Namespace(chunk_steps=64, new_tokens=256, batch=16, t_max=64)
    rec = bench_e2e.bench_fitting("m", PRESETS["qwen3-0.6b"], None, 8192, args, 1.0, 1)
    assert tried == [10, 9, 8, 7] and rec == {"batch": 7, "batches_out_of_memory": [10, 9, 8]}
    monkeypatch.setattr(bench_e2e, "pick_batch", lambda *a: 8)
    tried.clear()
    rec = bench_e2e.bench_fitting("m", PRESETS["qwen3-0.6b"], None, 8192, args, 1.0, 1)
    assert tried == [8, 7] and rec["batches_out_of_memory"] == [8]
    monkeypatch.setattr(bench_e2e, "pick_batch", lambda *a: 10)
    with pytest.raises(bench_e2e.OutOfMemory, match=r"out of memory at batches \[10, 9\]") as e:
        bench_e2e.bench_fitting("m", PRESETS["qwen3-0.6b"], None, 8192, args, 1.0, 1, tries=2)
    # the report names it; merging keeps it once
    meta = dict(device="d", jax="j", copy_bw_tbs=1.0, command="c", fill="random", new_tokens=1,
                trigger_every=20, t_max=64, out_of_memory=[e.value.entry])
    for name in ("a", "b"):
        checked = dict(meta, engine_check={"ok": name}, command=f"run {name}")
        bench_e2e.write_outputs([], checked if name == "b" else meta, str(tmp_path / name))
    bench_e2e.merge_reports([str(tmp_path / n / "e2e.json") for n in ("a", "b")],
                            str(tmp_path / "merged"))
    md = (tmp_path / "merged" / "e2e.md").read_text()
    assert md.count("m 8192 (batches 10, 9)") == 1 and "No row (out of memory" in md
    merged_meta = json.loads((tmp_path / "merged" / "e2e.json").read_text())["meta"]
    assert merged_meta["engine_check"] == {"ok": "b"}  # the newest check, with its command
    assert merged_meta["engine_check_command"] == "run b"

    def broken(*a):
        raise ValueError("not a memory error")

    monkeypatch.setattr(bench_e2e, "bench_one", broken)
    with pytest.raises(ValueError, match="not a memory error"):
        bench_e2e.bench_fitting("m", PRESETS["qwen3-0.6b"], None, 8192, args, 1.0, 1)


def test_bench_random_kv_is_per_layer_random():
    """The benchmark's random cache: one bf16 buffer each for K and V, filled layer by layer
    with independent normal values (no repeated layer, K differs from V)."""
    import numpy as np

    k, v = load("_common.py").random_kv(jax.random.key(0), (3, 2, 2, 64, 8))
    assert k.shape == v.shape == (3, 2, 2, 64, 8) and k.dtype == v.dtype == "bfloat16"
    k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)
    assert 0.8 < k.std() < 1.2 and 0.8 < v.std() < 1.2 and abs(k.mean()) < 0.1
    assert not np.allclose(k, v)
    assert all(not np.allclose(k[i], k[j]) for i in range(3) for j in range(i))


def test_diag_memory_smoke(tmp_path):
    """The memory diagnostic compiles a decode chunk from shapes and reports its buffers (with
    XLA's slower optimisations off: half the time, and the same buffers and aliasing)."""
    out = tmp_path / "mem.json"
    text = _run(os.path.join(SCRIPTS, "diag", "diag_memory.py"), "--rows", "qwen3-0.6b:512:2:dense",
                "--out", str(out), env={"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"})
    (rec,) = json.loads(out.read_text())
    assert "error" not in rec, rec.get("error")
    # the cache is an argument, aliased to the output (donated), and the report says so
    assert rec["alias_size_in_bytes"] >= rec["kv_cache_gib"] > 0
    assert rec["argument_size_in_bytes"] > rec["kv_cache_gib"] and rec["largest_buffers"]
    assert "| qwen3-0.6b | 512 | 2 | dense |" in text


def test_bench_selector_topk_smoke(tmp_path, xla_fast_compile):
    """The top-k timing script runs the listed impls (the radix kernel in interpret mode) and
    each selects lax.top_k's positions."""
    out = tmp_path / "topk.json"
    load("bench/bench_selector.py").main(["--smoke", "--no-select", "--cases", "3x9000",
                                          "--impls", "lax,radix/4,radix_kernel/2",
                                          "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["impl"] for r in rows] == ["lax", "radix/4", "radix_kernel/2"]
    assert all(r["same_as_lax"] and r["us"] > 0 for r in rows)
    # the radix search alone: the Triton kernel and two Mosaic GPU configs, checked against jnp
    load("bench/bench_selector.py").main(["--smoke", "--no-select", "--cases", "2x2048",
                                          "--impls", "lax", "--kth-configs", "0:2,2048:1",
                                          "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["impl"] for r in rows] == ["lax", "kth_triton/2", "kth_mgpu/0:2", "kth_mgpu/2048:1"]
    assert all(r["same_as_lax"] and r["us"] > 0 for r in rows)


def test_bench_skinny_matmul_smoke_and_report(tmp_path, xla_fast_compile):
    """The weight-matmul bench on tiny shapes (the kernel in interpret mode, checked against
    the float32 reference), then its Markdown report from the JSON."""
    out = tmp_path / "skinny.json"
    bench = load("bench/bench_skinny_matmul.py")
    bench.main(["--smoke", "--models", "qwen3-0.6b", "--rows", "3", "--iters", "1",
                "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["proj"] for r in rows] == ["tiny", "tiny_pair"]
    for r in rows:
        assert r["err"]["kernel:default"] < 1e-2 and set(r["us"]) == {"xla", "kernel:default"}
    bench.main(["--report", str(out), "--out", str(tmp_path / "report.md")])
    text = (tmp_path / "report.md").read_text()
    assert "| qwen3-0.6b | tiny_pair | 3 |" in text


def test_bench_quickstart_reads_the_stats_line():
    """bench_quickstart parses the CLI's own stats line (rates, the dense path) and gives each
    mode's median warm rate over dense's."""
    from sfi_jax.cli import stats_line

    bq = load("bench/bench_quickstart.py")
    s = {"prompt_tokens": [41], "prefill_s": 0.5, "compile_s": 1.25, "decode_tokens": 82,
         "decode_s": 4.1, "decode_tokens_per_s": 20.0, "ttft_s": 0.6,
         "first_token_from_start_s": 9.0, "decode_path": "dense"}
    line = stats_line("sfi", s)
    got = bq.STATS.search(line).groupdict()
    assert float(got["decode_tokens_per_s"]) == 20.0 and float(got["decode_tokens"]) == 82
    assert "decoded densely" in line and "decoded densely" not in stats_line(
        "sfi", dict(s, decode_path="sfi", slow_steps=[1], fast_steps=[80]))
    runs = [dict(kind="first", mode="sfi", decode_tokens_per_s=1.0)] + \
        [dict(kind="warm", mode=m, decode_tokens_per_s=r)
         for m, r in [("sfi", 9.0), ("dense", 10.0), ("sfi", 13.0), ("dense", 8.0),
                      ("sfi", 10.5), ("dense", 12.0)]]
    out = bq.summary(runs)
    assert out["sfi"]["median"] == 10.5 and out["dense"]["median"] == 10.0
    assert out["sfi"]["vs_dense"] == 1.05
    assert out["sfi"]["decode_tokens_per_s"] == [9.0, 13.0, 10.5]


def test_eval_acceptance_intervals():
    """The bootstrap interval of a pooled rate: exact when every row has the same rate, and
    inside the rows' range (containing the pooled rate) otherwise; None with no drafts."""
    acc = load("eval_acceptance.py")
    assert acc.interval([10, 20, 30], [5, 10, 15], 500) == [0.5, 0.5]
    lo, hi = acc.interval([10, 10, 10, 10], [0, 10, 5, 5], 2000)
    assert 0.0 <= lo < 0.5 < hi <= 1.0
    assert acc.interval([0, 0], [0, 0], 100) is None


def test_verify_refresh_policy_refreshes_at_each_verify(tiny_qwen3, xla_fast_compile):
    """verify_refresh (t_max = draft_len + 1): a verify that ends a full draft selects from its
    own logits, so most of a row's verify steps refresh (a draft cut short by a trigger or a
    rejection waits for the next); plain SFI (t_max 64, its warm-up off) refreshes once here.
    Both give dense decoding's tokens."""
    import dataclasses

    import numpy as np

    import sfi_jax

    acc = load("eval_acceptance.py")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 250, n).tolist() for n in (150, 170)]
    kw = dict(max_new_tokens=24, stop_at_eos=False)
    dense = sfi_jax.generate(tiny_qwen3.model, prompts, mode="dense", **kw)
    runs = {}
    for pol in ("verify_refresh", "sfi"):
        cfg = acc.policy_config(pol, 0.15, 512, 64, 3)
        if pol == "sfi":  # (the default warm-up refreshes every 4 steps over the first 32)
            cfg = dataclasses.replace(cfg, warmup_steps=0)
        runs[pol] = sfi_jax.generate(tiny_qwen3.model, prompts, mode="exact", sfi=cfg, **kw)
        assert runs[pol].tokens == dense.tokens
    s = runs["verify_refresh"].stats
    assert all(slow >= 0.6 * verify for slow, verify in zip(s["slow_steps"], s["verify_steps"]))
    assert sum(runs["sfi"].stats["slow_steps"]) <= sum(s["slow_steps"]) / 4


def test_bench_generate_times_each_case_through_generate(tiny_qwen3, tmp_path,
                                                         xla_fast_compile):
    """bench_generate on a tiny checkpoint: one row per case, SFI inside its budget reported
    as the dense path, exact mode's tokens per verify at least 1, the report written."""
    bench = load("bench/bench_generate.py")
    out = str(tmp_path / "generate")
    report = bench.main(["--model", tiny_qwen3.dir, "--context", "64", "--new-tokens", "8",
                         "--cases", "dense,sfi,exact,exact@0.9", "--out", out])
    rows = {r["case"]: r for r in report["rows"]}
    assert list(rows) == ["dense", "sfi", "exact", "exact@0.9"]
    assert all(r["decode_tokens_per_s"] > 0 for r in rows.values())
    assert rows["sfi"]["decode_path"] == "dense" and rows["dense"]["decode_path"] == "dense"
    assert rows["exact"]["tokens_per_verify"] >= 1 and rows["exact@0.9"]["accept_rate"] == 0.9
    md = open(out + ".md").read()
    assert md.count("\n| exact") == 2 and json.load(open(out + ".json"))["rows"][0]["case"] \
        == "dense"
    with pytest.raises(SystemExit):
        bench.main(["--cases", "sfi@0.5", "--out", out])
