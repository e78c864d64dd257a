"""SFI parameters (SFI_METHOD.md), validated once so the jitted code can trust them."""

from __future__ import annotations

import dataclasses
import math
import numbers

POLICIES = ("sfi", "tmax", "streaming", "prefill_only", "oracle")
"""Refresh policies.

- "sfi": slow step on the first decode step, after a trigger token, and every t_max steps.
- "tmax": slow step on the first decode step and every t_max steps; no trigger tokens.
- "streaming": sink + recent window only; never selects.
- "prefill_only": select once from the prefill window, never refresh (SnapKV-like).
- "oracle": every step selects from a fresh dense pass and computes its token sparsely.
"""


def _int_field(cfg, name, lo):
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"SFIConfig.{name} must be an integer, got {value!r}")
    if value < lo:
        raise ValueError(f"SFIConfig.{name} must be >= {lo}, got {value!r}")
    object.__setattr__(cfg, name, int(value))


def _float_field(cfg, name, lo=None, hi=None, lo_open=False, hi_open=False):
    raw = getattr(cfg, name)
    if isinstance(raw, bool) or not isinstance(raw, numbers.Real):
        raise ValueError(f"SFIConfig.{name} must be a real number, got {raw!r}")
    value = float(raw)
    lo_txt = "-inf" if lo is None else f"{lo:g}"
    hi_txt = "inf" if hi is None else f"{hi:g}"
    allowed = f"{'(' if lo_open or lo is None else '['}{lo_txt}, {hi_txt}{')' if hi_open or hi is None else ']'}"
    bad = not math.isfinite(value)
    if lo is not None:
        bad |= value <= lo if lo_open else value < lo
    if hi is not None:
        bad |= value >= hi if hi_open else value > hi
    if bad:
        raise ValueError(f"SFIConfig.{name} must be a finite number in {allowed}, got {raw!r}")
    object.__setattr__(cfg, name, value)


PAPER = {"successor_radius": 0, "evidence_window": 1, "warmup_steps": 0,
         "selection_memory": None}
"""The fields whose default differs from the method paper's value, at the paper's value."""


@dataclasses.dataclass(frozen=True)
class SFIConfig:
    """Every SFI knob with its default from SFI_METHOD.md: the paper's values, except three
    extensions on by default because the paper's selector loses retrieval (SFI_METHOD.md §8):
    successor_radius, the warm-up (warmup_steps) and the selection memory. `SFIConfig.paper()`
    is the method exactly as specified.

    Frozen and hashable because it is passed to jit as a static argument.
    A budget larger than a row's context is allowed: that row is simply dense.
    """

    n_sink: int = 4
    n_recent: int = 256
    k_select: int = 2048
    t_max: int = 64
    power_alpha: float = 0.5
    lam_clip: float = 0.02
    alpha_soft: float = 0.5
    alpha_cross: float = 0.35
    cross_temp: float = 2.0
    nms_radius: int = 16
    gamma: float = 0.5
    beta: float = -math.log(0.6) / 0.9
    p: float = 1.8
    eta: float = 0.4
    eps: float = 1e-8
    prefill_window: int = 16
    policy: str = "sfi"
    refresh_rows: int | None = None
    # Decode queries whose logits feed a slow step's selector, per layer: 1 = the step's own
    # query (SFI_METHOD.md: W = 1 in decode). W > 1 (an extension, single device only) keeps
    # each layer's last W queries and selects from all of them, as prefill does with 16.
    evidence_window: int = 1
    # An extension (on by default; the paper has none: 0): after the scores of §4, each position
    # also lends its score (minus 1e-3 per step) to its next `successor_radius` positions, so a
    # selected position's successors are kept too — what copying text (a pass key, a quoted
    # name) reads next. The default is the retrieval suite's choice (SFI_METHOD.md §8).
    successor_radius: int = 7
    # An extension (on by default; the paper has none: 0): a row's first `warmup_steps` decode
    # steps refresh every `warmup_t_max` steps instead of every t_max, so the selection
    # follows an answer as it is written (the hops of a chain of assignments). Alone it loses
    # values of a multi-value needle; with the selection memory it keeps them (§8).
    warmup_steps: int = 32
    warmup_t_max: int = 4
    # An extension (on by default; the paper has none: None): a refresh remembers what the
    # last selection saw. Each held position keeps the score it was selected with, less
    # `selection_memory` (nats) per refresh since; a refresh ranks J by the larger of that and
    # its own score, so positions an earlier query wanted (a multi-value needle's values) stay
    # unless the new query's evidence outbids them. The default, 0, never decays.
    selection_memory: float | None = 0.0
    # Exact mode (generate(..., mode="exact")): fast steps drafted per row before one dense
    # verify step of draft_len + 1 queries (at most 15: the verify kernel takes 16 queries).
    # With adaptive_draft the batch drafts 0..draft_len tokens per round, the length that the
    # rows' running acceptance and the bytes model of a fast step against a verify say is
    # fastest (0: a plain dense step), so drafts that miss cost next to nothing.
    draft_len: int = 3
    adaptive_draft: bool = True

    def __post_init__(self):
        _int_field(self, "n_sink", 0)
        _int_field(self, "n_recent", 0)
        _int_field(self, "k_select", 1)
        _int_field(self, "t_max", 1)
        _int_field(self, "nms_radius", 0)
        _int_field(self, "prefill_window", 1)
        _int_field(self, "evidence_window", 1)
        _int_field(self, "successor_radius", 0)
        _int_field(self, "warmup_steps", 0)
        _int_field(self, "warmup_t_max", 1)
        _int_field(self, "draft_len", 1)
        if not isinstance(self.adaptive_draft, bool):
            raise ValueError(f"SFIConfig.adaptive_draft must be True or False, got "
                             f"{self.adaptive_draft!r}")
        if self.draft_len > 15:
            raise ValueError(f"SFIConfig.draft_len must be in [1, 15] (the verify step takes "
                             f"draft_len + 1 <= 16 queries), got {self.draft_len}")
        _float_field(self, "power_alpha", 0.0, 1.0, lo_open=True)
        _float_field(self, "lam_clip", 0.0, 1.0)
        _float_field(self, "alpha_soft", 0.0)
        _float_field(self, "alpha_cross", 0.0)
        _float_field(self, "cross_temp", 0.0, lo_open=True)
        _float_field(self, "gamma", 0.0)
        _float_field(self, "beta", 0.0)
        _float_field(self, "p", 0.0, lo_open=True)
        _float_field(self, "eta", 0.0)
        _float_field(self, "eps", 0.0, 1.0, lo_open=True, hi_open=True)
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ValueError(f"SFIConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.refresh_rows is not None:
            _int_field(self, "refresh_rows", 1)
        if self.selection_memory is not None:
            _float_field(self, "selection_memory", 0.0)

    @classmethod
    def paper(cls, **overrides) -> "SFIConfig":
        """The method as the paper specifies it (no extension), with `overrides` on top."""
        return cls(**{**PAPER, **overrides})

    @property
    def refreshes(self) -> bool:
        """Rows refresh their selection during decode ("sfi", "tmax"): the refreshed rows'
        logits are kept for one step and selected from at the next step's start."""
        return self.policy in ("sfi", "tmax")

    @property
    def remembers(self) -> bool:
        """Refreshes weigh the held positions' remembered scores (selection_memory is set and
        the policy refreshes)."""
        return self.selection_memory is not None and self.refreshes

    @property
    def uses_triggers(self) -> bool:
        """A trigger token asks for a slow step ("sfi")."""
        return self.policy == "sfi"

    @property
    def selects_every_step(self) -> bool:
        """Every step selects from a fresh dense pass, per layer ("oracle")."""
        return self.policy == "oracle"

    @property
    def sink_only(self) -> bool:
        """The compact buffers hold the sink alone and never change ("streaming")."""
        return self.policy == "streaming"

    @property
    def selects_at_prefill(self) -> bool:
        """The prefill window makes the initial selection (every policy but "streaming")."""
        return not self.sink_only

    @property
    def fixed_selection(self) -> bool:
        """The selection made at prefill is kept for the whole decode ("streaming",
        "prefill_only")."""
        return self.policy in ("streaming", "prefill_only")

    @property
    def budget(self) -> int:
        """KV positions a fast step reads per head (besides the current token)."""
        return self.n_sink + self.k_select + self.n_recent

    @property
    def compact_size(self) -> int:
        """Static length of the compact sink + selected buffer."""
        return self.n_sink + self.k_select

    def capped(self, max_len: int) -> "SFIConfig":
        """This config with k_select at most max_len: a cache of max_len positions never holds
        more candidates, so the selections are the same and the state is no larger than the
        context needs."""
        if self.k_select <= max_len:
            return self
        return dataclasses.replace(self, k_select=max_len)
