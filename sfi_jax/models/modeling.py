"""Flax NNX decoder for Qwen3 (dense and MoE) and Llama-family checkpoints.

Layer weights come in one of two layouts: stacked along a leading layer axis (the layers run
under `lax.scan`, compile time does not grow with depth) or split, one dict per layer (a Python
loop: no per-layer slice of stacked weights, which XLA on GPU copies at every step). Split
layers may also hold one fused q/k/v weight and K-major (transposed) weights. A `WeightLayout`
says which, decided when the model is loaded (`Model.layout`); the layer functions and
`run_layers` take it instead of looking at the weights' names.

The layer is split in two halves around attention
(`attention_inputs` and `attention_output_and_mlp`) so the runtime can put its own KV cache
and decode kernels in between; `forward` is the plain full-sequence causal path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sfi_jax.kernels import heads as heads_kernels
from sfi_jax.kernels import moe as moe_kernels
from sfi_jax.kernels import skinny_matmul as skinny_matmul_kernels
from sfi_jax.kernels.skinny_matmul import skinny_matmul
from sfi_jax.kernels.common import rms_norm
from sfi_jax.models.config import ModelConfig, rope_inv_freq_and_scale


QKV = ("wq", "wk", "wv")
# The weights into the hidden state and the dense MLP's: in the K-major layout each is stored
# transposed, [N, K], under its name + T_SUFFIX, so that every output column's weights are one
# contiguous read (`skinny_matmul_gpu.skinny_matmul_kmajor`)
K_MAJOR = ("wo", "w_gate", "w_up", "w_down")
T_SUFFIX = "_t"


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """How the layer weights are stored (hashable: a static argument).

    split: one dict per layer (a list) instead of one dict of [L, ...] stacked weights.
    fused_qkv: one "wqkv" [hidden, (Hq + 2 Hkv) D] per layer instead of wq, wk, wv.
    k_major: the `K_MAJOR` weights stored transposed, [N, K], as name + T_SUFFIX.
    The last two are layouts of split layers."""

    split: bool = False
    fused_qkv: bool = False
    k_major: bool = False

    def __post_init__(self):
        if (self.fused_qkv or self.k_major) and not self.split:
            raise ValueError(f"{self}: fused q/k/v and K-major weights are layouts of split "
                             "layers (split=True)")

    def names(self, stacked_names) -> set:
        """A layer's weight names in this layout, from the stacked layout's names."""
        names = set(stacked_names)
        if self.fused_qkv:
            names = (names - set(QKV)) | {"wqkv"}
        if self.k_major:
            names = {n + T_SUFFIX if n in K_MAJOR else n for n in names}
        return names

    def weight(self, w: dict, name: str):
        """(weight, transposed): a layer's weight `name` as stored, [K, N] or (K-major) [N, K]."""
        if self.k_major and name in K_MAJOR:
            return w[name + T_SUFFIX], True
        return w[name], False

    @classmethod
    def of(cls, layers) -> "WeightLayout":
        """The layout of a params tree's "layers" entry, read from its structure (static under
        jit): by `Model(config, params)` when no loader states it, and once per compiled
        program (decode, exact, prefill), whose weights arrive as a plain pytree. The one
        place that reads the weights' names; ValueError for an unknown mix."""
        split = isinstance(layers, (list, tuple))
        names = set(layers[0] if split else layers)
        layout = cls(split=split, fused_qkv="wqkv" in names,
                     k_major=any(n.endswith(T_SUFFIX) for n in names))
        plain = {n[:-len(T_SUFFIX)] if n.endswith(T_SUFFIX) else n for n in names}
        if layout.fused_qkv:
            plain = (plain - {"wqkv"}) | set(QKV)
        if layout.names(plain) != names or (layout.fused_qkv and set(QKV) & names):
            raise ValueError(f"layer weights {sorted(names)} are in no known layout")
        return layout


STACKED = WeightLayout()


def k_major_names(cfg: ModelConfig) -> tuple:
    """The `K_MAJOR` weights a layer of this model has (an MoE layer: the output projection)."""
    return ("wo",) if cfg.is_moe else K_MAJOR


class DecoderLayers(nnx.Module):
    """All decoder layers, each weight stacked along axis 0 (the layer axis)."""

    def __init__(self, weights: dict[str, jax.Array]):
        for name, value in weights.items():
            setattr(self, name, nnx.Param(value))


class Model(nnx.Module):
    """A decoder with its config and its weights' layout. `model.params` is the pure pytree the
    runtime jits over; its "layers" entry is the stacked dict or, after `split_layers()`, a
    list of per-layer dicts (`model.layout` says which, and how each layer is stored).
    layout: the layout the loader built, checked against the weights (None: read from them)."""

    def __init__(self, config: ModelConfig, params: dict, layout: WeightLayout | None = None):
        self.config = config
        found = WeightLayout.of(params["layers"])
        if layout is not None and layout != found:
            raise ValueError(f"the weights are in {found}, not in the stated {layout}")
        self.layout = found
        self.embed = nnx.Param(params["embed"])
        self._set_layers(params["layers"])
        self.final_norm = nnx.Param(params["final_norm"])
        if "lm_head" in params:
            self.lm_head = nnx.Param(params["lm_head"])

    def _set_layers(self, layers):
        if self.layout.split:
            self.layers = nnx.List([DecoderLayers(w) for w in layers])
        else:
            self.layers = DecoderLayers(layers)

    @property
    def params(self) -> dict:
        out = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        if self.layers_split:
            out["layers"] = [out["layers"][i] for i in range(len(out["layers"]))]
        return out

    @property
    def layers_split(self) -> bool:
        return self.layout.split

    def split_layers(self, fuse_qkv: bool = False, k_major: bool = False) -> "Model":
        """Switch to one weight dict per layer, in place (the faster decode layout on GPU).
        Peak memory grows by one stacked tensor at a time, not by the whole model.
        fuse_qkv: one [hidden, (Hq + 2 Hkv) D] projection per layer instead of three (one
        matmul launch; for one device: a fused weight cannot keep per-head shardings).
        k_major: the output projection and the dense MLP's weights stored transposed, [N, K]
        (`K_MAJOR`; for one device), which a decode step of a few rows reads with the K-major
        kernel."""
        if not self.layers_split:
            stacked = {k: v[...] for k, v in vars(self.layers).items()
                       if isinstance(v, nnx.Param)}
            self.layers = None
            self.layout = WeightLayout(split=True, fused_qkv=fuse_qkv, k_major=k_major)
            self._set_layers(split_layers(stacked, fuse_qkv=fuse_qkv, k_major=k_major))
        return self

    @property
    def dtype(self):
        return self.embed[...].dtype

    def __repr__(self):
        c = self.config
        return (f"Model({c.name}: {c.num_layers} layers, hidden {c.hidden_size}, heads "
                f"{c.num_q_heads}/{c.num_kv_heads}x{c.head_dim}, "
                f"{'MoE %d experts top-%d, ' % (c.num_experts, c.num_experts_per_tok) if c.is_moe else ''}"
                f"dtype {self.dtype})")


def param_shapes(cfg: ModelConfig) -> dict:
    """The shape of every parameter: the contract between loaders and the model."""
    L, H, D = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    layers = {
        "attn_norm": (L, H), "mlp_norm": (L, H),
        "wq": (L, H, cfg.num_q_heads * D), "wk": (L, H, cfg.num_kv_heads * D),
        "wv": (L, H, cfg.num_kv_heads * D), "wo": (L, cfg.num_q_heads * D, H),
    }
    if cfg.qk_norm:
        layers.update(q_norm=(L, D), k_norm=(L, D))
    if cfg.is_moe:
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        layers.update(router=(L, H, E), we_gate=(L, E, H, I), we_up=(L, E, H, I),
                      we_down=(L, E, I, H))
    else:
        I = cfg.intermediate_size
        layers.update(w_gate=(L, H, I), w_up=(L, H, I), w_down=(L, I, H))
    shapes = {"embed": (cfg.vocab_size, H), "layers": layers, "final_norm": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (H, cfg.vocab_size)
    return shapes


def fuse_qkv_weights(layer: dict) -> dict:
    """One layer's wq, wk, wv -> one "wqkv" [hidden, (Hq + 2 Hkv) D] (columns q | k | v)."""
    out = {k: v for k, v in layer.items() if k not in QKV}
    out["wqkv"] = jnp.concatenate([layer[n] for n in QKV], axis=-1)
    return out


def unfuse_qkv_weights(layer: dict, cfg: ModelConfig, layout: WeightLayout) -> dict:
    """One split layer's weights in `layout` back in the plain layout: the inverse of
    `fuse_qkv_weights` and of the K-major layout's transposes."""
    if layout.k_major:
        layer = dict(layer)
        for n in k_major_names(cfg):
            layer[n] = layer.pop(n + T_SUFFIX).T
    if not layout.fused_qkv:
        return layer
    out = {k: v for k, v in layer.items() if k != "wqkv"}
    q, kv = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out["wq"], out["wk"], out["wv"] = jnp.split(layer["wqkv"], [q, q + kv], axis=-1)
    return out


def split_layers(stacked: dict, fuse_qkv: bool = False, via_host: bool | None = None,
                 k_major: bool = False) -> list[dict]:
    """Stacked layer weights {name: [L, ...]} -> one dict per layer, freeing each stacked tensor
    once it is split (so peak memory grows by one tensor, not by the model). fuse_qkv,
    k_major: see `Model.split_layers` (the transposes run on the device, a layer at a time).

    via_host (None: when every weight sits whole on one device): each stacked tensor goes to
    host memory and is freed before its layers' parts come back, so they fill the space it
    left. Split on the device instead, each freed tensor leaves a hole between the parts, and a
    large KV cache allocated next may find no contiguous space beside the weights
    (docs/findings.md). It costs one host round trip of the layer weights at load. A mesh's
    sharded weights split on the devices."""
    if via_host is None:
        via_host = all(isinstance(a, jax.Array) and a.is_fully_addressable
                       and len(a.devices()) == 1 for a in stacked.values())
    if via_host:
        return _to_k_major(_split_via_host(stacked, fuse_qkv), k_major)
    names = list(stacked)
    num = stacked[names[0]].shape[0]
    layers = [{} for _ in range(num)]
    for name in names:
        a = stacked.pop(name)
        out = None  # keep a mesh's split of the other axes (jit would otherwise replicate)
        sh = getattr(a, "sharding", None)
        if isinstance(sh, jax.sharding.NamedSharding):
            spec = tuple(sh.spec) + (None,) * (a.ndim - len(sh.spec))
            out = (jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*spec[1:])),) * num
        parts = jax.jit(lambda a: tuple(a[i] for i in range(num)), out_shardings=out)(a)
        _free(a)
        for i in range(num):
            layers[i][name] = parts[i]
    if fuse_qkv:
        fuse = jax.jit(fuse_qkv_weights)
        for i in range(num):
            layers[i] = fuse(layers[i])
    return _to_k_major(layers, k_major)


# one jitted function for every layer: the layers' shapes match, so it compiles once
_transposed = jax.jit(lambda ws: [w.T for w in ws])


def _to_k_major(layers: list[dict], k_major: bool) -> list[dict]:
    """Each layer's `K_MAJOR` weights transposed on the device, one layer at a time, each
    freed once its copy exists."""
    if not k_major:
        return layers
    for layer in layers:
        names = [n for n in K_MAJOR if n in layer]
        old = [layer.pop(n) for n in names]
        for n, w, a in zip(names, _transposed(old), old):
            layer[n + T_SUFFIX] = w
            _free(a)
    return layers


def _free(a):
    """Release a split stacked tensor's device memory now, not when Python drops it."""
    if isinstance(a, jax.Array) and not a.is_deleted():
        a.delete()


def _split_via_host(stacked: dict, fuse_qkv: bool) -> list[dict]:
    """`split_layers` through host memory, one stacked tensor (or the q/k/v trio) at a time."""
    device = next(iter(stacked.values())).devices().pop()
    num = next(iter(stacked.values())).shape[0]
    fuse = fuse_qkv and all(n in stacked for n in QKV)
    groups = [[n] for n in stacked if not (fuse and n in QKV)] + ([list(QKV)] if fuse else [])
    layers = [{} for _ in range(num)]
    for names in groups:
        host = [np.asarray(jax.device_get(stacked[n])) for n in names]
        for n in names:
            _free(stacked.pop(n))
        key = names[0] if len(names) == 1 else "wqkv"
        for i in range(num):
            part = host[0][i] if len(host) == 1 else np.concatenate([h[i] for h in host], -1)
            layers[i][key] = jax.device_put(part, device)
    return layers


def stack_layers(layers, cfg: ModelConfig, layout: WeightLayout) -> dict:
    """The inverse of `split_layers` (a no-op for stacked weights)."""
    if not layout.split:
        return layers
    layers = [unfuse_qkv_weights(w, cfg, layout) for w in layers]
    return {name: jnp.stack([w[name] for w in layers]) for name in layers[0]}


def run_layers(body, carry, layers, layout: WeightLayout, num_layers: int, unroll=1):
    """Apply body(carry, (layer_weights, layer_index)) over the layers: `lax.scan` over stacked
    weights (traced index), a Python loop over split ones (static index).
    Returns (carry, per-layer outputs stacked along a new leading axis, or None)."""
    if layout.split:
        ys = []
        for l, w in enumerate(layers):
            carry, y = body(carry, (w, l))
            ys.append(y)
        if ys[0] is None:
            return carry, None
        return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)
    ids = jnp.arange(num_layers, dtype=jnp.int32)
    return jax.lax.scan(body, carry, (layers, ids), unroll=unroll)


def rope_cos_sin(positions, cfg: ModelConfig):
    """cos, sin [B, T, D/2] float32 (the attention scale applied) for positions [B, T]."""
    inv_freq, mscale = rope_inv_freq_and_scale(cfg)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * mscale, jnp.sin(angles) * mscale


def apply_rope(x, positions, cfg: ModelConfig):
    """Rotary embedding in the Hugging Face (rotate-half) layout. x [B, T, N, D], positions [B, T]."""
    cos, sin = rope_cos_sin(positions, cfg)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _heads_kernel(heads: str, cfg: ModelConfig, layout: WeightLayout, T: int):
    """The kernel that makes one decode step's heads ("kernel": heads_gpu, Triton, for a head
    dim it takes; "mosaic_gpu": heads_mgpu, whose dispatch sends inputs it does not take to
    jnp), or None (jnp): asked for, fused q/k/v weights, one position per row."""
    if T != 1 or not layout.fused_qkv:
        return None
    if heads == "kernel" and heads_kernels.supported(cfg.head_dim):
        return "kernel"
    return "mosaic_gpu" if heads == "mosaic_gpu" else None


def _matmul_tuning(tuning) -> dict:
    """The matmul kernels' sweep points from an `options.KernelTuning` (None: the defaults):
    the K-major config, dependent launches, the Mosaic twin's unpadded rows."""
    if tuning is None:
        return {}
    return dict(kmajor_config=tuning.kmajor, launch_dependents=tuning.launch_dependents,
                zero_fill=tuning.zero_fill)


def _normed_matmuls(x, norm, weights, cfg: ModelConfig, matmul: str, transposed=False,
                    tuning=None):
    """RMSNorm of x by `norm`, then each weight, rounded to x's dtype (the kernel folds the
    norm into the product: `kernels.skinny_matmul`); transposed: the weights are [N, K]."""
    return tuple(y.astype(x.dtype) for y in skinny_matmul(
        x, weights, norm, eps=cfg.rms_norm_eps, impl=matmul, transposed=transposed,
        **_matmul_tuning(tuning)))


def attention_inputs(w: dict, cfg: ModelConfig, x, positions, heads: str = "xla",
                     matmul: str = "xla", layout: WeightLayout = STACKED,
                     epilogue: str = "xla", tuning=None):
    """One layer's q [B,T,Hq,D], k, v [B,T,Hkv,D] (normed and rotated), from the residual x;
    w: the layer's weights, stored as `layout` says.

    heads: "xla" (jnp), or "kernel" / "mosaic_gpu": a decode step (T = 1) with fused q/k/v
    weights norms and rotates its heads in one Triton / Mosaic GPU launch (interpret mode off
    the GPU).
    matmul: the projections' `kernels.skinny_matmul` impl: "xla", "kernel" (the
    weight-streaming kernel for a decode step's few rows, the RMSNorm folded in), "by_shape"
    (the kernel where it was measured faster) or a Mosaic GPU twin's ("mosaic_gpu",
    "mosaic_by_shape"); epilogue "fused" with a Mosaic twin: a decode step's heads' norms
    and rope in its kernel (`skinny_matmul.matmul_heads`); tuning: as in
    `attention_output_and_mlp`."""
    B, T, _ = x.shape
    norm = w["attn_norm"]
    if layout.fused_qkv and epilogue == "fused" and T == 1:
        cos, sin = rope_cos_sin(positions, cfg)
        out = skinny_matmul_kernels.matmul_heads(
            x[:, 0], w["wqkv"], norm, cos[:, 0], sin[:, 0],
            w.get("q_norm") if cfg.qk_norm else None, w.get("k_norm") if cfg.qk_norm else None,
            eps=cfg.rms_norm_eps, num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
            impl=matmul, launch_dependents=tuning and tuning.launch_dependents,
            zero_fill=tuning is not None and tuning.zero_fill)
        if out is not None:
            return tuple(a[:, None] for a in out)
    if layout.fused_qkv:
        qkv, = _normed_matmuls(x, norm, (w["wqkv"],), cfg, matmul, tuning=tuning)
        impl = _heads_kernel(heads, cfg, layout, T)
        if impl is not None:
            cos, sin = rope_cos_sin(positions, cfg)
            q, k, v = heads_kernels.norm_rope_heads(
                qkv[:, 0], cos[:, 0], sin[:, 0], w.get("q_norm") if cfg.qk_norm else None,
                w.get("k_norm") if cfg.qk_norm else None, num_q_heads=cfg.num_q_heads,
                num_kv_heads=cfg.num_kv_heads, eps=cfg.rms_norm_eps, impl=impl,
                zero_fill=tuning is not None and tuning.zero_fill)
            return q[:, None], k[:, None], v[:, None]
        nq, nkv = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = jnp.split(qkv, [nq, nq + nkv], axis=-1)
    else:
        q, = _normed_matmuls(x, norm, (w["wq"],), cfg, matmul, tuning=tuning)
        k, v = _normed_matmuls(x, norm, (w["wk"], w["wv"]), cfg, matmul, tuning=tuning)
    q = q.reshape(B, T, cfg.num_q_heads, cfg.head_dim)
    k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, positions, cfg), apply_rope(k, positions, cfg), v


def attention_output_and_mlp(w: dict, cfg: ModelConfig, x, attn, moe: str = "xla",
                             matmul: str = "xla", tuning=None, layout: WeightLayout = STACKED,
                             epilogue: str = "xla"):
    """Output projection + residual, then the (dense or MoE) MLP + residual. attn [B,T,Hq,D].
    moe: see `moe_mlp`; matmul: see `attention_inputs`; tuning: the GPU kernels' sweep points
    (`options.KernelTuning`; None: the tuned kernels); epilogue: "fused" lets the Mosaic GPU
    matmul apply the residual adds and the SiLU product in its kernel
    (`skinny_matmul.matmul_epilogue`), "xla" leaves them to XLA's fusions."""
    B, T = attn.shape[:2]
    mm = functools.partial(skinny_matmul_kernels.matmul_epilogue, impl=matmul,
                           fuse=epilogue == "fused", **_matmul_tuning(tuning))
    wo, t = layout.weight(w, "wo")
    x = mm(attn.reshape(B, T, -1).astype(x.dtype), (wo,), epilogue="residual", residual=x,
           transposed=t)
    if cfg.is_moe:
        h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
        return x + moe_mlp(w, cfg, h.reshape(B * T, -1), impl=moe).reshape(B, T, -1)
    (wg, t), (wu, _), (wd, td) = (layout.weight(w, n) for n in ("w_gate", "w_up", "w_down"))
    h = mm(x, (wg, wu), w["mlp_norm"], epilogue="silu", eps=cfg.rms_norm_eps, transposed=t)
    return mm(h, (wd,), epilogue="residual", residual=x, transposed=td)


def fused_decode_layer(layout: WeightLayout, cfg: ModelConfig, rows: int, heads: str,
                       matmul: str, epilogue: str) -> bool:
    """Whether a decode step of `rows` rows runs this layer's matmuls with their epilogues in
    the kernel (`decode_attention_inputs` / `decode_output_and_mlp`): asked for, the kernel
    for these rows, fused q/k/v weights and the heads kernel's head dim."""
    return (epilogue == "fused" and skinny_matmul_kernels.uses_fused(matmul, rows)
            and _heads_kernel(heads, cfg, layout, 1) == "kernel")


def decode_attention_inputs(w: dict, cfg: ModelConfig, x, positions, sync, tuning=None):
    """`attention_inputs` for one decode step (x [B, 1, H]) with q/k/v from the matmul's
    epilogue: the split sums, the RMSNorm's row scale, the heads' norms and rope in the
    kernel. sync: the kernels' counters; tuning: as in `attention_output_and_mlp`. Returns q,
    k, v and the counters."""
    B = x.shape[0]
    cos, sin = rope_cos_sin(positions, cfg)
    q, k, v, sync = skinny_matmul_kernels.skinny_matmul_fused(
        x.reshape(B, -1), (w["wqkv"],), w["attn_norm"], sync, epilogue="heads", cos=cos[:, 0],
        sin=sin[:, 0], q_norm=w.get("q_norm") if cfg.qk_norm else None,
        k_norm=w.get("k_norm") if cfg.qk_norm else None, num_q_heads=cfg.num_q_heads,
        num_kv_heads=cfg.num_kv_heads, eps=cfg.rms_norm_eps, tuning=tuning)
    return q[:, None], k[:, None], v[:, None], sync


def decode_output_and_mlp(w: dict, cfg: ModelConfig, x, attn, sync, moe: str = "xla",
                          tuning=None, layout: WeightLayout = STACKED):
    """`attention_output_and_mlp` for one decode step with the residual adds and the SiLU
    product in the matmuls' epilogues. Returns x and the counters."""
    B = x.shape[0]
    fused = functools.partial(skinny_matmul_kernels.skinny_matmul_fused, tuning=tuning)
    wo, t = layout.weight(w, "wo")
    x, sync = fused(attn.reshape(B, -1).astype(x.dtype), (wo,), None, sync,
                    epilogue="residual", residual=x.reshape(B, -1), transposed=t)
    if cfg.is_moe:
        h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
        return (x + moe_mlp(w, cfg, h, impl=moe))[:, None], sync
    (wg, t), (wu, _), (wd, _) = (layout.weight(w, n) for n in ("w_gate", "w_up", "w_down"))
    h, sync = fused(x, (wg, wu), w["mlp_norm"], sync, epilogue="silu", eps=cfg.rms_norm_eps,
                    transposed=t)
    x, sync = fused(h, (wd,), None, sync, epilogue="residual", residual=x, transposed=t)
    return x[:, None], sync


MOE_IMPLS = moe_kernels.IMPLS


def moe_mlp(w: dict, cfg: ModelConfig, x, impl: str = "xla"):
    """Top-k routed experts (softmax router, optionally renormalised top-k weights), the
    expert matmuls by `kernels.moe.routed_experts`: "xla" (`lax.ragged_dot`), "kernel" or
    "tokens" (Triton kernels; interpret mode off the GPU)."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"moe impl must be one of {MOE_IMPLS}, got {impl!r}")
    router_logits = jnp.matmul(x, w["router"], preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(router_logits, axis=-1)
    top_p, top_e = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    return moe_kernels.routed_experts(x, w["we_gate"], w["we_up"], w["we_down"], top_p, top_e,
                                      impl=impl)


def embed_tokens(params: dict, tokens):
    return params["embed"][tokens]


def output_logits(params: dict, cfg: ModelConfig, x):
    """Final norm and LM head (tied to the embedding when the config says so); float32.
    (XLA's gemm streams this one large weight at the bandwidth limit: no kernel choice.)"""
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.matmul(h, head, preferred_element_type=jnp.float32)


def grouped_attention(q, k, v, mask):
    """Plain GQA attention. q [B,T,Hq,D]; k, v [B,S,Hkv,D]; mask bool [B,T,S] -> [B,T,Hq,D]."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None, None], s / np.sqrt(D), -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[:, None, None], p, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, Hq, D).astype(q.dtype)


@jax.jit(static_argnums=(1, 2))
def _forward(params, cfg: ModelConfig, layout: WeightLayout, tokens):
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))

    def layer(x, xs):
        w, _ = xs
        q, k, v = attention_inputs(w, cfg, x, positions, layout=layout)
        attn = grouped_attention(q, k, v, causal)
        return attention_output_and_mlp(w, cfg, x, attn, layout=layout), None

    x, _ = run_layers(layer, embed_tokens(params, tokens), params["layers"], layout,
                      cfg.num_layers)
    return output_logits(params, cfg, x)


def forward(model: Model, tokens) -> jax.Array:
    """Full causal forward: tokens int [B, T] -> float32 logits [B, T, vocab]."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
    if tokens.shape[1] > model.config.max_position_embeddings:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's context "
                         f"{model.config.max_position_embeddings}")
    return _forward(model.params, model.config, model.layout, tokens)
