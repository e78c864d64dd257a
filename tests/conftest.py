"""Shared fixtures: the embedded SmolLM2 (ours and transformers'), tiny random HF checkpoints,
and comparison helpers for greedy token streams."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import numpy as np
import pytest

from xla_cpu_flags import fast_compile_flags

# XLA:CPU's older loop-fusion emitter: about half the compile time of the tiny models' programs
# (xla_cpu_flags.py). Set before any backend starts, in this process and so in the
# subprocesses that tests start (scripts, the notebook's kernel, fresh interpreters).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + fast_compile_flags()).strip()

# Files of a minute or more each, with few tests: started first. pytest-xdist hands out whole
# files (--dist loadfile), by default the files with the most tests first, which left these for
# the end of a run, where one worker ran them alone while the other had nothing left to do.
LONG_FILES = ("tests/runtime/test_mesh.py", "tests/scripts/test_scripts.py",
              "tests/test_notebooks.py", "tests/runtime/test_decode_hlo.py",
              "tests/scripts/test_bench_prefill.py", "tests/runtime/test_without_triton.py",
              "tests/serve/test_serve_engine.py")


# The JAX persistent compilation cache that the Python subprocesses of one test run share
# (tmp dir of the run; made by the first process, so that xdist's workers inherit its name)
SUBPROCESS_CACHE = "SFI_JAX_TEST_SUBPROCESS_CACHE"


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist's order by test count, off
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput") and SUBPROCESS_CACHE not in os.environ:
        directory = tempfile.mkdtemp(prefix="sfi_jax_test_jax_cache_")
        os.environ[SUBPROCESS_CACHE] = directory
        config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))


def pytest_collection_modifyitems(config, items):
    """LONG_FILES first, then the other files by number of tests (xdist's own order)."""
    files = [item.nodeid.split("::")[0] for item in items]
    count = {f: files.count(f) for f in set(files)}
    rank = {f: i for i, f in enumerate(LONG_FILES)}
    order = {id(item): (rank.get(f, len(rank)), -count[f]) for item, f in zip(items, files)}
    items.sort(key=lambda item: order[id(item)])  # stable: a file's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def subprocess_compilation_cache():
    """The Python subprocesses that tests start (script smokes, the mesh checker, the notebook's
    kernel) share one JAX persistent compilation cache, empty at the start of each run: what
    one compiled, another reads (the same tiny models' initialisers, prefill and decode
    programs). It is set in the environment that subprocesses inherit, after this process's
    jax read its own: the test processes themselves keep no persistent cache. A cache the
    caller set (JAX_COMPILATION_CACHE_DIR) is left as it is."""
    import jax  # noqa: F401  (reads JAX_* from the environment now, before the lines below)

    directory = os.environ.get(SUBPROCESS_CACHE)
    if not directory or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        yield
        return
    settings = {"JAX_COMPILATION_CACHE_DIR": directory,
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    old = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    yield directory
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def memory_map_count() -> int | None:
    """This process's memory mappings (Linux), or None where /proc is not there."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def memory_map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
    """After each test file, drop JAX's compiled programs once this process holds half the
    kernel's limit of memory mappings. XLA's CPU backend maps about five regions per compiled
    program and frees them only with the executable; one xdist worker compiles several
    thousand programs over the suite, passed 64,000 mappings near its end (the limit,
    vm.max_map_count, is 65,530), and the next compile's mmap failed: LLVM aborted the worker,
    and xdist's controller then hung."""
    yield
    count = memory_map_count()
    if count is not None and count > memory_map_limit() // 2:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


@contextlib.contextmanager
def fast_compile():
    """XLA's slower backend optimisations off (jax_disable_most_optimizations) inside the
    block: the same HLO passes (the optimised HLO, its copies and aliasing, is unchanged), only
    LLVM's code generation does less. For tests whose time is compiling many programs that run
    briefly: the Pallas kernels in interpret mode, the selector's variants, the tiny models'
    prefill and decode programs, the decode loop's HLO. Not for the real model's (SmolLM2)
    runs, whose run time grows without LLVM's optimisations. The setting is restored after;
    it is not part of jax's jit cache key, so a program compiled inside the block is reused as
    it is by a later call with the same static arguments outside it."""
    import jax

    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", old)


@pytest.fixture
def xla_fast_compile():
    """fast_compile() for one test."""
    with fast_compile():
        yield


@contextlib.contextmanager
def interpret_threads_compile_once():
    """Pallas' interpret mode runs a kernel of several simulated threads (the Mosaic GPU
    kernels' warpgroups) by compiling the threads' body anew for every thread at every grid
    point (`thread_map._run_jaxpr`: a fresh jit, traced, lowered and compiled on each call):
    ~2.5 s of compile for a few ms of work, most of a warp-specialised test's time. Inside the
    block each body (the same jaxpr object, the same argument shapes) is compiled once and
    its executable run for every thread and grid point: the same program on the same inputs.
    Where jax has no such function, nothing changes."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:  # pragma: no cover - another jax
        yield
        return
    real = getattr(thread_map, "_run_jaxpr", None)
    if real is None:  # pragma: no cover - another jax
        yield
        return
    import threading

    import jax
    from jax import core as jax_core

    compiled, lock = {}, threading.Lock()

    def _run(jaxpr, consts, *args):  # (thread_map's own)
        jax_core.eval_jaxpr(jaxpr, consts, *args)

    def run_jaxpr(jaxpr, consts, *args):
        key = (id(jaxpr), tuple((np.shape(x), x.dtype if hasattr(x, "dtype")
                                 else np.result_type(x))
                                for x in jax.tree.leaves((consts, args))))
        with lock:  # the first thread compiles; the others wait for its executable
            if key not in compiled:
                exe = jax.jit(_run, static_argnums=(0,)).trace(jaxpr, consts, *args).lower()
                compiled[key] = (jaxpr, exe.compile())  # (jaxpr kept: its id stays unique)
            exe = compiled[key][1]
        exe(consts, *args)

    thread_map._run_jaxpr = run_jaxpr
    try:
        yield
    finally:
        thread_map._run_jaxpr = real
        compiled.clear()


@pytest.fixture
def interpret_threads_once():
    """interpret_threads_compile_once() for one test."""
    with interpret_threads_compile_once():
        yield


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
TINY_EOS = 255


def hf_classes(kind: str):
    """(config class, model class) for "qwen3", "qwen3_moe" or "llama"."""
    import transformers as tf

    return {
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
    }[kind]


def build_hf_model(kind: str = "qwen3", seed: int = 0, **overrides):
    """A tiny random-weight transformers model (float32, eval mode)."""
    import torch

    cfg_cls, model_cls = hf_classes(kind)
    kw = dict(TINY)
    if kind == "qwen3_moe":
        kw.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    kw.update(overrides)
    torch.manual_seed(seed)
    return model_cls(cfg_cls(**kw)).to(torch.float32).eval()


def save_hf_model(model, directory, **save_kw) -> str:
    """save_pretrained (safetensors) into `directory`; returns it as a string."""
    directory = str(directory)
    model.save_pretrained(directory, safe_serialization=True, **save_kw)
    return directory


def make_hf_checkpoint(directory, kind: str = "qwen3", seed: int = 0, save_kw=None, **overrides):
    """Build a tiny random model, save it to `directory`; returns (hf_model, directory)."""
    model = build_hf_model(kind, seed, **overrides)
    return model, save_hf_model(model, directory, **(save_kw or {}))


def hf_logits(model, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def hf_masked_logits(model, tokens, allowed) -> np.ndarray:
    """transformers logits of one sequence [T] where query i attends to key j iff allowed[i, j]
    (a 4D additive mask)."""
    import torch

    allowed = torch.as_tensor(np.asarray(allowed, bool))
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)[None]
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits[0].float().numpy()


def hf_greedy(model, prompt, max_new_tokens: int):
    """transformers greedy generation of one or more equal-length prompts.

    Returns (tokens [B, N], logits [B, N, vocab]) where logits[:, i] produced tokens[:, i]."""
    import torch

    ids = torch.as_tensor(np.atleast_2d(np.asarray(prompt)), dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[:, ids.shape[1]:].numpy()
    logits = torch.stack(out.logits, dim=1).float().numpy()
    return tokens, logits


# The `gpu` marker (pyproject.toml): tests that run a Triton-lowered (impl="pallas_gpu") kernel,
# compiled on a GPU and in interpret mode elsewhere, and the engine tests that need a GPU.
# `python -m pytest -o addopts="" -p no:xdist -m gpu` on a GPU runs them all for real.
GPU_IMPL = pytest.param("pallas_gpu", marks=pytest.mark.gpu)
# the Mosaic GPU kernels (impl="mosaic_gpu"): the same marker, Mosaic GPU's interpret mode off a GPU
MGPU_IMPL = pytest.param("mosaic_gpu", marks=pytest.mark.gpu)


def with_impls(cases, impls, slow=()):
    """Parameters (*case, impl) for every case and impl (a pytest.param's marks kept); the
    Mosaic GPU runs of the cases at the indices in `slow` also marked slow (interpret mode
    takes ~10-20 s a case: a few cases stay in the default run)."""
    out = []
    for i, case in enumerate(cases):
        for impl in impls:
            name, marks = (impl.values[0], list(impl.marks)) if hasattr(impl, "values") \
                else (impl, [])
            if name == "mosaic_gpu" and i in slow:
                marks.append(pytest.mark.slow)
            out.append(pytest.param(*case, name, marks=marks))
    return out


def on_gpu() -> bool:
    from sfi_jax.options import platform

    return platform() == "gpu"


def gpu_interpret() -> bool:
    """`interpret` for a pallas_gpu kernel called directly in a test: False on a GPU (the
    compiled kernel runs), True elsewhere."""
    return not on_gpu()


def host_rng(seed):
    """A numpy generator for an int seed or a jax key's bits. Random inputs are drawn on the
    host: jax.random compiles its sampler anew for every shape and dtype on the CPU."""
    import jax
    import jax.numpy as jnp

    if isinstance(seed, jax.Array):
        if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
            seed = jax.random.key_data(seed)
        seed = np.asarray(seed).ravel().tolist()
    return np.random.default_rng(seed)


def normal(seed, shape, dtype):
    """Standard normal values of `shape`, rounded to `dtype` (seed: as `host_rng`)."""
    import jax.numpy as jnp

    return jnp.asarray(host_rng(seed).standard_normal(shape, dtype=np.float32).astype(dtype))


def rel_err(a, ref) -> float:
    """||a - ref|| / ||ref|| in float64; a NaN in `a` fails the test."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(a).any(), "NaN in the output"
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_close_logits(lg, ref, tol):
    """The same shape, -inf exactly where the reference has it, the finite rest within tol."""
    lg, ref = np.asarray(lg), np.asarray(ref)
    assert lg.shape == ref.shape
    np.testing.assert_array_equal(np.isneginf(lg), np.isneginf(ref))
    fin = np.isfinite(ref)
    assert np.isfinite(lg[fin]).all()
    if fin.any():
        assert rel_err(lg[fin], ref[fin]) <= tol


def near_tie(logits_row, rel: float = 1e-4) -> bool:
    """True when the top two logits differ by less than `rel` of the largest magnitude."""
    top2 = np.sort(np.asarray(logits_row, np.float64))[-2:]
    return top2[1] - top2[0] < rel * max(np.max(np.abs(logits_row)), 1e-6)


def assert_same_greedy(got, want, want_logits, rel: float = 1e-4, what: str = ""):
    """Token streams must be equal; a divergence is accepted only at a near-tie of the reference
    logits (and then only between its top two tokens); later tokens are not compared."""
    got, want = list(map(int, got)), list(map(int, want))
    n = min(len(got), len(want))
    for i in range(n):
        if got[i] != want[i]:
            row = np.asarray(want_logits[i])
            top2 = set(np.argsort(row)[-2:].tolist())
            assert near_tie(row, rel) and got[i] in top2, (
                f"{what}: tokens diverge at {i} ({got[i]} vs reference {want[i]}) and the "
                f"reference's top-2 logits {np.sort(row)[-2:]} are not a near-tie")
            return
    assert len(got) == len(want), f"{what}: {len(got)} tokens vs reference {len(want)}"


@pytest.fixture(scope="session")
def smol_model():
    import sfi_jax

    return sfi_jax.load_model("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smol_tokenizer():
    import sfi_jax

    return sfi_jax.load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def smol_hf():
    """transformers' own load of the same GGUF file, float32."""
    pytest.importorskip("torch")
    import torch
    from transformers import AutoModelForCausalLM

    from sfi_jax.models.gguf_loader import embedded_gguf_path

    # one thread: torch's two-thread CPU kernels cost more than they save on small CI machines
    torch.set_num_threads(1)
    path = embedded_gguf_path()
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                     gguf_file=os.path.basename(path),
                                                     dtype=torch.float32)
    return model.eval()


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers' GGUF load parses the file twice (GGUFReader for the config, again for the
    weights: 8 s each here, most of it the tokenizer's 49K strings) and builds gguf's tensor
    name map once per module (~400 times, 9 s): inside the block the reader of a path and the
    map of an (arch, layers) pair are made once and shared. Both are only read from, so the
    model is the one transformers loads without the block."""
    try:
        import gguf
    except ImportError:  # pragma: no cover - transformers will say so
        yield
        return
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers, maps = {}, {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = real_map(arch, n_blocks)
        return maps[arch, n_blocks]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", name_map)
        yield


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """One tiny random Qwen3 (EOS id 255): .hf (transformers), .model (ours, float32), .dir."""
    import types

    import sfi_jax

    hf, d = make_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=7,
                               eos_token_id=TINY_EOS)
    return types.SimpleNamespace(hf=hf, model=sfi_jax.load_model(d, dtype="float32"), dir=d)


@pytest.fixture
def verify_triton(monkeypatch):
    """jax serializes a Triton module without verifying it, so an ill-typed op (an `scf.for`
    whose bounds differ in type, say) would only fail in the GPU's compile: the kernel tests'
    CUDA exports verify each one."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:  # pragma: no cover - jax without the Triton lowering
        return
    lower = lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()  # raises naming the op that fails
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
