import dataclasses
import math

import jax
import pytest

from sfi_jax.config import POLICIES, SFIConfig


def test_defaults_follow_the_method():
    cfg = SFIConfig()
    assert (cfg.n_sink, cfg.n_recent, cfg.k_select, cfg.t_max) == (4, 256, 2048, 64)
    assert (cfg.power_alpha, cfg.lam_clip, cfg.alpha_soft, cfg.alpha_cross) == (0.5, 0.02, 0.5, 0.35)
    assert (cfg.cross_temp, cfg.nms_radius, cfg.gamma, cfg.p, cfg.eta) == (2.0, 16, 0.5, 1.8, 0.4)
    assert math.isclose(cfg.beta, 0.5675840, rel_tol=1e-6)
    assert cfg.eps == 1e-8 and cfg.prefill_window == 16
    assert cfg.policy == "sfi" and cfg.refresh_rows is None
    assert cfg.budget == 4 + 2048 + 256 and cfg.compact_size == 4 + 2048
    assert cfg.evidence_window == 1 and cfg.draft_len == 3 and cfg.adaptive_draft


def test_paper_preset_is_the_method_as_specified():
    """SFIConfig.paper(): the defaults with no extension (SFI_METHOD.md's values); the
    defaults differ from it in the three extensions the retrieval suite chose."""
    paper, default = SFIConfig.paper(), SFIConfig()
    assert paper.successor_radius == 0 and paper.evidence_window == 1
    assert paper.warmup_steps == 0 and paper.selection_memory is None and not paper.remembers
    diff = {f.name for f in dataclasses.fields(SFIConfig)
            if getattr(paper, f.name) != getattr(default, f.name)}
    assert diff == {"successor_radius", "warmup_steps", "selection_memory"}
    assert (default.successor_radius, default.warmup_steps, default.warmup_t_max,
            default.selection_memory) == (7, 32, 4, 0.0) and default.remembers
    assert SFIConfig.paper(k_select=8, policy="tmax") == SFIConfig(
        k_select=8, policy="tmax", successor_radius=0, warmup_steps=0, selection_memory=None)
    assert SFIConfig.paper(successor_radius=3).successor_radius == 3
    with pytest.raises(ValueError, match=r"SFIConfig\.successor_radius\b"):
        SFIConfig.paper(successor_radius=-1)


def test_hashable_static_argument():
    a, b = SFIConfig(k_select=8), SFIConfig(k_select=8)
    assert a == b and hash(a) == hash(b) and a != SFIConfig(k_select=9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.k_select = 3
    f = jax.jit(lambda x, cfg: x + cfg.k_select, static_argnames="cfg")
    assert int(f(1, cfg=a)) == 9


def test_good_values_accepted():
    for policy in POLICIES:
        SFIConfig(policy=policy)
    cfg = SFIConfig(n_sink=0, n_recent=0, k_select=1, t_max=1, power_alpha=1.0, lam_clip=0.0,
                    alpha_soft=0.0, alpha_cross=0.0, nms_radius=0, refresh_rows=1, prefill_window=1)
    assert cfg.budget == 1
    assert SFIConfig(lam_clip=1, power_alpha=1).lam_clip == 1.0  # ints accepted for floats


@pytest.mark.parametrize(
    "field, value",
    [
        ("n_sink", -1), ("n_recent", -5), ("k_select", 0), ("k_select", -3), ("t_max", 0),
        ("warmup_steps", -1), ("warmup_t_max", 0), ("warmup_steps", 1.5),
        ("k_select", 2.5), ("n_recent", True), ("n_sink", "4"),
        ("power_alpha", 0.0), ("power_alpha", 1.5), ("power_alpha", -0.5), ("power_alpha", float("nan")),
        ("lam_clip", -0.1), ("lam_clip", 1.01), ("alpha_soft", -1.0), ("alpha_cross", -0.01),
        ("cross_temp", 0.0), ("cross_temp", -2.0), ("nms_radius", -1), ("nms_radius", 1.5),
        ("gamma", -0.5), ("beta", float("inf")), ("p", 0.0), ("eta", -0.1), ("eps", 0.0),
        ("prefill_window", 0), ("policy", "dense"), ("policy", None), ("refresh_rows", 0),
        ("refresh_rows", -2), ("refresh_rows", 1.0), ("selection_memory", -0.5),
        ("selection_memory", float("nan")), ("selection_memory", "1"),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SFIConfig\.{field}\b") as err:
        SFIConfig(**{field: value})
    assert repr(value) in str(err.value)
