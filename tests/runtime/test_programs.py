"""The one compiled-program cache: keys by shapes, dtypes, shardings and static arguments."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sfi_jax.runtime import programs


@functools.partial(jax.jit, static_argnames=("scale",))
def _scaled(x, *, scale):
    return x * scale


def test_a_sharded_and_an_unsharded_argument_get_their_own_program():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    plain = jnp.ones((4, 8))
    sharded = jax.device_put(plain, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("data")))
    first, s1 = programs.compiled(_scaled, (plain,), dict(scale=2.0))
    again, s2 = programs.compiled(_scaled, (plain,), dict(scale=2.0))
    other, s3 = programs.compiled(_scaled, (sharded,), dict(scale=2.0))
    static, s4 = programs.compiled(_scaled, (plain,), dict(scale=3.0))
    assert again is first and s2 == 0.0
    assert other is not first and static is not first and s1 > 0 and s3 > 0 and s4 > 0
    assert len(programs.held("_scaled")) == 3
    np.testing.assert_array_equal(other(sharded), 2 * np.ones((4, 8)))


def test_a_full_cache_evicts_the_least_recently_used_program(monkeypatch):
    """A program in use survives a full cache: the one not used for longest goes first."""
    monkeypatch.setattr(programs, "_PROGRAMS", {})
    monkeypatch.setattr(programs, "MAX_PROGRAMS", 2)
    x = jnp.ones((3,))
    old, _ = programs.compiled(_scaled, (x,), dict(scale=5.0))
    programs.compiled(_scaled, (x,), dict(scale=6.0))
    again, seconds = programs.compiled(_scaled, (x,), dict(scale=5.0))  # used again
    programs.compiled(_scaled, (x,), dict(scale=7.0))  # evicts scale 6.0, not 5.0
    assert again is old and seconds == 0.0
    assert sorted(s["scale"] for s in programs.held("_scaled").values()) == [5.0, 7.0]
