"""The SFI flags that `python -m sfi_jax.generate` and `python -m sfi_jax.serve` share, and
the SFIConfig they make (its own checks name a bad value)."""

from __future__ import annotations

import argparse

from sfi_jax.config import PAPER, POLICIES, SFIConfig

# flag dest -> SFIConfig field (the same name)
FIELDS = ("n_sink", "n_recent", "k_select", "t_max", "policy", "draft_len", "successor_radius",
          "evidence_window", "warmup_steps", "selection_memory", "refresh_rows")


OFF = "off"


def _memory(text: str) -> float | str:
    """--selection-memory's value: nats per refresh, or OFF."""
    if text.strip().lower() in ("off", "none"):
        return OFF
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of nats or 'off', got {text!r}")


def add_sfi_flags(p: argparse.ArgumentParser):
    """The SFI flags. The extensions' flags default to None (SFIConfig's default, or the
    paper's value under --paper); an explicit value wins either way."""
    d = SFIConfig()
    g = p.add_argument_group("SFI (the paper's values but three extensions on by default: "
                             "--successor-radius, --warmup-steps, --selection-memory; "
                             "docs/SFI_METHOD.md §8)")
    g.add_argument("--paper", action="store_true",
                   help="the method exactly as the paper specifies it: every extension off "
                        "unless its own flag is given")
    g.add_argument("--n-sink", type=int, default=d.n_sink, help="sink tokens per head")
    g.add_argument("--n-recent", type=int, default=d.n_recent, help="recent-window tokens")
    g.add_argument("--k-select", type=int, default=d.k_select,
                   help="selected tokens per KV head")
    g.add_argument("--t-max", type=int, default=d.t_max, help="max steps between slow steps")
    g.add_argument("--policy", choices=POLICIES, default=d.policy,
                   help="refresh policy (sfi; or a baseline: tmax, streaming, prefill_only, oracle)")
    g.add_argument("--draft-len", type=int, default=d.draft_len,
                   help="exact mode: fast steps drafted per dense verify step (1..15)")
    g.add_argument("--successor-radius", type=int, default=None,
                   help="extension: also keep the next N positions after strong ones (keeps "
                        f"retrieval, e.g. pass keys; default {d.successor_radius}; 0 = off)")
    g.add_argument("--evidence-window", type=int, default=None,
                   help="extension: select from each layer's last W decode queries (default "
                        f"{d.evidence_window}: as specified)")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="extension: a row's first N decode steps refresh every "
                        f"{d.warmup_t_max} steps (default {d.warmup_steps}; 0 = off)")
    g.add_argument("--selection-memory", type=_memory, default=None, metavar="NATS|off",
                   help="extension: refreshes keep what the selection in force was chosen for "
                        "unless new evidence outbids it, held scores decaying by this many "
                        f"nats per refresh (default {d.selection_memory:g}; off = none)")
    g.add_argument("--refresh-rows", type=int, default=d.refresh_rows,
                   help="rows refreshed per step at most (default: the whole batch)")


def sfi_from_flags(args) -> SFIConfig:
    """SFIConfig of the parsed flags; a bad value raises SFIConfig's ValueError."""
    fields = dict(PAPER) if args.paper else {}
    for f in FIELDS:
        value = getattr(args, f)
        if f in PAPER and value is None:  # not given: the default (or the paper's value)
            continue
        fields[f] = None if value == OFF else value
    return SFIConfig(**fields)
