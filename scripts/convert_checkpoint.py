"""Write an Orbax checkpoint from any source `sfi_jax.load_model` reads.

    python scripts/convert_checkpoint.py SOURCE OUT_DIR [--dtype bfloat16] [--no-tokenizer]
"""

import argparse

import sfi_jax
from sfi_jax.models import save_orbax


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="preset, HF directory, .gguf file or hub id")
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--no-tokenizer", action="store_true", help="do not store the tokenizer")
    args = p.parse_args(argv)
    model = sfi_jax.load_model(args.source, dtype=args.dtype)
    tokenizer = None
    if not args.no_tokenizer:
        try:
            tokenizer = sfi_jax.load_tokenizer(args.source)
        except (ValueError, OSError) as e:
            print(f"note: no tokenizer stored ({e})")
    path = save_orbax(model, args.out, tokenizer=tokenizer)
    print(f"wrote {path} ({model.config.name}, {args.dtype})")


if __name__ == "__main__":
    main()
