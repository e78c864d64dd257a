"""KV cache, SFI state, prefill, the jitted decode loop and sampling."""

from sfi_jax.runtime.generation import GenerateResult, generate
from sfi_jax.runtime.sampling import SamplingConfig

__all__ = ["GenerateResult", "SamplingConfig", "generate"]
