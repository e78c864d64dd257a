"""Check and time the MoE grouped-matmul kernels (kernels.moe_gpu) on the GPU against
`lax.ragged_dot` at a model's expert shapes, per kernel config. A failed compile prints the
head of its message (without the serialized module the error carries), so one device call
shows both why a config fails and which one is fastest. Rows "tokens:CONFIG" time
`moe_gpu.token_moe` (grouping "tokens": the whole routed-expert block, padding and the sum
over expert groups included) against the weighted sum of the reference's outputs, and rows
"mosaic:CONFIG" (with --mosaic) its Mosaic GPU twin `moe_mgpu.token_moe` the same way; the
other rows time the two expert-sorted kernels alone (the sort, gather and combine around them
are not in the time).

    python scripts/diag/diag_moe_kernel.py --model qwen3-30b-a3b --tokens 16 --out /tmp/moe_diag.json
    python scripts/diag/diag_moe_kernel.py --configs 128x64x4x3 --mosaic 128x64x4,64x64x4
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import timeit  # noqa: E402

from sfi_jax.kernels import moe_gpu, moe_mgpu  # noqa: E402
from sfi_jax.models import PRESETS  # noqa: E402


def message_head(err: Exception, n_lines: int = 40) -> str:
    """The readable lines of an error (serialized IR lines carry byte escapes: dropped)."""
    lines = [ln[:300] for ln in str(err).splitlines() if "\\x" not in ln]
    return "\n".join(lines[:n_lines])


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def routed(key, n_tokens: int, n_experts: int, top_k: int, hidden: int):
    """n_tokens tokens each routed to top_k experts with random weights: the tokens x, their
    expert-sorted rows, the group sizes, each sorted row's token and weight, and the dense
    [tokens, experts] routing weights, and the top-k weights and experts. (One program: op by
    op, each small op would compile on its own.)"""
    kx, ke = jax.random.split(key)
    x = jax.random.normal(kx, (n_tokens, hidden), jnp.bfloat16)
    scores = jax.random.uniform(ke, (n_tokens, n_experts))
    top_p, top_e = jax.lax.top_k(scores, top_k)
    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    dense = jnp.zeros((n_tokens, n_experts)).at[jnp.arange(n_tokens)[:, None], top_e].set(top_p)
    order = jnp.argsort(top_e.reshape(-1))
    sizes = jnp.bincount(top_e.reshape(-1), length=n_experts).astype(jnp.int32)
    return (x, x[order // top_k], sizes, order // top_k, top_p.reshape(-1)[order], dense, top_p,
            top_e)


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def expert_weights(kg, ku, kd, e: int, hidden: int, inter: int):
    """Random bf16 gate, up and down weights of e experts (scaled: unit-variance outputs)."""
    scale = hidden ** -0.5
    w_gate = (jax.random.normal(kg, (e, hidden, inter)) * scale).astype(jnp.bfloat16)
    w_up = (jax.random.normal(ku, (e, hidden, inter)) * scale).astype(jnp.bfloat16)
    w_down = (jax.random.normal(kd, (e, inter, hidden)) * inter ** -0.5).astype(jnp.bfloat16)
    return w_gate, w_up, w_down


@functools.partial(jax.jit, static_argnums=3)
def weighted_sum(ref_y, token_of, p_sorted, n_tokens: int):
    """The MoE block's output (what grouping "tokens" returns): per token, the sum of its
    expert rows' outputs times their routing weights."""
    return jnp.zeros((n_tokens, ref_y.shape[1])).at[token_of].add(
        ref_y.astype(jnp.float32) * p_sorted[:, None])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,16", help="tokens per step (comma-separated)")
    ap.add_argument("--configs", default="64x64x4x3,64x64x4x2,128x64x4x3,128x32x4x3,32x64x2x3,"
                    "64x128x4x2,128x128x8x2",
                    help="block_n x block_k x num_warps x num_stages, comma-separated")
    ap.add_argument("--mosaic", default="",
                    help="also the Mosaic GPU twin: block_n x block_k x stages, comma-separated")
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU check)")
    ap.add_argument("--tiny", action="store_true", help="8 experts of 128 x 64, top-2 (CPU check)")
    args = ap.parse_args(argv)
    cfg = PRESETS[args.model]
    e, k, hidden, inter = (cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                           cfg.moe_intermediate_size)
    if args.tiny:
        e, k, hidden, inter = 8, 2, 128, 64
    kg, ku, kd, kr = jax.random.split(jax.random.PRNGKey(0), 4)
    # jit arguments: closed over, they would be constants
    weights = expert_weights(kg, ku, kd, e, hidden, inter)
    # Pallas interpret mode (a CPU check) times nothing worth repeating
    timing = dict(iters=2, repeats=1) if args.interpret else dict(iters=10, repeats=5)

    @jax.jit
    def reference(xs, gs, weights):
        def grouped(lhs, rhs):
            return jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32
                                      ).astype(lhs.dtype)
        gate, up, down = weights
        h = jax.nn.silu(grouped(xs, gate)) * grouped(xs, up)
        return h, grouped(h, down)

    rows = []
    device = str(jax.devices()[0].device_kind)

    def save():  # after every row, so a hung compile later still leaves the rows so far
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(model=args.model, device=device, jax=jax.__version__, rows=rows),
                          f, indent=1)
    for n_tokens in [int(t) for t in args.tokens.split(",")]:
        x, xs, gs, token_of, p_sorted, dense, top_p, top_e = routed(kr, n_tokens, e, k, hidden)
        m = xs.shape[0]
        touched = int(np.sum(np.asarray(gs) > 0))
        weight_bytes = touched * 3 * hidden * inter * 2
        print(f"tokens={n_tokens}: {touched} experts touched; ragged_dot reference", flush=True)
        ref_h, ref_y = reference(xs, gs, weights)
        t_ref = timeit(reference, xs, gs, weights, **timing) * 1e-6
        rows.append(dict(tokens=n_tokens, config="ragged_dot", ok=True, ms=t_ref * 1e3,
                         experts_touched=touched, gbps=weight_bytes / t_ref / 1e9))
        save()
        ref_out = weighted_sum(ref_y, token_of, p_sorted, n_tokens)
        for spec in args.configs.split(","):
            bn, bk, warps, stages = (int(v) for v in spec.split("x"))
            if not moe_gpu.supported(hidden, inter, bn, bk):
                print(f"config {spec}: blocks do not tile {hidden} x {inter}; skipped")
                continue
            kw = dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                      interpret=args.interpret)

            @jax.jit
            def kernel(xs, gs, weights, kw=kw):
                gate, up, down = weights
                h = moe_gpu.grouped_matmul(xs, gate, gs, up, **kw)[:m]
                return h, moe_gpu.grouped_matmul(h, down, gs, **kw)[:m]

            @jax.jit
            def tokens(x, dense, weights, kw=kw):
                return moe_gpu.token_moe(x, *weights, dense, **kw)

            rows.append(check(n_tokens, spec, touched, weight_bytes, kernel, ref_h, ref_y,
                              (xs, gs, weights), timing))
            save()
            if n_tokens <= moe_gpu.TOKENS:
                rows.append(check(n_tokens, "tokens:" + spec, touched, weight_bytes, tokens,
                                  None, ref_out, (x, dense, weights), timing))
                save()
        for spec in filter(None, args.mosaic.split(",")):
            bn, bk, stages = (int(v) for v in spec.split("x"))
            mcfg = moe_mgpu.Config(block_n=bn, block_k=bk, stages=stages)

            @jax.jit
            def twin(x, top_p, top_e, weights, mcfg=mcfg):
                return moe_mgpu.token_moe(x, *weights, top_p, top_e, config=mcfg,
                                          interpret=args.interpret)

            rows.append(check(n_tokens, "mosaic:" + spec, touched, weight_bytes, twin, None,
                              ref_out, (x, top_p, top_e, weights), timing))
            save()
    print(f"{args.model} on {device}: expert matmuls per MoE layer (bf16)")
    print("| tokens | config | ok | ms | weight GB/s | experts touched |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ms = f"{r['ms']:.3f}" if "ms" in r else "-"
        gb = f"{r['gbps']:.0f}" if "gbps" in r else "-"
        print(f"| {r['tokens']} | {r['config']} | {r['ok']} | {ms} | {gb} | {r['experts_touched']} |")


@jax.jit
def _rel_err(got, want):
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-9)


def _rel(got, want):
    return float(_rel_err(got, want))


def check(n_tokens, spec, touched, weight_bytes, fn, ref_h, ref_y, fn_args, timing):
    """One config's row: compiled, checked against the references (ref_h None: fn returns
    only the output), timed (timeit's iters and repeats); or the head of its error."""
    row = dict(tokens=n_tokens, config=spec, experts_touched=touched)
    print(f"tokens={n_tokens} config={spec}: compiling and checking", flush=True)
    try:
        out = fn(*fn_args)
        h, y = out if ref_h is not None else (None, out)
        err_h = _rel(h, ref_h) if ref_h is not None else 0.0
        err_y = _rel(y, ref_y)
        t = timeit(fn, *fn_args, **timing) * 1e-6
        row.update(ok=err_h < 2e-2 and err_y < 2e-2, rel_err_hidden=err_h, rel_err_out=err_y,
                   ms=t * 1e3, gbps=weight_bytes / t / 1e9)
    except Exception as err:  # noqa: BLE001 - the point is to report it
        row.update(ok=False, error=message_head(err))
        print(f"--- tokens={n_tokens} config={spec} failed:\n{row['error']}\n---", flush=True)
    return row


if __name__ == "__main__":
    main()
