"""Which engine option changes the tokens of the e2e engine check (bench_e2e's small-budget
arm: the platform's kernels against jnp), one option at a time, at a chosen default matmul
precision (on GPU, float32 jnp matmuls default to TF32 passes).

    python scripts/diag/diag_engine_check.py --precision default --out /tmp/check.json
    python scripts/diag/diag_engine_check.py --precision highest --out /tmp/check_hi.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precision", choices=("default", "high", "highest"), default="default")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import _common  # noqa: E402  (imports jax; puts this checkout's package on the path)
    import jax

    jax.config.update("jax_default_matmul_precision", args.precision)
    import sfi_jax
    from sfi_jax import EngineOptions, SFIConfig

    model, prompts = _common.engine_check_model()
    small = SFIConfig(n_sink=4, k_select=64, n_recent=32, t_max=8)
    gpu = jax.default_backend() == "gpu"
    kernel = "pallas_gpu" if gpu else "xla"
    arms = {
        "xla": EngineOptions(attention="xla", selector_scores="xla", selector_topk="lax"),
        "attention": EngineOptions(attention=kernel, selector_scores="xla", selector_topk="lax"),
        "selector_scores": EngineOptions(attention="xla", selector_scores=kernel,
                                         selector_topk="lax"),
        "selector_topk": EngineOptions(attention="xla", selector_scores="xla",
                                       selector_topk="radix_kernel" if gpu else "lax"),
        "defaults": EngineOptions(),
    }
    out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
               precision=args.precision, arms={})
    ref = None
    for name, opt in arms.items():
        r = sfi_jax.generate(model, prompts, max_new_tokens=args.new_tokens, stop_at_eos=False,
                             sfi=small, options=opt, trigger_ids=[5, 6, 7])
        ref = r.tokens if ref is None else ref
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                 for x, y in zip(r.tokens, ref)]
        out["arms"][name] = dict(equal_to_xla=r.tokens == ref, first_difference=first,
                                 slow_steps=r.stats["slow_steps"])
        print(name, out["arms"][name], flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
