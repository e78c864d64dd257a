"""Diagnose the decode step on the current device: copies of the KV cache in the compiled
decode chunk, and step time at a short context (weights + overhead, attention negligible).

    python scripts/diag/diag_decode_hlo.py [--model qwen3-4b] [--batch 16]
"""

import argparse
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import make_state  # noqa: E402

from sfi_jax.config import SFIConfig  # noqa: E402
from sfi_jax.models.config import PRESETS  # noqa: E402
from sfi_jax.models.params import random_params  # noqa: E402
from sfi_jax.options import EngineOptions  # noqa: E402
from sfi_jax.runtime import decode  # noqa: E402
from sfi_jax.runtime.sampling import SamplingConfig  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cfg = PRESETS[a.model]
    params = random_params(cfg, "bfloat16", 0)
    B, n = a.batch, 32
    S = a.ctx + 4 * n + 128
    eos = jnp.zeros((cfg.vocab_size,), bool)
    for sfi in (None, SFIConfig()):
        st = make_state(cfg, B, S, a.ctx, sfi)
        forced = jnp.zeros((B, n), jnp.int32) + 200
        fn = decode.decode_chunk.lower(params, st, eos, eos, forced, cfg=cfg, sfi=sfi,
                                       sampling=SamplingConfig(), n_steps=n,
                                       options=EngineOptions().resolved()).compile()
        txt = fn.as_text()
        if a.out:
            with open(os.path.join(a.out, f"hlo_{'sfi' if sfi else 'dense'}.txt"), "w") as f:
                f.write(txt)
        shape = f"[{cfg.num_layers},{B},{cfg.num_kv_heads},{S},{cfg.head_dim}]"
        copies = [l.strip()[:160] for l in txt.splitlines()
                  if shape in l and re.search(r"= \S+ copy(-start)?\(", l)]
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            st, toks, *_ = fn(params, st, eos, eos, forced)
            jax.block_until_ready(toks)
            ts.append((time.perf_counter() - t) / n)
        print(f"{'sfi' if sfi else 'dense'}: ctx {a.ctx} B {B}: step {statistics.median(ts)*1e3:.2f} ms;"
              f" weights floor {cfg.param_count()*2/4.2e12*1e3:.2f} ms; cache copies {len(copies)}")
        for c in copies[:5]:
            print("   ", c)
        del st


if __name__ == "__main__":
    main()
