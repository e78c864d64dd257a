"""Prefill attention through cuDNN's fused attention (`jax.nn.dot_product_attention`).

cuDNN reads sequence-major K/V and its causal mask is top-left aligned, so a chunk at an
offset runs as two calls merged by their log-sum-exp: the chunk's queries over the prefix
[0, q_start) and over the chunk's own keys (causal). One compiled program serves every chunk
offset, in one of two forms of the prefix call (`PREFIX_FORMS`):
- "slab": one call over a static slab whose length `lax.switch` picks among powers of two
  times the chunk, masked to each row's prefix (per-row lengths);
- "pieces": where every row's prefix is the same whole number of chunks (an Engine's prefill,
  a batch's aligned chunks), the prefix in power-of-two runs of chunks, one unmasked call over
  each run that its binary digits hold, merged as they come; other prefixes take the slab.
  No key is read twice and no call masks (on the H200 a masked call costs 6-19 % more than
  the same keys unmasked, benchmarks/prefill_kernel.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sfi_jax.kernels.common import as_layer_stacks

DTYPES = (jnp.bfloat16, jnp.float16)
PREFIX_FORMS = ("slab", "pieces")
IMPLEMENTATION = "cudnn"  # jax.nn.dot_product_attention's; tests off a GPU check the logic on XLA's


def supported(q, k) -> bool:
    """cuDNN's fused attention takes half-precision inputs and head dims up to 128 here."""
    d = q.shape[-1]
    return any(jnp.dtype(q.dtype) == jnp.dtype(t) for t in DTYPES) and \
        jnp.dtype(k.dtype) == jnp.dtype(q.dtype) and d % 8 == 0 and d <= 128


def prefix_lengths(t: int, s: int) -> list[int]:
    """The static prefix slabs: t * 2^i below s, then s."""
    out, n = [], t
    while n < s:
        out.append(n)
        n *= 2
    return out + [s]


def _attend(q, k_seq, v_seq, *, causal, kv_lens=None):
    o, lse = jax.nn.dot_product_attention(q, k_seq, v_seq, is_causal=causal,
                                          key_value_seq_lengths=kv_lens,
                                          implementation=IMPLEMENTATION,
                                          return_residual=True)
    if lse.shape != q.shape[:3]:  # [B, Hq, T] -> [B, T, Hq]
        lse = jnp.swapaxes(lse, 1, 2)
    return o, lse.astype(jnp.float32)


def _merge(o_a, l_a, o_b, l_b):
    """Two attention results over disjoint keys as one: (out f32, lse) by their log-sum-exp."""
    m = jnp.maximum(l_a, l_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w_a, w_b = jnp.exp(l_a - m), jnp.exp(l_b - m)
    w = w_a + w_b
    o = (o_a * w_a[..., None] + o_b.astype(jnp.float32) * w_b[..., None]) / \
        jnp.where(w > 0, w, 1.0)[..., None]
    return o, m + jnp.log(w)


def prefill_attention(q, k, v, q_start, kv_len, layer=None, row=None, prefix="slab"):
    """See `kernels.prefill_attention.prefill_attention` (the cache must have room for the
    whole chunk after q_start: q_start + T <= S). prefix: the prefix call's form, one of
    `PREFIX_FORMS`."""
    del kv_len  # valid queries never see keys at or past kv_len (causal); padding ones may
    if prefix not in PREFIX_FORMS:
        raise ValueError(f"prefix={prefix!r}: expected one of {PREFIX_FORMS}")
    b, t, _, _ = q.shape
    k, v, layer = as_layer_stacks(layer, k, v)
    # cuDNN reads its operands whole: slice out the rows q reads (a copy of those rows only)
    at = (layer[0], 0 if row is None else row, 0, 0, 0)
    k, v = (lax.dynamic_slice(x, at, (1, b) + x.shape[2:])[0] for x in (k, v))
    s_len = k.shape[2]
    to_seq = lambda x: jnp.swapaxes(x, 1, 2)  # [B, Hkv, n, D] -> [B, n, Hkv, D]
    own = jax.vmap(lambda x, s: lax.dynamic_slice_in_dim(x, s, t, axis=1))
    o_self, l_self = _attend(q, to_seq(own(k, q_start)), to_seq(own(v, q_start)), causal=True)

    lens = prefix_lengths(t, s_len)
    longest = jnp.max(q_start)
    which = jnp.sum(jnp.asarray(lens[:-1], jnp.int32) < longest)

    def with_prefix(n):
        def run(q):
            o, l = _attend(q, to_seq(k[:, :, :n]), to_seq(v[:, :, :n]), causal=False,
                           kv_lens=jnp.clip(q_start, 1, n))
            return o.astype(jnp.float32), l
        return run

    def slab(q):
        return lax.switch(which, [with_prefix(n) for n in lens], q)

    def pieces(q):
        """The prefix's chunks in power-of-two runs, largest first: [0, 8t), [8t, 12t), ..."""
        chunks = q_start[0] // t
        o = jnp.zeros(q.shape, jnp.float32)
        lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
        start = jnp.zeros((), jnp.int32)
        for bit in reversed(range(max(1, (s_len - t) // t).bit_length())):
            n = t << bit

            def attend(carry, n=n):
                o, lse, start = carry
                ks, vs = (lax.dynamic_slice_in_dim(x, start, n, axis=2) for x in (k, v))
                o_n, l_n = _attend(q, to_seq(ks), to_seq(vs), causal=False)
                return (*_merge(o, lse, o_n, l_n), start + n)

            o, lse, start = lax.cond((chunks >> bit) & 1 == 1, attend, lambda c: c,
                                     (o, lse, start))
        return o, lse

    if prefix == "pieces":
        whole_chunks = jnp.all(q_start == q_start[0]) & (q_start[0] % t == 0)
        o_pre, l_pre = lax.cond(whole_chunks, pieces, slab, q)
    else:
        o_pre, l_pre = slab(q)
    l_pre = jnp.where((q_start > 0)[:, None, None], l_pre, -jnp.inf)  # no prefix: none
    return _merge(o_pre, l_pre, o_self, l_self)[0].astype(q.dtype)
