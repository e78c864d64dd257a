"""`python -m sfi_jax.serve`: an OpenAI-compatible HTTP server over `sfi_jax.Engine` (needs the
`serve` extra: FastAPI, uvicorn, prometheus-client). `create_app(engine)` gives the ASGI
application for running it another way."""

from sfi_jax.serve.app import create_app

__all__ = ["create_app"]
