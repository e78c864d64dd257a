"""Model configuration: one dataclass for Qwen3 dense, Qwen3-MoE and Llama-family decoders."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and hyper-parameters of a decoder (hashable: a static jit argument)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None  # sorted (key, value) pairs of the HF rope scaling dict
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = True  # Qwen3: per-head RMSNorm on q and k; Llama: none
    num_experts: int = 0  # 0 = dense MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "custom"

    def __post_init__(self):
        for field in ("num_layers", "hidden_size", "num_q_heads", "num_kv_heads", "head_dim",
                      "vocab_size", "max_position_embeddings"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads ({self.num_q_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], "
                             f"got {self.num_experts_per_tok}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def param_count(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_q_heads + 2 * self.num_kv_heads)
        if self.is_moe:
            mlp = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
        else:
            mlp = 3 * h * self.intermediate_size
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + emb

    def kv_cache_bytes(self, batch: int, max_len: int, dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * batch * self.num_kv_heads * max_len * self.head_dim * dtype_bytes

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "custom") -> "ModelConfig":
        """Build from a Hugging Face config.json dict (Qwen3, Qwen3-MoE, Llama, Mistral-like)."""
        model_type = hf.get("model_type", "")
        supported = ("qwen3", "qwen3_moe", "llama", "mistral")
        if model_type not in supported:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {supported}")
        if hf.get("attention_bias", False):
            raise ValueError("attention_bias=True checkpoints are not supported")
        if model_type == "qwen3_moe":
            if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
                raise ValueError("Qwen3-MoE with mlp_only_layers or decoder_sparse_step != 1 is "
                                 "not supported")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if rtype == "default" else tuple(sorted(
            (k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
        eos = hf.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size", 0), num_q_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads), head_dim=head_dim,
            vocab_size=hf["vocab_size"], max_position_embeddings=hf["max_position_embeddings"],
            rope_theta=float(theta), rope_scaling=scaling, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qk_norm=model_type.startswith("qwen3"),
            # transformers 5 writes the expert count as num_local_experts
            num_experts=(hf.get("num_experts") or hf.get("num_local_experts") or 0)
            if model_type == "qwen3_moe" else 0,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0) if model_type == "qwen3_moe" else 0,
            moe_intermediate_size=hf.get("moe_intermediate_size", 0),
            norm_topk_prob=hf.get("norm_topk_prob", model_type != "qwen3_moe"),  # HF default
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos, name=name)


_QWEN3_COMMON = dict(vocab_size=151936, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                     qk_norm=True, bos_token_id=151643, eos_token_ids=(151645, 151643),
                     # YaRN x4 over the native 32K window: the documented long-context setup.
                     max_position_embeddings=131072,
                     rope_scaling=(("factor", 4.0), ("original_max_position_embeddings", 32768),
                                   ("rope_type", "yarn")))

PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", num_layers=30, hidden_size=576, intermediate_size=1536,
        num_q_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, qk_norm=False, bos_token_id=1, eos_token_ids=(2,)),
    "qwen3-0.6b": ModelConfig(name="qwen3-0.6b", num_layers=28, hidden_size=1024,
                              intermediate_size=3072, num_q_heads=16, num_kv_heads=8,
                              tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-1.7b": ModelConfig(name="qwen3-1.7b", num_layers=28, hidden_size=2048,
                              intermediate_size=6144, num_q_heads=16, num_kv_heads=8,
                              tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-4b": ModelConfig(name="qwen3-4b", num_layers=36, hidden_size=2560,
                            intermediate_size=9728, num_q_heads=32, num_kv_heads=8,
                            tie_word_embeddings=True, **_QWEN3_COMMON),
    "qwen3-8b": ModelConfig(name="qwen3-8b", num_layers=36, hidden_size=4096,
                            intermediate_size=12288, num_q_heads=32, num_kv_heads=8,
                            **_QWEN3_COMMON),
    "qwen3-14b": ModelConfig(name="qwen3-14b", num_layers=40, hidden_size=5120,
                             intermediate_size=17408, num_q_heads=40, num_kv_heads=8,
                             **_QWEN3_COMMON),
    "qwen3-32b": ModelConfig(name="qwen3-32b", num_layers=64, hidden_size=5120,
                             intermediate_size=25600, num_q_heads=64, num_kv_heads=8,
                             **_QWEN3_COMMON),
    "qwen3-30b-a3b": ModelConfig(name="qwen3-30b-a3b", num_layers=48, hidden_size=2048,
                                 intermediate_size=6144, num_q_heads=32, num_kv_heads=4,
                                 num_experts=128, num_experts_per_tok=8,
                                 moe_intermediate_size=768, **_QWEN3_COMMON),
    "qwen3-235b-a22b": ModelConfig(name="qwen3-235b-a22b", num_layers=94, hidden_size=4096,
                                   intermediate_size=12288, num_q_heads=64, num_kv_heads=4,
                                   num_experts=128, num_experts_per_tok=8,
                                   moe_intermediate_size=1536, **_QWEN3_COMMON),
}


def rope_inv_freq_and_scale(cfg: ModelConfig):
    """Inverse frequencies [head_dim/2] and the attention (cos/sin) scale for the rope type."""
    import numpy as np

    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    sc = cfg.rope_scaling_dict
    if not sc:
        return inv_freq, 1.0
    rtype = sc.get("rope_type", sc.get("type"))
    factor = float(sc.get("factor", 1.0))
    if rtype == "linear":
        return inv_freq / factor, 1.0
    if rtype == "llama3":
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_len = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return np.where(is_mid, mid, scaled), 1.0
    if rtype == "yarn":
        old_len = sc.get("original_max_position_embeddings") or cfg.max_position_embeddings
        beta_fast, beta_slow = float(sc.get("beta_fast", 32)), float(sc.get("beta_slow", 1))
        mscale = sc.get("attention_factor")
        if mscale is None:
            mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

        def dim_for(rot):
            return d * math.log(old_len / (rot * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        lo, hi = dim_for(beta_fast), dim_for(beta_slow)
        if sc.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        extrapolation = 1 - ramp
        inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        return inv, float(mscale)
    raise ValueError(f"unsupported rope scaling type {rtype!r}; supported: linear, llama3, yarn")
