"""`python -m sfi_jax.generate`: see `python -m sfi_jax.generate --help`."""

if __name__ == "__main__":
    from sfi_jax.cli import main

    raise SystemExit(main())
