"""The one module that imports Pallas' Triton lowering (it warns of its deprecation on jax 0.11;
the GPU kernels use it explicitly, see DESIGN.md), and the constants the GPU kernels share."""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as plgpu_triton

M_INIT = -1e30  # a finite running-max start: exp(m_old - m_new) is never NaN
NUM_SMS = 132  # streaming multiprocessors of the H100/H200 the grid sizes aim at

__all__ = ["M_INIT", "NUM_SMS", "plgpu_triton"]
