"""`python -m sfi_jax.serve`: flags, checked before the model loads; the model, its tokenizer
and an Engine; uvicorn on a socket bound first (so a taken port fails early and port 0 picks a
free one); one line on stdout when ready."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys

from sfi_jax.runtime.mode import Mode
from sfi_jax.sfi_flags import add_sfi_flags, sfi_from_flags

DEFAULT_MODEL = "smollm2-135m"
SERVER_MEMORY_FRACTION = 0.9
# where JAX reads the GPU memory share when its backend starts: either name (the second is the
# older one); both set at once is an error there
MEMORY_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sfi_jax.serve",
        description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics) over the sfi_jax Engine. With no arguments "
                    "it serves the embedded SmolLM2-135M-Instruct on 127.0.0.1:8000.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="preset name, local Hugging Face or Orbax directory, .gguf file, or hub id "
                        "(as in python -m sfi_jax.generate)")
    p.add_argument("--tokenizer", default=None,
                   help="where to load the tokenizer from (default: the model source)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one)")
    p.add_argument("--max-slots", type=int, default=None,
                   help="requests decoding at once (default: the Engine's, from device memory)")
    p.add_argument("--max-len", type=int, default=None,
                   help="prompt + output tokens per request at most (default: the Engine's)")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="the share of the GPU's memory JAX may take, for the caches above all "
                        "(sets XLA_CLIENT_MEM_FRACTION before JAX starts; default: that "
                        "variable or XLA_PYTHON_CLIENT_MEM_FRACTION where set, else "
                        f"{SERVER_MEMORY_FRACTION}: a server owns its GPU; JAX's own default "
                        "is 0.75)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a slot at most; more get 429")
    p.add_argument("--mode", type=Mode.from_flag, choices=list(Mode), default=Mode.SFI,
                   help="decoding mode of the engine (exact: greedy requests only, dense "
                        "decoding's tokens; a request's temperature then defaults to 0)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights and KV cache dtype (auto: float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--chunk-steps", type=int, default=16,
                   help="decode steps per device call (tokens stream between calls)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish before cancelling "
                        "them")
    p.add_argument("--warmup", choices=("auto", "all", "first", "none"), default="auto",
                   help="requests run before 'ready' to compile the programs: all (one per "
                        "prefill shape, so no request waits for a compile), first (the "
                        "shortest only; longer prompts compile when they first come), none; "
                        "auto: first on a CPU, all elsewhere")
    p.add_argument("--no-warmup", dest="warmup", action="store_const", const="none",
                   help="the same as --warmup none")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (info logs every request)")
    add_sfi_flags(p)
    c = p.add_argument_group("caches")
    c.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="JAX's persistent compilation cache (default as in "
                        "python -m sfi_jax.generate)")
    c.add_argument("--no-compile-cache", dest="compile_cache_off", action="store_true",
                   help="compile every program afresh")
    return p


def check_args(parser, args):
    """Every flag checked before anything loads; returns the SFIConfig. A bad one is the
    parser's error (one line, exit status 2)."""
    for name, lo in (("max_slots", 1), ("max_len", 2), ("max_queue", 1), ("chunk_steps", 1)):
        value = getattr(args, name)
        if value is not None and value < lo:
            parser.error(f"--{name.replace('_', '-')} must be >= {lo}, got {value}")
    f = args.memory_fraction
    if f is not None and not 0 < f <= 1:
        parser.error(f"--memory-fraction must be in (0, 1], got {f}")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.compile_cache and args.compile_cache_off:
        parser.error("--compile-cache and --no-compile-cache contradict each other")
    try:
        return sfi_from_flags(args)
    except ValueError as e:
        parser.error(str(e))


def bind(parser, host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a taken port is an error before the model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        parser.error(f"cannot listen on {host}:{port}: {e}")
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def apply_memory_fraction(args) -> str:
    """The GPU memory share JAX will take, put where JAX reads it when its backend starts (so
    before anything touches a device): --memory-fraction, else the variable as set, else the
    server's default. Returns the value in force."""
    already = [name for name in MEMORY_FRACTION_VARS if os.environ.get(name)]
    if args.memory_fraction is not None:
        for name in already:
            del os.environ[name]
        os.environ[MEMORY_FRACTION_VARS[0]] = repr(args.memory_fraction)
    elif not already:
        os.environ[MEMORY_FRACTION_VARS[0]] = repr(SERVER_MEMORY_FRACTION)
    return next(os.environ[n] for n in MEMORY_FRACTION_VARS if os.environ.get(n))


def build_engine(args, sfi):
    import jax

    import sfi_jax
    from sfi_jax.cache import default_compilation_cache_dir, enable_compilation_cache
    from sfi_jax.models.config import PRESETS
    from sfi_jax.models.loading import EMBEDDED_DEFAULT

    if not args.compile_cache_off:
        directory = args.compile_cache or default_compilation_cache_dir()
        if directory:
            enable_compilation_cache(directory)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    model = sfi_jax.load_model(args.model, dtype=dtype)
    if args.tokenizer is None and args.model in PRESETS and args.model != EMBEDDED_DEFAULT:
        # a random-weight preset (benchmarks): prompts as token ids; text and chat get a 400
        print(f"{args.model} has random weights and no tokenizer: prompts must be token ids",
              file=sys.stderr)
        tokenizer = None
    else:
        tokenizer = sfi_jax.load_tokenizer(args.tokenizer or args.model)
    kw = {k: getattr(args, k) for k in ("max_slots", "max_len") if getattr(args, k) is not None}
    engine = sfi_jax.Engine(model, tokenizer=tokenizer, mode=args.mode, sfi=sfi,
                            chunk_steps=args.chunk_steps, max_queue=args.max_queue,
                            model_name=args.served_model_name or args.model, **kw)
    return engine


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sfi = check_args(parser, args)
    sock = bind(parser, args.host, args.port)
    try:
        import uvicorn  # noqa: F401

        from sfi_jax.serve.app import create_app
    except ImportError as e:
        raise SystemExit(f"error: the server needs the serve extra (pip install "
                         f"'sfi_jax[serve]'): {e}")
    apply_memory_fraction(args)
    try:
        engine = build_engine(args, sfi)
    except (ValueError, FileNotFoundError, MemoryError) as e:
        raise SystemExit(f"error: {e}")
    warmup = args.warmup
    if warmup == "auto":
        import jax

        warmup = "first" if jax.default_backend() == "cpu" else "all"
    app = create_app(engine, served_model_name=args.served_model_name or args.model,
                     warmup=warmup)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    server = make_server(app, args, ready_line=f"serving {args.served_model_name or args.model}"
                                               f" on http://{url_host}:{port}")
    server.run(sockets=[sock])
    return 0


def make_server(app, args=None, *, ready_line: str | None = None, **config):
    """A uvicorn.Server whose shutdown first stops admitting requests (503), lets running ones
    finish for up to its graceful-shutdown timeout and then cancels them; it prints
    `ready_line` once it listens."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if ready_line and not self.should_exit:
                print(ready_line, flush=True)

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                # a SIGTERM was handled by shutting down gracefully: exit with status 0
                # rather than raising the signal again once the server has stopped
                getattr(self, "_captured_signals", []).clear()

        async def shutdown(self, sockets=None):
            await app.state.server.drain(self.config.timeout_graceful_shutdown or 0.0)
            await super().shutdown(sockets=sockets)

    if args is not None:
        config.setdefault("log_level", args.log_level)
        config.setdefault("timeout_graceful_shutdown", args.shutdown_timeout)
    config.setdefault("lifespan", "on")  # a failing start-up stops the server
    return Server(uvicorn.Config(app, **config))


if __name__ == "__main__":
    sys.exit(main())
