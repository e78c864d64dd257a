"""Ahead-of-time compiled programs, cached by the shapes, dtypes and shardings of their
arguments and by their static arguments, so that compile time is measured apart from run time
and a test can see that a call compiled nothing new."""

from __future__ import annotations

import time

import jax

_PROGRAMS: dict = {}
MAX_PROGRAMS = 64


def _key(fn, args, statics):
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "sharding", None)), args)
    return (fn.__qualname__, jax.tree.structure(args), tuple(jax.tree.leaves(shapes)),
            tuple(sorted(statics.items())))


def compiled(fn, args, statics) -> tuple:
    """(the compiled program of jitted `fn` for `args`, seconds spent compiling it now: 0.0
    when it was cached)."""
    key = _key(fn, args, statics)
    program = _PROGRAMS.pop(key, None)
    if program is not None:
        _PROGRAMS[key] = program  # most recently used last: eviction takes the least recent
        return program, 0.0
    t = time.perf_counter()
    program = fn.lower(*args, **statics).compile()
    seconds = time.perf_counter() - t
    if len(_PROGRAMS) >= MAX_PROGRAMS:
        _PROGRAMS.pop(next(iter(_PROGRAMS)))
    _PROGRAMS[key] = program
    return program, seconds


def held(name: str) -> dict:
    """The programs of function `name` held now: {cache key: its static arguments}."""
    return {key: dict(key[3]) for key in _PROGRAMS if key[0] == name}


def programs() -> list[tuple[str, dict]]:
    """The programs held now: (function name, its static arguments) each."""
    return [(key[0], dict(key[3])) for key in _PROGRAMS]
