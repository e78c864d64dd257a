"""sfi_jax: Slow-Fast Inference for long-context decoding in JAX."""

from sfi_jax.config import SFIConfig
from sfi_jax.options import EngineOptions
from sfi_jax.models import Model, ModelConfig, forward, load_model, load_tokenizer
from sfi_jax.runtime import (Engine, GenerateResult, Mode, QueueFull, Request, RequestError,
                             RequestResult, TokenEvent, generate)

__all__ = ["Engine", "EngineOptions", "GenerateResult", "Mode", "Model", "ModelConfig",
           "QueueFull", "Request", "RequestError", "RequestResult", "SFIConfig", "TokenEvent",
           "forward", "generate", "load_model", "load_tokenizer"]
__version__ = "0.1.0"
