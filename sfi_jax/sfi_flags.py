"""The SFI flags that `python -m sfi_jax.generate` and `python -m sfi_jax.serve` share, and
the SFIConfig they make (its own checks name a bad value)."""

from __future__ import annotations

import argparse

from sfi_jax.config import POLICIES, SFIConfig

# flag dest -> SFIConfig field (the same name)
FIELDS = ("n_sink", "n_recent", "k_select", "t_max", "policy", "draft_len", "successor_radius",
          "evidence_window", "warmup_steps", "selection_memory", "refresh_rows")


def add_sfi_flags(p: argparse.ArgumentParser):
    d = SFIConfig()
    g = p.add_argument_group("SFI (the paper's defaults but --successor-radius, "
                             "docs/SFI_METHOD.md §8)")
    g.add_argument("--n-sink", type=int, default=d.n_sink, help="sink tokens per head")
    g.add_argument("--n-recent", type=int, default=d.n_recent, help="recent-window tokens")
    g.add_argument("--k-select", type=int, default=d.k_select,
                   help="selected tokens per KV head")
    g.add_argument("--t-max", type=int, default=d.t_max, help="max steps between slow steps")
    g.add_argument("--policy", choices=POLICIES, default=d.policy,
                   help="refresh policy (sfi; or a baseline: tmax, streaming, prefill_only, oracle)")
    g.add_argument("--draft-len", type=int, default=d.draft_len,
                   help="exact mode: fast steps drafted per dense verify step (1..15)")
    g.add_argument("--successor-radius", type=int, default=d.successor_radius,
                   help="extension: also keep the next N positions after strong ones (keeps "
                        "retrieval, e.g. pass keys; 0 = the method as the paper specifies it)")
    g.add_argument("--evidence-window", type=int, default=d.evidence_window,
                   help="extension: select from each layer's last W decode queries (1 = as "
                        "specified)")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help="extension: a row's first N decode steps refresh every "
                        f"{d.warmup_t_max} steps (0 = off)")
    g.add_argument("--selection-memory", type=float, default=d.selection_memory,
                   help="extension: refreshes keep what the selection in force was chosen for "
                        "unless new evidence outbids it, held scores decaying by this many "
                        "nats per refresh (default: off)")
    g.add_argument("--refresh-rows", type=int, default=d.refresh_rows,
                   help="rows refreshed per step at most (default: the whole batch)")


def sfi_from_flags(args) -> SFIConfig:
    """SFIConfig of the parsed flags; a bad value raises SFIConfig's ValueError."""
    return SFIConfig(**{f: getattr(args, f) for f in FIELDS})
