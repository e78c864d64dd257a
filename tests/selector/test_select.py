import dataclasses
import itertools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfi_jax.config import SFIConfig
from sfi_jax.selector import select, selector_scores, topk_positions, window_max
from sfi_jax.selector.select import allowed_mask, score_params
from sfi_reference import check_selection, ref_scores, ref_topk_sets

from conftest import gpu_interpret

# compiling many briefly-run programs is most of this file's time (conftest.py)
pytestmark = pytest.mark.usefixtures("xla_fast_compile")


# ---------------------------------------------------------------------------------------------
def make_inputs(seed, B=3, H=4, R=3, S=160, scale=2.0, lo=None, hi=None):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((B, H, R, S)) * scale).astype(np.float32)
    key_norms = rng.uniform(0.2, 5.0, (B, H, S)).astype(np.float32)
    if lo is None:
        lo = rng.integers(0, 20, B)
        hi = S - rng.integers(0, 30, B)
    lo, hi = np.asarray(lo, np.int32), np.asarray(hi, np.int32)
    for b in range(B):  # the cache is only filled up to some length past J
        logits[b, :, :, min(S, hi[b] + 5):] = -np.inf
    return logits, key_norms, lo, hi


def run_both(logits, key_norms, lo, hi, cfg):
    """The jnp scores and the GPU scores kernel (interpret mode off the GPU) against the float64
    reference."""
    z_ref = ref_scores(logits, key_norms, lo, hi, cfg)
    finite = np.isfinite(z_ref)
    for impl in ("xla", "pallas_gpu"):
        z = np.asarray(selector_scores(logits, key_norms, lo, hi, cfg, impl=impl))
        np.testing.assert_array_equal(np.isfinite(z), finite, err_msg=impl)
        np.testing.assert_allclose(z[finite], z_ref[finite], rtol=2e-5, atol=2e-4, err_msg=impl)
    return z_ref


BASE = SFIConfig.paper(n_sink=4, n_recent=16, k_select=24, nms_radius=3)  # the §4 reference
VARIANTS = {
    "default": {},
    "power_alpha=1": dict(power_alpha=1.0),
    "lam_clip=0": dict(lam_clip=0.0),
    "lam_clip=1": dict(lam_clip=1.0),
    "lam_clip=1,alpha=1": dict(lam_clip=1.0, power_alpha=1.0),
    "alpha_soft=0": dict(alpha_soft=0.0),
    "alpha_cross=0": dict(alpha_cross=0.0),
    "all_off": dict(power_alpha=1.0, lam_clip=0.0, alpha_soft=0.0, alpha_cross=0.0),
    "radius16,T1": dict(nms_radius=16, cross_temp=1.0, alpha_soft=1.0),
    "radius0": dict(nms_radius=0),
    "paper_defaults": dict(k_select=2048, nms_radius=16),
}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.gpu  # the Triton kernels: compiled on a GPU
def test_against_reference(name):
    cfg = dataclasses.replace(BASE, **VARIANTS[name])
    logits, key_norms, lo, hi = make_inputs(seed=len(name))
    z_ref = run_both(logits, key_norms, lo, hi, cfg)
    check_selection(select(logits, key_norms, lo, hi, cfg), z_ref, lo, hi, cfg.k_select)
    z = selector_scores(logits, key_norms, lo, hi, cfg)
    got = topk_positions(z, cfg.k_select, impl="threshold")
    check_selection(got, z_ref, lo, hi, cfg.k_select)


def test_refinements_change_the_selection():
    """Each refinement, switched on, moves the reference selection; so the tests above see it."""
    logits, key_norms, lo, hi = make_inputs(seed=7, B=1, S=400, lo=[0], hi=[400])
    base = dataclasses.replace(BASE, power_alpha=1.0, lam_clip=0.0, alpha_soft=0.0, alpha_cross=0.0, k_select=40)
    ref0 = ref_topk_sets(ref_scores(logits, key_norms, lo, hi, base), 40)
    for change in (dict(power_alpha=0.5), dict(lam_clip=1.0), dict(alpha_soft=0.5), dict(alpha_cross=0.35)):
        cfg = dataclasses.replace(base, **change)
        ref1 = ref_topk_sets(ref_scores(logits, key_norms, lo, hi, cfg), 40)
        assert any(ref0[0, h] != ref1[0, h] for h in range(ref0.shape[1])), change
        got = select(logits, key_norms, lo, hi, cfg)
        check_selection(got, ref_scores(logits, key_norms, lo, hi, cfg), lo, hi, 40)


@pytest.mark.gpu
def test_range_sizes_and_ragged_rows():
    """|J| = 0, 1, 2, < K, = K, > K, an out-of-cache range, in one ragged batch."""
    K, S = 24, 96
    lo = [10, 7, 30, 3, 40, 0, 90]
    hi = [10, 8, 32, 3 + K - 5, 40 + K, 96, 200]
    cfg = dataclasses.replace(BASE, k_select=K)
    logits, key_norms, lo, hi = make_inputs(seed=3, B=len(lo), S=S, lo=lo, hi=hi)
    z_ref = run_both(logits, key_norms, lo, hi, cfg)
    for impl in ("lax", "threshold"):
        got = np.asarray(select(logits, key_norms, lo, hi, cfg, topk_impl=impl))
        check_selection(got, z_ref, lo, np.minimum(hi, S), K)
        assert np.all(got[0] == -1)
        assert np.all(got[1, :, 0] == 7) and np.all(got[1, :, 1:] == -1)
        np.testing.assert_array_equal(got[4], np.broadcast_to(np.arange(40, 40 + K), got[4].shape))


@pytest.mark.gpu
def test_k_larger_than_cache():
    cfg = dataclasses.replace(BASE, k_select=300)
    logits, key_norms, lo, hi = make_inputs(seed=4, B=2, S=100, lo=[0, 20], hi=[100, 70])
    z_ref = run_both(logits, key_norms, lo, hi, cfg)
    for impl in ("lax", "threshold"):
        got = np.asarray(select(logits, key_norms, lo, hi, cfg, topk_impl=impl))
        check_selection(got, z_ref, lo, hi, 300)
        np.testing.assert_array_equal(got[1, :, :50], np.broadcast_to(np.arange(20, 70), (4, 50)))


@pytest.mark.gpu
def test_causal_rows_and_masked_rows():
    """Window queries (prefill) see different prefixes; one row sees nothing of J at all."""
    logits, key_norms, lo, hi = make_inputs(seed=5, B=2, R=4, S=120, lo=[4, 4], hi=[100, 60])
    for r in range(4):
        logits[:, :, r, 80 + 5 * r:] = -np.inf
    logits[1, 2, 0, :] = -np.inf
    z_ref = run_both(logits, key_norms, lo, hi, BASE)
    check_selection(select(logits, key_norms, lo, hi, BASE), z_ref, lo, hi, BASE.k_select)


@pytest.mark.gpu
def test_long_context_scores_do_not_tie():
    """At tens of thousands of positions most probabilities are tiny; scores must keep their order."""
    cfg = dataclasses.replace(BASE, k_select=256, nms_radius=16)
    logits, key_norms, lo, hi = make_inputs(seed=6, B=1, H=2, R=2, S=40000, scale=4.0, lo=[4], hi=[39000])
    z_ref = run_both(logits, key_norms, lo, hi, cfg)
    check_selection(select(logits, key_norms, lo, hi, cfg, topk_impl="threshold"), z_ref, lo, hi, 256)


@pytest.mark.gpu
def test_jit_with_static_config_and_one_head():
    cfg = dataclasses.replace(BASE, k_select=8)
    logits, key_norms, lo, hi = make_inputs(seed=8, B=2, H=1, R=1, S=50)
    f = jax.jit(lambda *a: select(*a, cfg))
    z_ref = run_both(logits, key_norms, lo, hi, cfg)
    check_selection(f(logits, key_norms, lo, hi), z_ref, lo, hi, 8)


def test_cross_head_reduce_over_axis_name():
    """KV heads split over a named axis give the same scores as all heads in one place."""
    cfg = BASE
    logits, key_norms, lo, hi = make_inputs(seed=9, B=2, H=4, S=64)
    full = np.asarray(selector_scores(logits, key_norms, lo, hi, cfg))

    def split(x):  # [B, 4, ...] -> [2 devices, B, 2, ...]
        return jnp.moveaxis(x.reshape(x.shape[0], 2, 2, *x.shape[2:]), 1, 0)

    part = jax.vmap(lambda l, k: selector_scores(l, k, lo, hi, cfg, cross_head_reduce="model"),
                    axis_name="model")(split(jnp.asarray(logits)), split(jnp.asarray(key_norms)))
    part = np.asarray(jnp.moveaxis(part, 0, 1).reshape(full.shape))
    np.testing.assert_allclose(part, full, rtol=1e-6, atol=1e-6)
    local = np.asarray(jax.vmap(lambda l, k: selector_scores(l, k, lo, hi, cfg))(
        split(jnp.asarray(logits)), split(jnp.asarray(key_norms))))
    assert not np.allclose(np.moveaxis(local, 0, 1).reshape(full.shape), full)  # the reduce matters


SHARD_MAP_SCRIPT = textwrap.dedent("""
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    from sfi_jax.config import SFIConfig
    from sfi_jax.selector import select
    cfg = SFIConfig(k_select=16, n_recent=8, nms_radius=3)
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((2, 4, 3, 200)), jnp.float32)
    norms = jnp.asarray(rng.uniform(0.5, 2, (2, 4, 200)), jnp.float32)
    lo, hi = jnp.array([4, 10], jnp.int32), jnp.array([180, 120], jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    f = jax.shard_map(lambda l, k, a, b: select(l, k, a, b, cfg, cross_head_reduce="model"), mesh=mesh,
                      in_specs=(P(None, "model"), P(None, "model"), P(), P()), out_specs=P(None, "model"))
    for impl in ("lax", "threshold"):
        want = select(logits, norms, lo, hi, cfg, topk_impl=impl)
        got = jax.jit(f)(logits, norms, lo, hi)
        assert (np.asarray(got) == np.asarray(want)).all()
    print("ok")
""")


def test_shard_map_over_kv_heads():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", SHARD_MAP_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Top-k on its own
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 7, 64, 300, 500])
@pytest.mark.parametrize("kind", ["distinct", "ties", "masked"])
@pytest.mark.gpu
def test_topk_impls_match_reference(k, kind):
    rng = np.random.default_rng(k)
    shape = (2, 3, 300)
    if kind == "distinct":
        scores = rng.permutation(np.arange(np.prod(shape))).reshape(shape).astype(np.float32) - 900.5
    elif kind == "ties":
        scores = rng.integers(-3, 3, shape).astype(np.float32)
        scores[scores == 0] = rng.choice([0.0, -0.0], int((scores == 0).sum()))  # -0.0 ties with 0.0
    else:
        scores = rng.standard_normal(shape).astype(np.float32) * 1e3
        scores[rng.random(shape) < 0.6] = -np.inf
        scores[0, 0] = -np.inf
    ref = ref_topk_sets(scores, k)
    for impl in ("lax", "threshold", "radix", "radix_kernel", "radix_mosaic_gpu"):
        if impl == "radix_mosaic_gpu" and k != 64 and gpu_interpret():
            continue  # (slow in interpret mode: k = 64 takes every radix width)
        many = (1, 2, 4) if impl.startswith("radix_") else (2, 4, 8)
        for bits in (many if k == 64 else (4,)) if impl != "lax" else (4,):
            got = np.asarray(topk_positions(jnp.asarray(scores), k, impl=impl, radix_bits=bits))
            assert got.shape == shape[:-1] + (k,)
            for idx in np.ndindex(*shape[:-1]):
                n = len(ref[idx])
                assert set(got[idx][:n].tolist()) == ref[idx], (impl, idx)
                assert np.all(np.diff(got[idx][:n]) > 0) and np.all(got[idx][n:] == -1)


@pytest.mark.gpu
def test_topk_threshold_matches_lax_on_long_rows():
    rng = np.random.default_rng(11)
    scores = jnp.asarray(rng.standard_normal((4, 20000)).astype(np.float32))
    scores = scores.at[:, 5000:5100].set(1.5)  # a block of exact ties straddling the threshold
    a = topk_positions(scores, 2048, impl="lax")
    for impl in ("threshold", "radix", "radix_kernel", "radix_mosaic_gpu"):
        b = topk_positions(scores, 2048, impl=impl)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("kernel", ["selector_gpu", "selector_mgpu"])
@pytest.mark.gpu
def test_kth_largest_key_kernel_matches_jnp(bits, kernel):
    """The radix search's kernels, Triton's and Mosaic GPU's (compiled on a GPU), against the
    jnp one on fresh rows: distinct values, ties, -0.0 and -inf padding, a length that is no
    multiple of the block (Mosaic GPU's: of 128, so the row is padded), k = 1 and k = the row
    length."""
    import importlib

    from sfi_jax.kernels.common import sortable_keys
    from sfi_jax.kernels.selector_reference import kth_largest_key

    selector_gpu = importlib.import_module(f"sfi_jax.kernels.{kernel}")
    rng = np.random.default_rng(30 + bits)
    x = rng.standard_normal((5, 3001)).astype(np.float32) * 100
    x[1] = np.round(x[1] / 50)  # heavy ties
    x[1, rng.random(3001) < 0.3] = -0.0
    x[2, rng.random(3001) < 0.9] = -np.inf
    x[3, :] = -np.inf
    for k in (1, 37, 1500, 3001):
        got = selector_gpu.kth_largest_key(jnp.asarray(x), k, radix_bits=bits,
                                            interpret=gpu_interpret())
        want = kth_largest_key(sortable_keys(jnp.asarray(x)), k, bits)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"k={k}")
        if kernel == "selector_mgpu" and bits == 4 and k == 37:  # copies of two register tiles
            got = selector_gpu.kth_largest_key(jnp.asarray(x), k, radix_bits=bits,
                                                interpret=gpu_interpret(),
                                                config=selector_gpu.Config(copy=1024, stages=2))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="radix_bits"):
        selector_gpu.kth_largest_key(jnp.asarray(x), 5, radix_bits=8, interpret=True)
    with pytest.raises(ValueError, match="k=0"):
        selector_gpu.kth_largest_key(jnp.asarray(x), 0, interpret=True)
    if kernel == "selector_mgpu":  # copies in flight beyond one CTA's shared memory
        with pytest.raises(ValueError, match="shared memory"):
            selector_gpu.kth_largest_key(jnp.zeros((1, 65536)), 5, interpret=True,
                                         config=selector_gpu.Config(copy=32768, stages=2))


def test_window_max_against_loop():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 50)).astype(np.float32)
    x[0, :10] = -np.inf
    for radius in (0, 1, 2, 3, 5, 16, 60):
        want = np.array([[row[max(0, i - radius): i + radius + 1].max() for i in range(50)] for row in x])
        got = jax.jit(window_max, static_argnums=1)(jnp.asarray(x), radius)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_successor_spread():
    """successor_radius (an extension): each position lends its score minus 1e-3 per step to its
    next `radius` positions inside J; 0 leaves the scores of §4 unchanged."""
    from sfi_jax.kernels.selector_reference import SUCCESSOR_PENALTY, successor_spread

    rng = np.random.default_rng(4)
    z = rng.standard_normal((2, 3, 40)).astype(np.float32)
    lo, hi = np.array([3, 0]), np.array([30, 40])
    in_j = np.asarray(allowed_mask(40, lo, hi))
    z = np.where(in_j[:, None, :], z, -np.inf).astype(np.float32)
    for radius in (1, 3):
        got = np.asarray(successor_spread(jnp.asarray(z), jnp.asarray(in_j), radius))
        want = np.full_like(z, -np.inf)
        for b in range(2):
            for j in range(lo[b], hi[b]):
                cands = [z[b, :, j]] + [z[b, :, j - s] - s * SUCCESSOR_PENALTY
                                        for s in range(1, radius + 1) if j - s >= 0]
                want[b, :, j] = np.max(np.stack(cands), axis=0)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    cfg = SFIConfig.paper(k_select=8)
    logits = jnp.asarray(rng.standard_normal((2, 3, 4, 40)), jnp.float32)
    norms = jnp.asarray(rng.uniform(0.5, 2, (2, 3, 40)), jnp.float32)
    a = selector_scores(logits, norms, lo, hi, cfg)
    b = selector_scores(logits, norms, lo, hi, dataclasses.replace(cfg, successor_radius=0))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c = selector_scores(logits, norms, lo, hi, dataclasses.replace(cfg, successor_radius=2))
    np.testing.assert_allclose(np.asarray(c), np.asarray(successor_spread(a, jnp.asarray(in_j), 2)))


@pytest.mark.parametrize("case", ["random", "clustered", "ties", "few_finite"])
@pytest.mark.gpu
def test_topk_prefilter_exact(case):
    """The sampled pre-filter path and its radix fallback both give lax.top_k's positions."""
    import importlib

    sel = importlib.import_module("sfi_jax.selector.select")
    rng = np.random.default_rng(21)
    k, size = 256, 13000
    scores = rng.standard_normal((3, 2, size)).astype(np.float32)
    if case == "clustered":  # the top values sit where the strided sample cannot see them
        stride, _, cap = sel._prefilter_plan(size, k)
        cluster = np.arange(2000, 2000 + 2 * cap)
        scores[0, 0, cluster] += 50.0
        scores[0, 0, cluster[cluster % stride == 0]] = -100.0  # the sampled ones
    elif case == "ties":
        scores = np.round(scores * 4) / 4
    elif case == "few_finite":
        scores[1, 1, rng.random(size) < 0.99] = -np.inf
    plan = sel._prefilter_plan(size, k)
    assert plan is not None
    rows = jnp.asarray(scores.reshape(-1, size))
    cand, ok = sel._prefilter(rows, k, plan)
    assert bool(ok) == (case in ("random", "ties")), case  # both paths are exercised
    cand_r, ok_r = sel._prefilter(rows, k, plan, radix_bits=4)  # same sample threshold, no sort
    np.testing.assert_array_equal(np.asarray(cand_r), np.asarray(cand))
    assert bool(ok_r) == bool(ok)
    want = np.asarray(topk_positions(jnp.asarray(scores), k, impl="lax"))
    for impl in ("threshold", "radix", "radix_kernel"):
        got = np.asarray(topk_positions(jnp.asarray(scores), k, impl=impl))
        np.testing.assert_array_equal(got, want, err_msg=impl)


@pytest.mark.gpu
def test_scores_kernel_reads_the_given_slot_and_row():
    """selector_scores_at (the engine's call): the kernel reads logits[:, slot] and
    key_norms[:, row] of the full buffers in place, as the jnp path does after slicing."""
    from sfi_jax.selector.select import selector_scores_at

    rng = np.random.default_rng(11)
    N, M, B, H, R, S = 3, 3, 4, 4, 4, 300
    logits = (rng.standard_normal((N, M, H, R, S)) * 3).astype(np.float32)
    norms = rng.uniform(0.2, 5.0, (N, B, H, S)).astype(np.float32)
    lo, hi = np.array([4, 4, 4], np.int32), np.array([250, 200, 280], np.int32)
    cfg = dataclasses.replace(BASE, lam_clip=1.0)  # a large prior share: the row matters
    # steps 5-6 by jnp (the default), by the adjust kernel (adjust="kernel"), and by jnp for
    # a window the kernel does not unroll
    wide = dataclasses.replace(cfg, nms_radius=65)
    for (c, adjust), impl in itertools.product(
            ((cfg, "xla"), (cfg, "kernel"), (wide, "kernel")), ("xla", "pallas_gpu")):
        # slot and row are traced: one program serves both
        fn = jax.jit(lambda lg, kn, s, r, i=impl, c=c, a=adjust: selector_scores_at(
            lg, s, kn, r, lo, hi, c, impl=i, adjust=a))
        for slot, row in ((0, 3), (2, 1)):
            z_ref = ref_scores(logits[:, slot], norms[:, row], lo, hi, c)
            z = np.asarray(fn(logits, norms, slot, row))
            finite = np.isfinite(z_ref)
            np.testing.assert_array_equal(np.isfinite(z), finite)
            np.testing.assert_allclose(z[finite], z_ref[finite], rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("change", [{}, dict(lam_clip=1.0), dict(lam_clip=0.0, power_alpha=1.0)],
                         ids=["paper", "lam_clip=1", "no_prior,alpha=1"])
@pytest.mark.gpu
def test_scores_mosaic_kernels_match_reference(change):
    """The scores' Mosaic GPU twin (`selector_mgpu.base_scores`; compiled on a GPU) against the
    float64 reference: ragged J (a chunk outside a row's J is skipped: the row's first or last
    chunk), several chunks per (n, head) and copies per chunk, and the default chunking; then
    through the dispatch (`selector_scores_at`, slot and row traced), whose S no multiple of
    128 goes to jnp."""
    from sfi_jax.kernels import selector_mgpu
    from sfi_jax.kernels.selector_reference import adjust_scores
    from sfi_jax.selector.select import selector_scores_at

    cfg = dataclasses.replace(BASE, **change)
    rng = np.random.default_rng(21)
    N, M, B, H, R, S = 3, 2, 4, 2, 3, 1024
    logits = (rng.standard_normal((N, M, H, R, S)) * 3).astype(np.float32)
    norms = rng.uniform(0.2, 5.0, (N, B, H, S)).astype(np.float32)
    lo, hi = np.array([4, 0, 600], np.int32), np.array([400, 1024, 900], np.int32)
    for n in range(N):
        logits[n, ..., min(S, hi[n] + 5):] = -np.inf
    z_ref = ref_scores(logits[:, 1], norms[:, 2], lo, hi, cfg)
    finite = np.isfinite(z_ref)
    params = score_params(cfg)
    for config in (selector_mgpu.ScoresConfig(lines=2, copies=2), None):
        z = selector_mgpu.base_scores(jnp.asarray(logits), jnp.asarray(norms), lo, hi, 1, 2,
                                      params=params, interpret=gpu_interpret(), config=config)
        z = np.asarray(adjust_scores(z, lo, hi, params))  # (steps 5-6 by jnp)
        np.testing.assert_array_equal(np.isfinite(z), finite)
        np.testing.assert_allclose(z[finite], z_ref[finite], rtol=2e-5, atol=2e-4)
    if change:
        return
    fn = jax.jit(lambda lg, kn, s, r: selector_scores_at(lg, s, kn, r, lo, hi, cfg,
                                                         impl="mosaic_gpu"))
    for lg, kn in ((logits, norms), (logits[..., :1000], norms[..., :1000])):  # (1000: jnp)
        z_ref = ref_scores(lg[:, 0], kn[:, 3], lo, np.minimum(hi, lg.shape[-1]), cfg)
        z = np.asarray(fn(lg, kn, 0, 3))
        finite = np.isfinite(z_ref)
        np.testing.assert_array_equal(np.isfinite(z), finite)
        np.testing.assert_allclose(z[finite], z_ref[finite], rtol=2e-5, atol=2e-4)


@pytest.mark.gpu
def test_scores_kernel_pads_any_radius():
    """base_scores(pad=nms_radius) for radii that are not a power of two (Triton's arrays
    are): the row of z between exactly `pad` -inf positions on each side, and the same z as
    without pads (the pads' masked stores reach neither into z nor past the row)."""
    from sfi_jax.kernels import selector_gpu

    logits, key_norms, lo, hi = make_inputs(seed=3, B=2, H=3, R=3, S=333)
    # several chunks per row
    kw = dict(params=score_params(BASE), interpret=gpu_interpret(), chunk_blocks=2)
    args = (logits[:, None], key_norms[:, None], lo, hi, 0, 0)
    plain = np.asarray(selector_gpu.base_scores(*args, **kw))
    assert np.isfinite(plain).any()
    for pad in (3, 5):
        padded = np.asarray(selector_gpu.base_scores(*args, pad=pad, **kw))
        assert padded.shape == (2, 3, 333 + 2 * pad)
        assert np.isneginf(padded[..., :pad]).all() and np.isneginf(padded[..., -pad:]).all()
        np.testing.assert_array_equal(padded[..., pad:-pad], plain)


@pytest.mark.parametrize("change", [{}, dict(nms_radius=1), dict(nms_radius=3, cross_temp=1.0),
                                    dict(alpha_cross=0.0), dict(alpha_soft=0.0)],
                         ids=["default", "radius1", "radius3,T1", "no_cross", "no_nms"])
@pytest.mark.gpu
def test_adjust_kernel_against_jnp(change):
    """Steps 5-6 by the GPU kernel (compiled on a GPU; the window max from shifted loads,
    all heads in one tile, three of them padded to four) against the jnp steps, on ragged
    ranges including an empty one and one shorter than the window."""
    from sfi_jax.kernels import selector_gpu
    from sfi_jax.selector.select import adjust_scores

    cfg = SFIConfig.paper(**change)  # the kernel does steps 5-6; the spread runs after it
    rng = np.random.default_rng(len(str(change)))
    S = 700
    lo, hi = np.array([4, 0, 30, 9], np.int32), np.array([650, 700, 30, 13], np.int32)
    z = (rng.standard_normal((4, 3, S)) * 3).astype(np.float32)
    z = np.where(np.asarray(allowed_mask(S, lo, hi))[:, None, :], z, -np.inf).astype(np.float32)
    want = np.asarray(adjust_scores(z, lo, hi, cfg))
    pad = selector_gpu.adjust_pad(score_params(cfg))  # the kernel reads rows between -inf pads
    padded = np.pad(z, ((0, 0), (0, 0), (pad, pad)), constant_values=-np.inf)
    got = np.asarray(selector_gpu.adjust_scores(padded, lo, hi, params=score_params(cfg),
                                                interpret=gpu_interpret()))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


def test_adjust_kernel_bounds_its_radius():
    """The kernel unrolls one load per window offset: a radius past its bound is refused by
    name, and selector_scores_at runs the jnp steps for it instead."""
    from sfi_jax.kernels import selector_gpu

    big = SFIConfig(nms_radius=selector_gpu.ADJUST_MAX_RADIUS + 1)
    assert not selector_gpu.adjust_supported(score_params(big))
    assert selector_gpu.adjust_supported(score_params(dataclasses.replace(big, alpha_soft=0.0)))
    z = np.zeros((1, 2, 300), np.float32)
    with pytest.raises(ValueError, match="nms_radius"):
        selector_gpu.adjust_scores(z, np.array([0]), np.array([100]), params=score_params(big),
                                   interpret=True)


def test_remembered_scores_raise_held_positions_inside_j_only():
    """SFIConfig.selection_memory: a held position inside J = [lo, hi) scores the larger of its
    new score and its remembered one less the decay; sinks, padding (-1) and positions outside
    J keep their new score. Checked against a loop on fresh random scores."""
    from sfi_jax.runtime.selection import remembered_scores

    rng = np.random.default_rng(3)
    L, H, S, C = 2, 3, 40, 9
    lo, hi = np.array([2, 4]), np.array([30, 25])
    z = rng.normal(size=(L, H, S)).astype(np.float32)
    z[..., :2] = -np.inf
    held = rng.integers(-1, S, (L, H, C)).astype(np.int32)
    held[..., :2] = [0, 1]  # the sinks
    held_scores = rng.normal(1.0, 2.0, (L, H, C)).astype(np.float32)
    got = np.asarray(remembered_scores(jnp.asarray(z), jnp.asarray(held),
                                       jnp.asarray(held_scores), lo[:, None, None],
                                       hi[:, None, None], 0.75))
    want = z.copy()
    for l, h, c in np.ndindex(L, H, C):
        j = held[l, h, c]
        if lo[l] <= j < hi[l]:
            want[l, h, j] = max(want[l, h, j], held_scores[l, h, c] - 0.75)
    np.testing.assert_array_equal(got, want)
    assert np.any(got != z)  # some held score won
