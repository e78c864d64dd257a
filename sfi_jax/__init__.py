"""sfi_jax: Slow-Fast Inference for long-context decoding in JAX."""
