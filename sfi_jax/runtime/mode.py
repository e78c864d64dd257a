"""The decoding mode, one type from the API (`generate`, `Engine`, the CLIs) to the loop.

A `Mode` is a str enum, so "sfi", "dense" and "exact" are accepted wherever a Mode is, and a
Mode compares, hashes and prints as its value (stats["mode"] == "sfi", JSON writes "sfi").
`Mode.parse` is the one check, at the API's edge; past it the code holds a Mode.
"""

from __future__ import annotations

import enum

from sfi_jax.config import SFIConfig


class Mode(enum.StrEnum):
    SFI = "sfi"      # slow steps select, fast steps attend to the selection
    DENSE = "dense"  # every step attends to the whole cache
    EXACT = "exact"  # SFI fast steps draft, one dense step verifies (dense decoding's tokens)

    @classmethod
    def parse(cls, value) -> Mode:
        """`value` as a Mode; ValueError naming it when it is none."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except (ValueError, TypeError):
            raise ValueError(f"mode must be one of {[m.value for m in cls]}, "
                             f"got {value!r}") from None

    @classmethod
    def from_flag(cls, text: str):
        """argparse's `type` for --mode (with choices=list(Mode)): a Mode, or the text
        unchanged, for argparse's "invalid choice" error."""
        return cls(text) if text in cls._value2member_map_ else text

    def sfi_config(self, sfi) -> SFIConfig | None:
        """The SFIConfig this mode decodes with: `sfi` (default SFIConfig()) for sfi and
        exact, None for dense (the loop's dense programs take no SFIConfig)."""
        if self is Mode.DENSE:
            return None
        sfi = SFIConfig() if sfi is None else sfi
        if not isinstance(sfi, SFIConfig):
            raise ValueError(f"sfi must be an SFIConfig, got {type(sfi).__name__}")
        return sfi
