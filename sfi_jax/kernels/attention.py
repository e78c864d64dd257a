"""Public decode-attention entry points: pick an implementation and check shapes.

impl: "auto" (the kernel of the current platform; "xla" on CPU), "xla" (pure jnp),
"pallas_gpu" (Triton-lowered), "mosaic_gpu" (Mosaic GPU, for half-precision caches with
head dim 64/128/256; other inputs take the Triton kernel), "pallas_tpu" (Mosaic TPU). A Pallas
kernel asked for off its own platform runs in interpret mode, so each can be tested on a CPU.
"""

from __future__ import annotations

import jax.numpy as jnp

from sfi_jax.kernels import attention_reference as reference
from sfi_jax.kernels.common import (gpu_fallback, interpret_for, platform, platform_kernel,
                                    triton_available, write_new_token)

IMPLS = ("auto", "xla", "pallas_gpu", "mosaic_gpu", "pallas_tpu")
REPACK = ("auto", "kernel", "mosaic_gpu", "xla")


def resolve_impl(impl) -> str:
    """The implementation `impl` stands for here ("auto": the current platform's kernel)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
    return platform_kernel() if impl == "auto" else impl


def _check_cache(name, cache, layer, ndim=4):
    want = ndim + (layer is not None)
    if cache.ndim != want:
        stacked = " stacked [L, ...]" if layer is not None else ""
        raise ValueError(f"{name} has shape {cache.shape}; expected {want} dims{stacked}")


def _check(q, k, v, lengths, layer, n_rows=None):
    if q.ndim != 3:
        raise ValueError(f"q has shape {q.shape}; expected [B, Hq, D]")
    _check_cache("k", k, layer)
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} differ")
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[-3]
    if k.shape[-1] != d:
        raise ValueError(f"head dim of q ({d}) and k ({k.shape[-1]}) differ")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    n_rows = q.shape[0] if n_rows is None else n_rows
    if lengths.shape != (n_rows,):
        raise ValueError(f"lengths has shape {lengths.shape}; expected ({n_rows},)")


def dense_decode(q, k, v, lengths, *, return_logits=False, impl="auto", layer=None, rows=None,
                 logits_into=None, out_into=None, gather_q=False, config=None,
                 launch_dependents=None, zero_fill=False):
    """Decode attention of q [B, Hq, D] over k, v [B, Hkv, S, D], positions < lengths[b].

    layer: with k, v stacked [L, B, Hkv, S, D], read that layer in place (no copy).
    rows: int32 [R]; q and lengths then have R rows and row i reads cache row rows[i].
    Returns out [B, Hq, D], or with return_logits (out, logits f32 [B, Hq, S] with -inf at
    ignored positions, lse f32 [B, Hq]). A row of length 0 gives zeros and lse -inf.
    logits_into: a float32 buffer [L, B, Hq, S] (L as the stacked cache; 1 without `layer`);
    returns (out, the buffer with the logits in layer `layer`, lse). Positions at or past a
    row's length are unspecified (the GPU kernel leaves them as they were and does no work for
    a row of length 0; other implementations write -inf).
    out_into: (buffer [N, Hq, D], dest int32 [B]): row i's output goes to buffer[dest[i]]
    (dest >= N: dropped) and the buffer is returned as `out` (the engine merges the refreshed
    rows into the fast rows' output this way, in the same launch on GPU).
    Buffers passed in are updated in place inside a jitted caller that owns them.
    gather_q: q has one row per cache row and row i of the result uses q[rows[i]] (the kernel
    reads it there: no gathered copy); lengths, the outputs and buffers then have R rows.
    config, launch_dependents: the GPU kernel's (`attention_gpu.dense_decode`; other
    implementations ignore them); zero_fill: the Mosaic GPU kernel's
    (`attention_mgpu.dense_decode`).
    """
    if gather_q and rows is None:
        raise ValueError("gather_q=True needs rows")
    n_rows = rows.shape[0] if gather_q else q.shape[0]
    _check(q, k, v, lengths, layer, n_rows)
    if rows is not None and rows.shape != (n_rows,):
        raise ValueError(f"rows has shape {rows.shape}; expected ({n_rows},)")
    if gather_q and q.shape[0] != k.shape[-4]:
        raise ValueError(f"gather_q: q has {q.shape[0]} rows; expected the cache's "
                         f"{k.shape[-4]}")
    want = ((k.shape[0] if layer is not None else 1), n_rows) + q.shape[1:2] + (k.shape[-2],)
    if logits_into is not None and (logits_into.shape != want or
                                    logits_into.dtype != jnp.float32):
        raise ValueError(f"logits_into is {logits_into.dtype}{list(logits_into.shape)}; "
                         f"expected float32{list(want)}")
    if out_into is not None:
        buf, dest = out_into
        if buf.ndim != 3 or buf.shape[1:] != q.shape[1:] or dest.shape != (n_rows,):
            raise ValueError(f"out_into is ({list(buf.shape)}, {list(dest.shape)}); expected "
                             f"([N, {q.shape[1]}, {q.shape[2]}], [{n_rows}])")
    impl = resolve_impl(impl)
    lengths = jnp.asarray(lengths, jnp.int32)
    if impl == "mosaic_gpu":
        from sfi_jax.kernels import attention_mgpu as mgpu

        impl = "mosaic_gpu" if mgpu.supported(q, k) else gpu_fallback()
    if impl == "pallas_gpu":
        from sfi_jax.kernels import attention_gpu as gpu

        buf, dest = out_into if out_into is not None else (None, None)
        return gpu.dense_decode(q, k, v, lengths, layer, rows, return_logits=return_logits,
                                logits_into=logits_into, out_into=buf, out_rows=dest,
                                gather_q=gather_q, interpret=interpret_for(impl), config=config,
                                launch_dependents=launch_dependents)
    if gather_q:
        q = q[rows]
    with_logits = return_logits or logits_into is not None
    if impl == "xla":
        res = reference.dense_decode(q, k, v, lengths, layer=layer, rows=rows,
                                     return_logits=with_logits)
    elif impl == "mosaic_gpu":
        res = mgpu.dense_decode(q, k, v, lengths, layer, rows, return_logits=with_logits,
                                interpret=interpret_for(impl), zero_fill=zero_fill)
    else:
        from sfi_jax.kernels import attention_tpu as tpu

        res = tpu.dense_decode(q, k, v, lengths, layer, rows, return_logits=with_logits,
                               interpret=interpret_for(impl))
    out, extra = (res[0], res[1:]) if with_logits else (res, ())
    if out_into is not None:
        out = out_into[0].at[out_into[1]].set(out.astype(out_into[0].dtype), mode="drop")
    if logits_into is not None:
        extra = (logits_into.at[0 if layer is None else layer].set(extra[0]), extra[1])
    return (out, *extra) if with_logits else out


def sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths, *, impl="auto", layer=None,
                  window=None, new_kv=None, key_norms=None, config=None,
                  launch_dependents=None, zero_fill=False, kernel_stores=False):
    """Attention over the compact buffer prefix [0, c_len[b, h]) of ck, cv [B, Hkv, C, D]
    and the cache window [recent_start[b], lengths[b]) of k, v [B, Hkv, S, D], read in place.

    Equal to dense attention over the union of both segments; an empty union gives zeros.
    layer: all four caches stacked over layers, read in place. window: optional static
    bound on lengths - recent_start; the TPU kernel and the xla path then read only that
    much of the cache per row (a wrong bound gives wrong results).
    new_kv: (kn, vn) [B, Hkv, D], this step's key and value: they are first stored at
    position lengths[b] - 1 of k, v (lengths >= 1, recent_start < lengths), and with
    key_norms [B, Hkv, S] (stacked like the caches) the key's L2 norm too; returns
    (out, k, v, key_norms). With "pallas_gpu" one launch does the stores and the attention;
    "mosaic_gpu" stores them by XLA scatters before its kernel, or with kernel_stores (jax 0.11
    on) its kernel stores the key and value before it reads them, the norms by an XLA
    scatter.
    With `layer`, c_len may be stacked too ([L, B, Hkv]); layer `layer` is read.
    config: an `attention_gpu.Config` for the Triton kernel or an `attention_mgpu.Config` for
    the Mosaic GPU one (the other kernel ignores it); launch_dependents: the Triton kernel's;
    zero_fill: the Mosaic GPU kernel's (`attention_mgpu.sparse_decode`); kernel_stores: its
    kernel stores the new token where it can (`attention_mgpu.stores_in_kernel`).
    """
    _check(q, k, v, lengths, layer)
    _check_cache("ck", ck, layer)
    if ck.shape != cv.shape or ck.shape[-1] != k.shape[-1] or ck.shape[-3] != k.shape[-3]:
        raise ValueError(f"ck {ck.shape}, cv {cv.shape} do not match the cache {k.shape}")
    want_c = (q.shape[0], k.shape[-3])
    if c_len.shape != want_c and (layer is None or c_len.shape != k.shape[:1] + want_c):
        stacked = "" if layer is None else f" or {k.shape[:1] + want_c}"
        raise ValueError(f"c_len has shape {c_len.shape}; expected {want_c}{stacked}")
    if recent_start.shape != (q.shape[0],):
        raise ValueError(f"recent_start has shape {recent_start.shape}; expected ({q.shape[0]},)")
    if window is not None and int(window) < 0:
        raise ValueError(f"window={window}; expected a non-negative int or None")
    if new_kv is not None:
        want = (q.shape[0], k.shape[-3], k.shape[-1])
        if any(x.shape != want for x in new_kv):
            raise ValueError(f"new_kv shapes {[x.shape for x in new_kv]}; expected {want} each")
        if key_norms is not None and key_norms.shape != k.shape[:-1]:
            raise ValueError(f"key_norms has shape {key_norms.shape}; expected {k.shape[:-1]}")
    elif key_norms is not None:
        raise ValueError("key_norms is written only together with new_kv")
    impl = resolve_impl(impl)
    c_len = jnp.asarray(c_len, jnp.int32)
    recent_start = jnp.asarray(recent_start, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    if impl == "mosaic_gpu":
        from sfi_jax.kernels import attention_mgpu as mgpu

        impl = "mosaic_gpu" if mgpu.supported(q, k, ck) else gpu_fallback()
    if impl == "pallas_gpu":
        from sfi_jax.kernels import attention_gpu as gpu

        return gpu.sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths, layer,
                                 window=window, new_kv=new_kv, key_norms=key_norms,
                                 interpret=interpret_for(impl),
                                 config=config if isinstance(config, gpu.Config) else None,
                                 launch_dependents=launch_dependents)
    if impl == "mosaic_gpu":
        kw = dict(window=window, interpret=interpret_for(impl), zero_fill=zero_fill,
                  config=config if isinstance(config, mgpu.Config) else None)
        if new_kv is not None and kernel_stores and mgpu.stores_in_kernel(kw["interpret"]):
            out, k, v = mgpu.sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths,
                                           layer, new_kv=new_kv, **kw)
            if key_norms is not None:  # (the norms alone by XLA)
                key_norms = write_new_token(None, None, key_norms, new_kv, lengths - 1,
                                            layer)[2]
            return out, k, v, key_norms
    if new_kv is not None:
        k, v, key_norms = write_new_token(k, v, key_norms, new_kv, lengths - 1, layer)
    if impl == "mosaic_gpu":  # c_len stacked or not: the kernel reads layer `layer`
        out = mgpu.sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths, layer, **kw)
        return out if new_kv is None else (out, k, v, key_norms)
    if c_len.ndim == 3:
        c_len = c_len[layer]
    if impl == "xla":
        out = reference.sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths,
                                      layer=layer, window=window)
    else:
        from sfi_jax.kernels import attention_tpu as tpu

        out = tpu.sparse_decode(q, ck, cv, c_len, k, v, recent_start, lengths, layer,
                                window=window, interpret=interpret_for(impl))
    return out if new_kv is None else (out, k, v, key_norms)


def repack(ck, cv, k, v, positions, slots, *, impl="xla"):
    """Compact buffers of the refreshed rows: for each slot j with slots[j] < B, layer l and KV
    head h, ck[l, slots[j], h, i] = k[l, slots[j], h, positions[l, j, h, i]] (same for cv, v)
    where positions >= 0; entries at -1 keep unspecified values (readers stop at c_len).

    ck, cv [L, B, Hkv, C, D]; k, v [L, B, Hkv, S, D]; positions int32 [L, n_slots, Hkv, C];
    slots int32 [n_slots] (>= B: empty, skipped; occupied ones unique). Returns (ck, cv),
    updated in place inside a jitted caller that owns them. impl "kernel" is one Pallas GPU
    launch that does no work for empty slots (interpret mode off the GPU); "mosaic_gpu" its
    Mosaic GPU twin's gather (one TMA copy per position), then XLA's scatter of the refreshed
    rows; "xla" is one XLA gather + scatter over every slot; "auto" the kernel on a GPU, else
    "xla".
    """
    L, B, Hkv, C, D = ck.shape
    if cv.shape != ck.shape or k.shape[:3] != (L, B, Hkv) or k.shape[-1] != D or \
            v.shape != k.shape:
        raise ValueError(f"ck {ck.shape}, cv {cv.shape}, k {k.shape}, v {v.shape} do not match")
    if positions.shape != (L, slots.shape[0], Hkv, C):
        raise ValueError(f"positions has shape {positions.shape}; expected "
                         f"{(L, slots.shape[0], Hkv, C)}")
    if impl not in REPACK:
        raise ValueError(f"repack impl={impl!r}; expected one of {REPACK}")
    if impl == "kernel" or (impl == "auto" and platform() == "gpu" and triton_available()):
        from sfi_jax.kernels import attention_gpu as gpu

        return tuple(gpu.repack(ck, cv, k, v, positions, slots, interpret=interpret_for("pallas_gpu")))
    if impl == "mosaic_gpu":
        from sfi_jax.kernels import attention_mgpu as mgpu

        if mgpu.repack_supported(ck):
            return mgpu.repack(ck, cv, k, v, positions, slots,
                               interpret=interpret_for("mosaic_gpu"))
    safe = jnp.minimum(slots, B - 1)
    idx = (jnp.arange(L)[:, None, None, None], safe[None, :, None, None],
           jnp.arange(Hkv)[None, None, :, None], jnp.maximum(positions, 0))
    kw = dict(mode="drop", unique_indices=True, indices_are_sorted=True)
    return ck.at[:, slots].set(k[idx], **kw), cv.at[:, slots].set(v[idx], **kw)
