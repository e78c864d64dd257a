"""`python -m sfi_jax.serve`: see `python -m sfi_jax.serve --help`."""

from sfi_jax.serve.cli import main

raise SystemExit(main())
