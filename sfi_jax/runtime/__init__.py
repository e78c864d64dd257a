"""The host side and the jitted programs of decoding: KV cache and SFI state (state), dense
chunked prefill (prefill), the compact buffers' selections (selection), the decode loop
(decode), quality diagnostics (diagnostics), running on a mesh (mesh), sampling (sampling),
the one host-side decode loop over slots (decoder), the Engine (engine, requests) and
`generate` (generation), both clients of that loop."""

from sfi_jax.runtime.engine import (Engine, QueueFull, Request, RequestError, RequestHandle,
                                   RequestResult, TokenEvent)
from sfi_jax.runtime.generation import GenerateResult, generate
from sfi_jax.runtime.mode import Mode
from sfi_jax.runtime.sampling import SamplingConfig

__all__ = ["Engine", "GenerateResult", "Mode", "QueueFull", "Request", "RequestError",
           "RequestHandle", "RequestResult", "SamplingConfig", "TokenEvent", "generate"]
