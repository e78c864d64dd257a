"""XLA:CPU compile settings of the test suite (conftest.py; tests/runtime/sharded_checks.py,
which starts its own interpreters).

Most of the suite's time is XLA:CPU compiling the tiny models' programs (prefill, the decode
loop, the selector, Pallas kernels in interpret mode), each run for a few milliseconds. XLA:CPU
emits its loop fusions through MLIR fusion emitters by default; with
`--xla_cpu_use_fusion_emitters=false` it emits them through its older elemental IR emitter,
in about half the compile time of the decode loop here. Both sides of every comparison in a
test compile the same way. The setting also changes XLA:CPU's HLO pipeline a little (scatters
are expanded into loops, with more small copies): tests that inspect compiled HLO compile it
with XLA's default (tests/runtime/test_decode_hlo.py, compiler_options).

Applied only where XLA is known to have the flag (an unknown flag in XLA_FLAGS aborts the
process): jaxlib 0.10, the CPU machines' version in DESIGN.md's table (the GPU machine's 0.11
is not checked yet; add it to KNOWN once it is). SFI_JAX_TEST_FUSION_EMITTERS=1 leaves XLA's
default."""

from __future__ import annotations

import os

FLAG = "--xla_cpu_use_fusion_emitters=false"
KNOWN = ((0, 10),)  # jaxlib (major, minor) whose XLA has the flag


def fast_compile_flags(environ=os.environ) -> str:
    """" " + FLAG to append to XLA_FLAGS, or "" (unknown jaxlib, opted out, or already set)."""
    if environ.get("SFI_JAX_TEST_FUSION_EMITTERS") == "1":
        return ""
    if "xla_cpu_use_fusion_emitters" in environ.get("XLA_FLAGS", ""):
        return ""
    try:
        from jaxlib import version  # (does not start a backend)

        major_minor = tuple(int(x) for x in version.__version__.split(".")[:2])
    except Exception:  # pragma: no cover - no jaxlib, or an odd version string
        return ""
    return " " + FLAG if major_minor in KNOWN else ""
