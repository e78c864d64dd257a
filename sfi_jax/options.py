"""How the engine runs: which implementation each operation uses, and the decode loop's variants.

`EngineOptions` is static configuration: jitted programs take it (resolved) as a static argument,
so every choice is part of jit's cache key and of the decode loop's ahead-of-time cache. Every
"auto" is made concrete for the platform in one place, `EngineOptions.resolved`. Options change
how a result is computed, never what it is: every combination gives the same tokens (up to
float rounding).
"""

from __future__ import annotations

import dataclasses
import numbers

from sfi_jax.kernels import common, skinny_matmul
from sfi_jax.kernels.common import platform


def on_gpu() -> bool:
    return platform() == "gpu"


ATTENTION = ("auto", "xla", "pallas_gpu", "mosaic_gpu", "pallas_tpu")
PREFILL_ATTENTION = ("auto", "xla", "cudnn", "pallas_gpu", "mosaic_gpu", "pallas_tpu")
SELECTOR_SCORES = ("auto", "xla", "pallas_gpu", "mosaic_gpu")
SELECTOR_TOPK = ("auto", "lax", "threshold", "radix", "radix_kernel", "radix_mosaic_gpu")
SELECTOR_ADJUST = ("xla", "kernel")
MOE = ("auto", "tokens", "kernel", "xla", "mosaic_gpu")
HEADS = ("auto", "kernel", "mosaic_gpu", "xla")
REPACK = ("auto", "kernel", "mosaic_gpu", "xla")
REFRESH = ("auto", "unconditional", "cond")
MATMUL = ("auto", "by_shape", "kernel", "mosaic_gpu", "mosaic_by_shape", "xla")
EPILOGUE = ("auto", "fused", "xla")

CHOICES = {"attention": ATTENTION, "prefill_attention": PREFILL_ATTENTION,
           "selector_scores": SELECTOR_SCORES,
           "selector_topk": SELECTOR_TOPK, "selector_adjust": SELECTOR_ADJUST, "moe": MOE,
           "heads": HEADS, "repack": REPACK, "refresh": REFRESH, "matmul": MATMUL,
           "epilogue": EPILOGUE}


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Sweep points of the GPU kernels, for benchmarks' A/B runs (frozen: part of a program's
    key). None everywhere: each kernel's tuned default. Changes how fast a result comes, never
    what it is.

    dense_attention: an `attention_gpu.Config` for the dense reads without logits (the dense
        arm), in place of its DENSE.
    sparse_attention: an `attention_gpu.Config` for every sparse read, in place of SPARSE and
        SPARSE_SMALL, or an `attention_mgpu.Config` for the Mosaic GPU twin's, in place of its
        SPARSE.
    fused_programs_per_sm: the fused matmul epilogues' grid aim in programs per SM, in place
        of the tuned configs'.
    kmajor: a `skinny_matmul_gpu.KMajorConfig` for every K-major matmul.
    launch_dependents: programmatic dependent launch (None: on a Hopper or newer GPU): the
        Triton decode kernels signal `griddepcontrol.launch_dependents`, and the Mosaic GPU
        matmul fetches its first weight blocks before its `griddepcontrol.wait`.
    zero_fill: the Mosaic GPU kernels read their few rows (the decode attention's query
        groups, the matmul twin's rows) unpadded, TMA filling the rows past an array's end
        with zeros, instead of after an XLA pad to the tile (64 and 8 rows): fewer launches a
        step. Off: correct on the H100 but no faster there (docs/findings.md).
    kernel_stores: the Mosaic GPU sparse read stores the step's key and value itself (jax 0.11
        on: its caches as `jax.new_ref`s, written in place), not by two XLA scatters before
        it: two launches a layer fewer. Off: correct compiled (benchmarks/gpu_tests.md run 31),
        not yet timed against the scatters on one machine (docs/findings.md).
    """

    dense_attention: object = None
    sparse_attention: object = None
    fused_programs_per_sm: int | None = None
    kmajor: object = None
    launch_dependents: bool | None = None
    zero_fill: bool = False
    kernel_stores: bool = False


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Implementation choices (README: Engine options). Frozen and hashable: a static argument.

    attention: decode attention kernels: "xla" (jnp), "pallas_gpu" (Triton), "mosaic_gpu"
        (Mosaic GPU, for half-precision caches with head dim 64/128/256; other inputs take the
        Triton kernels), "pallas_tpu" (Mosaic TPU); a Pallas kernel off its platform runs in
        interpret mode.
    prefill_attention: prefill attention (`kernels.prefill_attention`): "cudnn" (cuDNN's fused
        attention; half precision and head dim <= 128, other inputs and other platforms take
        "pallas_gpu"),
        "pallas_gpu" (Triton), "mosaic_gpu" (Mosaic GPU, Hopper; half-precision caches, head
        dim 64/128/256, a GQA group dividing 64; other inputs take "cudnn", then
        "pallas_gpu"), "pallas_tpu" (Mosaic), "xla" (blockwise jnp).
    selector_scores: the selector's steps 1-4: "xla", "pallas_gpu" (Triton) or "mosaic_gpu"
        (its Mosaic GPU twin, Hopper: S a multiple of 128, else "xla").
    selector_topk: "lax" (lax.top_k), "threshold" (sampled threshold, candidates ranked by
        lax.top_k), "radix" (radix searches in place of the sorts), "radix_kernel" (each radix
        search one Triton kernel), "radix_mosaic_gpu" (one Mosaic GPU kernel, Hopper).
    selector_adjust: the selector's steps 5-6: "xla" (jnp) or "kernel" (one Triton pass).
    moe: expert matmuls: "tokens" (Triton, per-expert tiles of all of a step's tokens),
        "kernel" (Triton, grouped over expert-sorted rows), "xla" (`lax.ragged_dot`) or
        "mosaic_gpu" (the Mosaic GPU twin of "tokens": one program per touched expert).
    heads: a decode step's q/k norm + rope: "kernel" (one Triton launch), "mosaic_gpu" (one
        Mosaic GPU launch, Hopper: up to 64 half-precision rows, head dim a multiple of 64)
        or "xla".
    repack: the compact-buffer repack: "kernel" (copies only the refreshed rows), "mosaic_gpu"
        (the same gather on Mosaic GPU, one TMA copy per position, then XLA's scatter) or
        "xla".
    refresh: the refresh slots' dense read: "unconditional" (every step that may refresh rows;
        the GPU kernel skips empty slots; steps in which no row wants a refresh run without it,
        in the decode loop's fast loop) or "cond" (behind a `lax.cond`).
    matmul: a decode step's weight matmuls (`kernels.skinny_matmul`): "kernel" (Triton,
        streams each weight once for up to 64 rows, the RMSNorm folded in), "by_shape" (the
        kernel where it beat XLA's gemm: up to 4 rows), "mosaic_gpu" (its Mosaic GPU twin,
        Hopper: up to 64 rows of half-precision weights, the RMSNorm by XLA; its epilogues in
        its kernel with epilogue="fused"), "mosaic_by_shape" (the twin up to 4 rows, XLA's
        gemm beyond) or "xla". K-major weights (`load_model(k_major=True)`) take the K-major
        kernel for up to 4 rows, XLA beyond.
    epilogue: what follows the kernel's matmuls in a decode step of up to 4 rows: "fused" (each
        column block's last program adds up the K splits and applies the next operation: the
        heads' norm + rope, the residual add, the SiLU product; one launch per matmul; the
        Mosaic twin, for as many rows as it takes: the same three, through a semaphore per
        column block) or "xla" (XLA's fusions after each kernel).
    layer_unroll: layers unrolled per decode-scan iteration over stacked weights: an integer
        >= 1 or "all" (None: per platform).
    tuning: the GPU kernels' sweep points (`KernelTuning`; the defaults: the tuned kernels).

    "auto": attention and prefill_attention per platform (prefill: "mosaic_gpu" on a Hopper
    GPU, where it beats cuDNN, benchmarks/prefill_kernel.md; "cudnn" on other GPUs); scores and
    top-k the GPU kernels on a GPU; moe, heads, repack, refresh and matmul ("by_shape") the GPU
    variants when attention is "pallas_gpu" or "mosaic_gpu"; epilogue "fused" then too, but
    "xla" with a Mosaic matmul (its fused epilogues are taken only when asked for).
    On a jax without Pallas' Triton lowering (deprecated in jax 0.11) "auto" takes no Triton
    kernel: the Mosaic GPU attention, MoE and weight-streaming ("mosaic_by_shape") kernels on
    a Hopper, XLA for the rest (slower, not broken; `kernels.common.triton_available`).
    """

    attention: str = "auto"
    prefill_attention: str = "auto"
    selector_scores: str = "auto"
    selector_topk: str = "auto"
    selector_adjust: str = "xla"
    moe: str = "auto"
    heads: str = "auto"
    repack: str = "auto"
    refresh: str = "auto"
    matmul: str = "auto"
    epilogue: str = "auto"
    layer_unroll: int | str | None = None
    tuning: KernelTuning = KernelTuning()

    def __post_init__(self):
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise ValueError(f"EngineOptions.{name}={value!r}: expected one of {allowed}")
        u = self.layer_unroll
        ok = u is None or u == "all" or (isinstance(u, numbers.Integral)
                                         and not isinstance(u, bool) and u >= 1)
        if not ok:
            raise ValueError(f"EngineOptions.layer_unroll={u!r}: expected None (auto), an "
                             "integer >= 1 or 'all'")
        if isinstance(u, numbers.Integral):
            object.__setattr__(self, "layer_unroll", int(u))
        if not isinstance(self.tuning, KernelTuning):
            raise ValueError(f"EngineOptions.tuning={self.tuning!r}: expected a KernelTuning")

    def resolved(self, platform: str | None = None, mesh=None) -> "EngineOptions":
        """A copy with every "auto" made concrete for `platform` (default: JAX's backend) and,
        for a run on a `mesh` (a `jax.sharding.Mesh`; None: one device), every choice GSPMD
        must partition made "xla": the heads' norm + rope, the expert and weight matmuls (so
        no fused epilogues) and the prefill attention. (The decode attention kernels, the
        selector and the repack run under shard_map there and keep their kernels.) A request
        path resolves once and passes the result on; resolving again changes nothing."""
        if mesh is not None:
            base = self.resolved(platform)
            return dataclasses.replace(base, heads="xla", moe="xla", matmul="xla",
                                       epilogue="xla", prefill_attention="xla")
        p = _platform() if platform is None else platform
        gpu = p == "gpu"
        # a jax without the Triton lowering: the Mosaic GPU kernels (Hopper) and XLA for the rest
        triton = not gpu or common.triton_available()
        mosaic = gpu and common.hopper()
        attention = self.attention if self.attention != "auto" else common.platform_kernel(p)
        gpu_kernels = attention in ("pallas_gpu", "mosaic_gpu")
        triton_kernels = gpu_kernels and triton

        def pick(value, auto):
            return auto if value == "auto" else value

        matmul = pick(self.matmul, "by_shape" if triton_kernels else
                      "mosaic_by_shape" if gpu_kernels and mosaic else "xla")
        # the Mosaic twin's fused epilogues only when asked for: slower on the H100 (findings.md)
        epilogue = pick(self.epilogue, "fused" if triton_kernels
                        and matmul not in skinny_matmul.MOSAIC_ROWS else "xla")
        return dataclasses.replace(
            self, attention=attention,
            prefill_attention=pick(self.prefill_attention, common.platform_prefill(p)),
            selector_scores=pick(self.selector_scores, "pallas_gpu" if gpu and triton else "xla"),
            # the Mosaic twin where it runs (as fast as Triton's or faster: findings.md)
            selector_topk=pick(self.selector_topk, ("radix_mosaic_gpu" if mosaic else
                                                    "radix_kernel" if triton else "radix")
                               if gpu else "lax"),
            moe=pick(self.moe, "tokens" if triton_kernels else
                     "mosaic_gpu" if gpu_kernels and mosaic else "xla"),
            heads=pick(self.heads, "kernel" if triton_kernels else "xla"),
            repack=pick(self.repack, "kernel" if triton_kernels else "xla"),
            refresh=pick(self.refresh, "unconditional" if gpu_kernels else "cond"),
            matmul=matmul, epilogue=epilogue,
            layer_unroll=(6 if gpu else 1) if self.layer_unroll is None else self.layer_unroll)

    @property
    def is_resolved(self) -> bool:
        return self.layer_unroll is not None and all(
            getattr(self, name) != "auto" for name in CHOICES)

    @property
    def unroll(self) -> int | bool:
        """layer_unroll as `lax.scan` takes it (True: all layers); needs a resolved object."""
        return True if self.layer_unroll == "all" else self.layer_unroll

    @classmethod
    def from_strings(cls, items, base: "EngineOptions | None" = None) -> "EngineOptions":
        """Options from "field=value" strings (a CLI's repeated `--opt`, a benchmark variant),
        applied over `base` (default: all defaults). layer_unroll takes an integer, "all" or
        "auto"."""
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "tuning"]
        changes = {}
        for item in items:
            name, sep, value = str(item).partition("=")
            name, value = name.strip(), value.strip()
            if not sep or name not in fields:
                raise ValueError(f"engine option {item!r}: expected FIELD=VALUE with FIELD one "
                                 f"of {fields}")
            if name == "layer_unroll":
                value = None if value == "auto" else int(value) if value.isdigit() else value
            changes[name] = value
        return dataclasses.replace(base if base is not None else cls(), **changes)


_platform = platform


def resolve(name: str, value: str, platform: str | None = None) -> str:
    """One field's concrete value for `platform` (the public kernel and selector functions take
    single implementation names; "auto" resolves as in `EngineOptions.resolved`)."""
    return getattr(EngineOptions(**{name: value}).resolved(platform), name)
