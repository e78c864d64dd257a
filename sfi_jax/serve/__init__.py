"""`python -m sfi_jax.serve`: an OpenAI-compatible HTTP server over `sfi_jax.Engine` (needs the
`serve` extra: FastAPI, uvicorn, prometheus-client). `create_app(engine)` gives the ASGI
application for running it another way. The application is imported on first use, so the
command line (and its error naming the missing extra) works without the extra installed."""

__all__ = ["create_app"]


def __getattr__(name):
    if name == "create_app":
        from sfi_jax.serve.app import create_app

        return create_app
    raise AttributeError(f"module 'sfi_jax.serve' has no attribute {name!r}")
