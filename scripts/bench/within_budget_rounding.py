"""SFI inside its budget against dense decoding: how far the SFI program's logits are from the
dense program's when every position fits the budget (the same attention, summed by the sparse
kernel in another order), and whether the greedy tokens agree. The SFI program is kept with
diagnostics=True (otherwise `generate` runs the dense program there).

    python scripts/bench/within_budget_rounding.py --max-new-tokens 38
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import sfi_jax
from sfi_jax.cli import DEFAULT_PROMPT


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="wrapped in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=38)
    args = p.parse_args(argv)
    tok = sfi_jax.load_tokenizer(args.model)
    model = sfi_jax.load_model(args.model, dtype="float32")
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    kw = dict(max_new_tokens=args.max_new_tokens, stop_at_eos=False, return_logits=True,
              tokenizer=tok)
    sfi = sfi_jax.generate(model, [ids], mode="sfi", diagnostics=True, **kw)
    dense = sfi_jax.generate(model, [ids], mode="dense", **kw)
    diff = np.abs(sfi.stats["logits"] - dense.stats["logits"]).max(axis=(0, 2))
    out = {"model": args.model, "prompt_tokens": len(ids), "new_tokens": args.max_new_tokens,
           "budget": sfi_jax.SFIConfig().budget, "sfi_decode_path": sfi.stats["decode_path"],
           "slow_steps": sfi.stats["slow_steps"], "tokens_equal": sfi.tokens == dense.tokens,
           "max_abs_logit_diff": float(diff.max()),
           "bitwise_equal_steps": int((diff == 0).sum()), "steps": int(diff.size),
           "logit_scale": float(np.abs(dense.stats["logits"]).max())}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
