"""Decoder models, configs and checkpoint loaders."""

from sfi_jax.models.config import PRESETS, ModelConfig
from sfi_jax.models.loading import load_model, load_tokenizer, restore_orbax, save_orbax
from sfi_jax.models.modeling import Model, forward

__all__ = ["PRESETS", "Model", "ModelConfig", "forward", "load_model", "load_tokenizer",
           "restore_orbax", "save_orbax"]
