"""Trigger-token sets and the vectorised SFI selector (SFI_METHOD.md §3-4)."""

from sfi_jax.selector.select import (
    allowed_mask,
    cross_head,
    evidence,
    fusion_lambda,
    prior,
    select,
    selector_scores,
    soft_nms,
    topk_positions,
    window_max,
)
from sfi_jax.selector.triggers import (
    SENTENCE_ENDS,
    is_trigger,
    is_trigger_text,
    trigger_mask,
    trigger_token_ids,
)

__all__ = [
    "SENTENCE_ENDS",
    "allowed_mask",
    "cross_head",
    "evidence",
    "fusion_lambda",
    "is_trigger",
    "is_trigger_text",
    "prior",
    "select",
    "selector_scores",
    "soft_nms",
    "topk_positions",
    "trigger_mask",
    "trigger_token_ids",
    "window_max",
]
