"""Old import path of the decode loop, prefill and selection, kept while callers move to
`runtime.decode`, `runtime.prefill` and `runtime.selection`."""

from sfi_jax.runtime.decode import decode_chunk, slow_logits_buffer
from sfi_jax.runtime.prefill import prefill_chunk, prefill_chunk_size
from sfi_jax.runtime.selection import prefill_selection, sink_only_selection
from sfi_jax.runtime.slots import unique_slots

__all__ = ["decode_chunk", "prefill_chunk", "prefill_chunk_size", "prefill_selection",
           "sink_only_selection", "slow_logits_buffer", "unique_slots"]
