"""The Mosaic GPU routed-experts kernels (`moe_mgpu`; compiled on a GPU, the tests marked `gpu`,
Mosaic GPU's interpret mode elsewhere) against the `lax.ragged_dot` path on fresh random
weights: 1 to 64 tokens, experts picked by several tokens and by none, several column blocks
and fewer weight slots than K blocks; their lowering for CUDA at Qwen3-30B-A3B's shapes from
any machine; the dispatch through `moe_mlp`; what they refuse."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sfi_jax.kernels import moe_mgpu, moe_reference

from conftest import gpu_interpret, host_rng, rel_err

BF16_TOL = 2e-2  # each projection rounded to bfloat16, as the reference rounds it


def _case(seed, n_tokens, n_experts, hidden, inter, k, dtype=jnp.bfloat16):
    rng = host_rng(seed)

    def normal(shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape, dtype=np.float32), dtype)

    x = normal((n_tokens, hidden))
    wg, wu = (normal((n_experts, hidden, inter), hidden ** -0.5) for _ in range(2))
    wd = normal((n_experts, inter, hidden), inter ** -0.5)
    logits = rng.standard_normal((n_tokens, n_experts)).astype(np.float32)
    logits[:, : n_experts // 2] += 2.0  # the first half picked more often: shared experts
    top_e = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
    top_p = rng.uniform(0.1, 1.0, (n_tokens, k)).astype(np.float32)
    return x, wg, wu, wd, jnp.asarray(top_p / top_p.sum(1, keepdims=True)), jnp.asarray(top_e)


# tokens, experts, hidden, inter, k, config
_CASES = {
    "1token": (1, 8, 128, 128, 2, None),
    # 6 tokens x 3 of 20 experts: several tokens per expert, some experts unused; 64-wide
    # column blocks (3 of the hidden dim's 192) and 2 weight slots for 4 K blocks
    "6tokens-blocks": (6, 20, 192, 256, 3, moe_mgpu.Config(block_n=64, block_k=64, stages=2)),
    # every expert touched: the slots equal the experts
    "16tokens-all": (16, 8, 128, 192, 4, None),
    # more tokens than the Triton "tokens" path takes
    "40tokens": (40, 12, 128, 128, 2, moe_mgpu.Config(block_n=128, block_k=128, stages=1)),
}


@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.gpu
@pytest.mark.usefixtures("xla_fast_compile")
def test_token_moe_matches_ragged_dot(case):
    n, e, h, i, k, cfg = _CASES[case]
    x, wg, wu, wd, top_p, top_e = _case(sum(map(ord, case)), n, e, h, i, k)
    got = moe_mgpu.token_moe(x, wg, wu, wd, top_p, top_e, interpret=gpu_interpret(), config=cfg)
    want = moe_reference.routed_experts(x, wg, wu, wd, top_p, top_e)
    assert got.shape == (n, h) and got.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(got)))
    assert rel_err(got, want.astype(jnp.float32)) < BF16_TOL, rel_err(got, want)


@pytest.mark.gpu
@pytest.mark.usefixtures("xla_fast_compile")
def test_moe_mlp_dispatches_to_the_twin():
    """moe_mlp(impl="mosaic_gpu") runs the twin for half-precision experts (equal to the
    ragged_dot path) and the Triton "tokens" kernels for float32 ones."""
    from sfi_jax.models.config import ModelConfig
    from sfi_jax.models.modeling import moe_mlp

    e, h, inter = 10, 128, 64
    cfg = ModelConfig(num_layers=1, hidden_size=h, intermediate_size=inter, num_q_heads=2,
                      num_kv_heads=1, head_dim=64, vocab_size=16, max_position_embeddings=64,
                      num_experts=e, num_experts_per_tok=2, moe_intermediate_size=inter)
    x, wg, wu, wd, _, _ = _case(7, 3, e, h, inter, 2)
    w = {"router": jnp.asarray(host_rng(8).standard_normal((h, e), dtype=np.float32),
                               jnp.bfloat16), "we_gate": wg, "we_up": wu, "we_down": wd}
    jaxpr = str(jax.make_jaxpr(lambda x: moe_mlp(w, cfg, x, impl="mosaic_gpu"))(x))
    assert "token_moe" in jaxpr and "sfi_moe_token_swiglu" not in jaxpr
    assert "ragged_dot" not in jaxpr
    got, want = moe_mlp(w, cfg, x, impl="mosaic_gpu"), moe_mlp(w, cfg, x, impl="xla")
    assert got.dtype == want.dtype and rel_err(got, want) < BF16_TOL
    w32 = {name: v.astype(jnp.float32) for name, v in w.items()}
    jaxpr = str(jax.make_jaxpr(lambda x: moe_mlp(w32, cfg, x, impl="mosaic_gpu"))(
        x.astype(jnp.float32)))
    assert "sfi_moe_token_swiglu" in jaxpr


@pytest.mark.parametrize("n_tokens", [1, 16])
def test_kernels_lower_for_cuda(n_tokens):
    """Interpret mode does not prove the kernels compile: their Mosaic GPU lowering runs here,
    for CUDA, at Qwen3-30B-A3B's experts (128 of 2048 x 768, 8 per token)."""
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = (sds((n_tokens, 2048), bf), sds((128, 2048, 768), bf), sds((128, 2048, 768), bf),
            sds((128, 768, 2048), bf), sds((n_tokens, 8), jnp.float32),
            sds((n_tokens, 8), jnp.int32))
    text = jax.jit(moe_mgpu.token_moe).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2


def test_refuses_what_it_cannot_tile():
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    assert moe_mgpu.supported(sds((64, 128), bf), sds((4, 128, 64), bf))
    assert not moe_mgpu.supported(sds((65, 128), bf), sds((4, 128, 64), bf))  # > 64 tokens
    assert not moe_mgpu.supported(sds((4, 96), bf), sds((4, 96, 64), bf))  # H % 64
    assert not moe_mgpu.supported(sds((4, 128), bf), sds((4, 128, 64), jnp.float32))
    # all of K's rows in shared memory: at Qwen3-30B-A3B's H = 2048, 40 tokens, not 41
    assert moe_mgpu.supported(sds((40, 2048), bf), sds((128, 2048, 768), bf))
    assert not moe_mgpu.supported(sds((41, 2048), bf), sds((128, 2048, 768), bf))
    x = jnp.zeros((2, 128), bf)
    w = jnp.zeros((4, 128, 96), bf)
    with pytest.raises(ValueError, match="multiples of 64"):
        moe_mgpu.token_moe(x, w, w, jnp.zeros((4, 96, 128), bf), jnp.ones((2, 1)),
                           jnp.zeros((2, 1), jnp.int32), interpret=True)
