"""Small pieces the kernels and their references share."""

from __future__ import annotations

import functools
import importlib
import warnings

import jax
import jax.numpy as jnp
from jax import lax


def platform() -> str:
    """"gpu" for any GPU backend (cuda, rocm), else JAX's backend name ("cpu", "tpu")."""
    p = jax.default_backend()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


@functools.cache
def compute_capability() -> float | None:
    """JAX's first GPU's compute capability (9.0 for a Hopper), None without a GPU backend."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend
        return None
    cc = getattr(gpus[0], "compute_capability", None)
    return None if cc is None else float(cc)


def hopper() -> bool:
    """Whether JAX's first GPU is a Hopper (compute capability 9.x): the Mosaic GPU kernels
    here use its wgmma instructions."""
    cc = compute_capability()
    return cc is not None and 9.0 <= cc < 10.0


def signals_dependents(launch_dependents: bool | None = None, interpret: bool = False) -> bool:
    """Whether a GPU kernel takes part in programmatic dependent launch (`griddepcontrol`,
    Hopper and newer): never in interpret mode; `launch_dependents` None: on a GPU of compute
    capability 9.0 or more (the instruction's minimum); True / False: always / never (tests,
    A/B runs)."""
    if interpret:
        return False
    if launch_dependents is None:
        cc = compute_capability()
        return cc is not None and cc >= 9.0
    return bool(launch_dependents)


@functools.cache
def triton_available() -> bool:
    """Whether this jax still has Pallas' Triton lowering (deprecated in jax 0.11, to be removed
    in a later release). Without it every GPU choice takes its Mosaic GPU or XLA form
    (`EngineOptions.resolved`, `gpu_fallback`): slower, never broken."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            importlib.import_module("jax.experimental.pallas.triton")
    except ImportError:
        return False
    return True


def gpu_fallback() -> str:
    """What inputs a Mosaic GPU kernel does not take run as: its Triton twin ("pallas_gpu"),
    or "xla" on a jax without the Triton lowering."""
    return "pallas_gpu" if triton_available() else "xla"


def row_end(q_start, kv_len, n_queries):
    """Keys a row of a multi-query chunk reads: up to its last valid query (0 when query 0 is
    already padding). kv_len is clipped to the cache already."""
    end = jnp.minimum(q_start + n_queries, kv_len)
    return jnp.where(q_start < kv_len, jnp.maximum(end, 0), 0)


def platform_kernel(p: str | None = None) -> str:
    """The Pallas implementation of platform p (default: this one; "xla" off GPUs and TPUs):
    what a decode kernel's `impl="auto"` stands for, here and in `EngineOptions.resolved`. On a
    jax without the Triton lowering: the Mosaic GPU kernel on a Hopper, else "xla"."""
    p = platform() if p is None else p
    if p == "gpu" and not triton_available():
        return "mosaic_gpu" if hopper() else "xla"
    return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(p, "xla")


def platform_prefill(p: str | None = None) -> str:
    """What the prefill attention's "auto" stands for on platform p (default: this one), before
    the inputs are checked: the Mosaic GPU kernel on a Hopper GPU (it beats cuDNN there,
    benchmarks/prefill_kernel.md), cuDNN on other GPUs, the Mosaic TPU kernel, else XLA."""
    p = platform() if p is None else p
    return {"gpu": "mosaic_gpu" if hopper() else "cudnn", "tpu": "pallas_tpu"}.get(p, "xla")


def dot_precision(dtype):
    """The kernels' and references' matmul precision for operands of `dtype`: float32 at full
    precision (the GPU would take TF32 otherwise), lower precisions as they are."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def as_layer_stack(x, layer):
    """A cache as a 5-D [L, B, Hkv, S, D] stack and the layer index to read, int32 [1] (for
    an unstacked [B, Hkv, S, D] cache a free reshape and layer 0)."""
    if layer is None:
        return x[None], jnp.zeros((1,), jnp.int32)
    return x, jnp.asarray(layer, jnp.int32).reshape(1)


def as_layer_stacks(layer, *xs):
    """as_layer_stack for several arrays read at the same layer: (stacks..., layer index)."""
    stacks = [as_layer_stack(x, layer)[0] for x in xs]
    return (*stacks, as_layer_stack(xs[0], layer)[1])


def cache_origin(layer, row):
    """int32 [2]: the layer (an `as_layer_stacks` index) and the cache row of a kernel's first
    batch row (None: 0), the scalars a kernel reads its cache at."""
    row = jnp.zeros((1,), jnp.int32) if row is None else jnp.asarray(row, jnp.int32).reshape(1)
    return jnp.concatenate([jnp.asarray(layer, jnp.int32).reshape(1), row])


def pow2(n):
    """The smallest power of two >= n (1 for n <= 1): the kernels' padded block sizes."""
    return 1 << max(int(n) - 1, 0).bit_length()


def decode_splits(total, pairs, block_k, programs, fixed_keys=None):
    """Split-K flash decoding's static plan: (keys per split, a multiple of block_k; the split
    count) covering `total` keys per (row, KV head), about `programs` programs for `pairs`
    (row, KV head) pairs.

    fixed_keys: `programs` is the SM count, and the plan is the one whose busiest SM finishes
    first, each SM reading at its own bandwidth: ceil(pairs x splits / SMs) programs on it,
    each costing its split's keys plus `fixed_keys` (a program's fixed cost, in keys read in
    that time); of plans within 2 % of the best, the fewest splits. So 8 x 17 programs on 132
    SMs (4 SMs with a second) lose to 8 x 16, and 80 x 1 (52 SMs idle) to 80 x 8."""
    pairs, total = max(pairs, 1), max(total, 1)

    def plan(n):
        split = -(-(-(-total // n)) // block_k) * block_k
        return split, -(-total // split)

    if fixed_keys is None:
        return plan(-(-programs // pairs))

    def busiest(p):
        return -(-pairs * p[1] // programs) * (fixed_keys + p[0])

    plans = [plan(n) for n in range(1, min(64, -(-total // block_k)) + 1)]
    best = min(map(busiest, plans))
    # (the fewest splits within 2 % of it: each split is a partial more to merge)
    return min((p for p in plans if busiest(p) <= 1.02 * best), key=lambda p: p[1])


def row_split(length, n_splits, block_k):
    """Keys per split when a row's n_splits splits share its own length (traced; whole
    blocks, 0 for an empty row): inside a kernel, the plan of a row shorter than the cache."""
    blocks = lax.div(length + (block_k - 1), block_k)
    return lax.div(blocks + (n_splits - 1), n_splits) * block_k


def merge_splits(m, l, o, jmask):
    """Exact merge of one query row's split partials m, l [nsp], o [nsp, dp] (splits outside
    jmask ignored): (out [dp], max m, the rescaled l sum, whether any key was seen)."""
    mx = jnp.max(m)
    w = jnp.where(jmask, jnp.exp(m - jnp.where(jnp.isfinite(mx), mx, 0.0)), 0.0)
    lsum = jnp.sum(l * w)
    acc = jnp.sum(o * w[:, None], axis=0)
    ok = lsum != 0  # no valid key: 0; NaN inputs stay NaN
    return jnp.where(ok, acc / jnp.where(ok, lsum, 1.0), 0.0), mx, lsum, ok


def interpret_for(impl: str):
    """pallas_call's `interpret` for a kernel of implementation `impl` ("pallas_gpu",
    "mosaic_gpu" or "pallas_tpu") on this platform: off the kernel's own platform it runs in
    interpret mode, so every kernel can be tested on a CPU."""
    if impl in ("pallas_gpu", "mosaic_gpu"):
        return platform() != "gpu"
    if impl != "pallas_tpu":
        raise ValueError(f"interpret_for({impl!r}): expected 'pallas_gpu', 'mosaic_gpu' or "
                         "'pallas_tpu'")
    if platform() == "tpu":
        return None
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()


def sortable_keys(x):
    """uint32 keys whose unsigned order is the float order of x (-0.0 counts as 0.0): the key
    order of the selector's radix top-k, in jnp and in the kernel."""
    x = jnp.where(x == 0, 0.0, x.astype(jnp.float32))
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits >> 31
    return jnp.where(sign == 1, ~bits, bits | jnp.uint32(0x80000000))


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis in float32, rounded to x's dtype: the model's norm, and the
    rounding the kernels' references (q/k heads, the skinny matmul's input) follow."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def swiglu_rounded(gate, up, dtype):
    """jax.nn.silu(a) * b for float32 accumulators a, b, rounded to dtype op by op as jnp does
    (a and b rounded first): the expert kernels' epilogue (`models.modeling.moe_mlp`)."""
    g = gate.astype(dtype).astype(jnp.float32)
    sig = (1.0 / (1.0 + jnp.exp(-g))).astype(dtype).astype(jnp.float32)
    silu = (g * sig).astype(dtype).astype(jnp.float32)
    return (silu * up.astype(dtype).astype(jnp.float32)).astype(dtype)


def write_new_token(k, v, key_norms, new_kv, pos, layer=None):
    """Store kn, vn [B, Hkv, D] at position pos[b] of k, v [(L,) B, Hkv, S, D] (layer `layer`
    when stacked) and, when key_norms is given, the keys' float32 L2 norms (k, v None: the
    norms alone)."""
    kn, vn = new_kv
    rows = jnp.arange(kn.shape[0])
    at = (rows, slice(None), pos) if layer is None else (layer, rows, slice(None), pos)
    if k is not None:  # (None: the norms alone, the kernel stored k and v)
        k = k.at[at].set(kn.astype(k.dtype))
        v = v.at[at].set(vn.astype(v.dtype))
    if key_norms is not None:
        norms = jnp.linalg.norm(kn.astype(jnp.float32), axis=-1)
        key_norms = key_norms.at[at].set(norms.astype(key_norms.dtype))
    return k, v, key_norms
