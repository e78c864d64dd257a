"""Command line: `python -m sfi_jax.generate` (the entry point lives here so tests can import it
without shadowing the `sfi_jax.generate` function)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from sfi_jax.runtime.mode import Mode
from sfi_jax.sfi_flags import add_sfi_flags, sfi_from_flags

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in --help: argparse's "(default: X)", unless the help text
    already says what the default is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) \
                or isinstance(action, argparse._HelpAction):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sfi_jax.generate", formatter_class=_HelpFormatter,
        description="Generate text with Slow-Fast Inference (or dense decoding). With no "
                    "arguments it runs the embedded SmolLM2-135M-Instruct on an example prompt.")
    p.add_argument("--model", default="smollm2-135m",
                   help="preset name (smollm2-135m = embedded real weights; qwen3-* = random "
                        "weights), local Hugging Face or Orbax directory, .gguf file, or "
                        "hub:org/name for a Hugging Face hub id")
    p.add_argument("--tokenizer", default=None,
                   help="where to load the tokenizer from (default: the model source)")
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt; repeat the flag for a batch of prompts (default: the "
                        "built-in example prompt when no --prompt-file is given either)")
    p.add_argument("--prompt-file", default=None,
                   help="UTF-8 file with one prompt per line, or JSONL: one object per line "
                        "with a 'prompt' string or a 'token_ids' list (default: none)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each prompt with the tokenizer's chat template (default: on for "
                        "the built-in example prompt, off otherwise)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--mode", type=Mode.from_flag, choices=list(Mode), default=Mode.SFI,
                   help="decoding mode (exact: SFI fast steps draft, a dense step verifies; "
                   "the tokens are dense decoding's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k best tokens (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--k-major", choices=("auto", "on", "off"), default="auto",
                   help="store the output and dense MLP weights transposed for the K-major "
                        "decode kernel (one GPU: faster for small models decoding up to 4 "
                        "prompts, slower for larger ones; docs/findings.md). auto: on where "
                        "it was measured faster (load_model's k_major_pays)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights and KV cache dtype (auto: float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--impl", default=None, choices=("auto", "xla", "pallas_gpu", "mosaic_gpu", "pallas_tpu"),
                   help="attention kernels (a shortcut for --opt attention=IMPL; default: "
                        "the platform's, as --opt leaves it)")
    p.add_argument("--opt", action="append", default=[], metavar="FIELD=VALUE",
                   help="an engine option (a field of sfi_jax.EngineOptions, e.g. moe=xla or "
                        "layer_unroll=all); repeat the flag for several (default: none, "
                        "the platform's defaults)")
    p.add_argument("--no-stop-at-eos", dest="stop_at_eos", action="store_false",
                   help="keep generating after the end-of-sequence token (default: stop)")
    p.add_argument("--chunk-steps", type=int, default=32,
                   help="decode steps per device call (text streams between calls)")
    p.add_argument("--json", action="store_true",
                   help="print one strict JSON object (NaN written as null) with tokens, text "
                        "and stats instead of text (default: text)")
    add_sfi_flags(p)
    c = p.add_argument_group("caches")
    c.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="JAX's persistent compilation cache: a second run skips compiling "
                        "(default: $SFI_JAX_CACHE_DIR/jax, else $XDG_CACHE_HOME/sfi_jax/jax, "
                        "else ~/.cache/sfi_jax/jax)")
    c.add_argument("--no-compile-cache", dest="compile_cache_off", action="store_true",
                   help="compile every program afresh (default: use the cache)")
    d = p.add_argument_group("multi-device / multi-host")
    d.add_argument("--mesh", default=None,
                   help="device mesh as data x model (x expert), e.g. '2x4' or '1x4x2'; the "
                        "sizes multiply to the number of devices (default: one device)")
    d.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (multi-host TPU / GPU: run "
                        "the same command on every host; needs --mesh; default: one process)")
    return p


def _fail(message: str):
    """The one-line error the command exits with."""
    raise SystemExit(f"error: {message}")


def _token_ids(value, where: str) -> list[int]:
    """A JSONL 'token_ids' list: non-negative integers (a bool is not a token id)."""
    if not isinstance(value, list) or not value:
        _fail(f"{where}: 'token_ids' must be a non-empty list of integers, got {value!r:.60}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            _fail(f"{where}: 'token_ids' holds {t!r}; token ids are integers >= 0")
    return value


def _jsonl_prompt(line: str, where: str):
    """One JSONL line: {"prompt": "text"} or {"token_ids": [ids]}."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        _fail(f"{where}: not valid JSON ({e})")
    if not isinstance(obj, dict):
        _fail(f"{where}: expected a JSON object with a 'prompt' or 'token_ids' field")
    if ("prompt" in obj) == ("token_ids" in obj):
        _fail(f"{where}: expected exactly one of the fields 'prompt' (a string) and "
              "'token_ids' (a list of integers)")
    if "token_ids" in obj:
        return _token_ids(obj["token_ids"], where)
    prompt = obj["prompt"]
    if not isinstance(prompt, str):
        _fail(f"{where}: 'prompt' must be a string, got {type(prompt).__name__} {prompt!r:.60} "
              "(token ids go in a 'token_ids' field)")
    if not prompt.strip():
        _fail(f"{where}: 'prompt' is empty")
    return prompt


def _read_prompt_file(path: str) -> list:
    """The prompts of a UTF-8 file: one per non-blank line, or JSONL objects."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        _fail(f"cannot read the prompt file {path}: {e.strerror or e}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _fail(f"the prompt file {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
              f"{e.start})")
    if "\x00" in text:
        _fail(f"the prompt file {path} holds NUL bytes: a binary file, not UTF-8 text")
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            prompts.append(_jsonl_prompt(line, f"{path}:{n}"))
        else:
            prompts.append(line)
    if not prompts:
        _fail(f"the prompt file {path} holds no prompt (it is empty or only whitespace)")
    return prompts


def read_prompts(args) -> tuple[list, bool]:
    """The prompts (strings, or token id lists from JSONL 'token_ids') and whether to wrap
    them in the chat template; every file and value checked here, before the model loads."""
    prompts = list(args.prompt or [])
    for i, p in enumerate(prompts):
        if not p.strip():
            _fail(f"--prompt number {i + 1} is empty")
    if args.prompt_file:
        prompts += _read_prompt_file(args.prompt_file)
    if args.chat and any(not isinstance(p, str) for p in prompts):
        _fail("--chat wraps text prompts; it cannot wrap a JSONL 'token_ids' prompt")
    if prompts:
        return prompts, bool(args.chat)
    return [DEFAULT_PROMPT], args.chat is not False


def check_values(args) -> None:
    """The values that need no model, checked before it loads (top_k against the vocabulary
    comes after)."""
    if args.max_new_tokens < 1:
        _fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.chunk_steps < 1:
        _fail(f"--chunk-steps must be >= 1, got {args.chunk_steps}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        _fail(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        _fail(f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")
    if args.top_k < 0:
        _fail(f"--top-k must be >= 0 (0 = off), got {args.top_k}")


def _json_safe(value):
    """`value` with numpy values as Python ones and NaN / inf as None (strict JSON)."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _json_safe(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Streamer:
    """Writes one row's text as its tokens arrive, such that what was written is exactly the
    final text: text that ends in an incomplete UTF-8 sequence (a trailing U+FFFD) is held
    back until the next tokens complete it, and `finish` writes whatever is still missing."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out
        self.tokens: list[int] = []
        self.written = ""
        self.first_at: float | None = None  # perf_counter of the first tokens

    def _write(self, text: str) -> None:
        out = self.out or sys.stdout
        out.write(text)
        out.flush()
        self.written += text

    def __call__(self, new: list[list[int]]) -> None:
        if self.first_at is None:
            self.first_at = time.perf_counter()
        self.tokens.extend(new[0])
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True).rstrip("\ufffd")
        if len(text) > len(self.written) and text.startswith(self.written):
            self._write(text[len(self.written):])

    def finish(self, final: str) -> None:
        """Write the rest of the final text (and a line break)."""
        if final.startswith(self.written):
            self._write(final[len(self.written):])
        else:  # the decoded text changed what was already written: show the final text whole
            self._write("\n" + final)
        self._write("\n")


def _compile_cache(args) -> None:
    from sfi_jax.cache import default_compilation_cache_dir, enable_compilation_cache

    if args.compile_cache_off:
        if args.compile_cache:
            raise SystemExit("error: --compile-cache and --no-compile-cache contradict each other")
        return
    directory = args.compile_cache or default_compilation_cache_dir()
    if directory:
        try:
            enable_compilation_cache(directory)
        except (ValueError, OSError) as e:
            _fail(f"--compile-cache: {e}")


class _PrefillBar:
    """A tqdm bar on stderr while a prompt prefills in more than one chunk (chunks done,
    prompt tokens per second); `generate(progress=...)` calls it after each chunk."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar, self.t0, self.tokens0 = enabled, None, None, 0

    def __call__(self, done: int, total: int, tokens: int) -> None:
        import time

        if not self.enabled or total < 2:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="prefill", unit="chunk", leave=False,
                            file=sys.stderr)
            self.t0, self.tokens0 = time.perf_counter(), tokens  # after the first chunk
        self.bar.update(done - self.bar.n)
        if done > 1:
            rate = (tokens - self.tokens0) / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{rate:,.0f} tokens/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def engine_options(parser, args):
    """The `EngineOptions` of --impl and the --opt flags (a later flag wins); a bad one is the
    parser's error."""
    from sfi_jax.options import EngineOptions

    items = ([f"attention={args.impl}"] if args.impl else []) + list(args.opt)
    try:
        return EngineOptions.from_strings(items)
    except ValueError as e:
        parser.error(f"--opt: {e}")


def main(argv=None) -> int:
    """Run the command; Ctrl-C ends it with one line and exit status 130."""
    t_start = time.perf_counter()
    try:
        return _run(argv, t_start)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ninterrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _run(argv, t_start: float) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = engine_options(parser, args)
    check_values(args)
    prompts, chat = read_prompts(args)
    try:
        sfi = sfi_from_flags(args)
    except ValueError as e:
        _fail(e)
    _compile_cache(args)  # before anything is compiled
    if args.distributed:
        import jax

        jax.distributed.initialize()
    import jax

    import sfi_jax

    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    mesh = None
    if args.distributed and not args.mesh and jax.process_count() > 1:
        _fail(f"--distributed with {jax.process_count()} processes needs --mesh DxM covering "
              f"all {jax.device_count()} devices")
    if args.mesh:
        from sfi_jax.models.sharding import make_mesh

        try:
            mesh = make_mesh(args.mesh)
        except ValueError as e:
            _fail(f"--mesh: {e}")
    try:
        tokenizer = sfi_jax.load_tokenizer(args.tokenizer or args.model)  # fast: first
        k_major = {"on": True, "off": False}.get(args.k_major, "auto")
        model = sfi_jax.load_model(args.model, dtype=dtype, mesh=mesh, k_major=k_major,
                                   decode_rows=len(prompts))
    except (ValueError, OSError) as e:
        _fail(e)
    if args.top_k > model.config.vocab_size:
        _fail(f"--top-k {args.top_k} exceeds the vocabulary size {model.config.vocab_size} "
              "(0 = off)")
    if chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    stream = not args.json and len(prompts) == 1 and jax.process_index() == 0
    streamer = Streamer(tokenizer)
    bar = _PrefillBar(enabled=jax.process_index() == 0 and not args.json)
    try:
        result = sfi_jax.generate(
            model, prompts, max_new_tokens=args.max_new_tokens, mode=args.mode, sfi=sfi,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            stop_at_eos=args.stop_at_eos, tokenizer=tokenizer, chunk_steps=args.chunk_steps,
            options=options, on_tokens=streamer if stream else _first_seen(streamer),
            progress=bar)
    except (ValueError, MemoryError, FloatingPointError) as e:
        _fail(e)
    finally:
        bar.close()
    if jax.process_index() != 0:
        return 0
    s = dict(result.stats)
    s["first_token_from_start_s"] = (streamer.first_at or time.perf_counter()) - t_start
    if args.json:
        print(json.dumps(_json_safe({"model": args.model, "prompts": prompts,
                                     "tokens": result.tokens, "text": result.text, "stats": s}),
                         allow_nan=False))
        return 0
    if stream:
        streamer.finish(result.text[0])
    else:
        for i, text in enumerate(result.text):
            print(f"--- [{i}] {text}")
    print(stats_line(args.mode, s), file=sys.stderr)
    return 0


def _first_seen(streamer: Streamer):
    """An on_tokens that only notes when the first tokens arrived (nothing is streamed)."""
    def note(new):
        if streamer.first_at is None:
            streamer.first_at = time.perf_counter()
    return note


def stats_line(mode: Mode | str, s: dict) -> str:
    """The stats line: prompt tokens/s over the prefill time it is shown beside; the first
    token both from the request (compiles excluded) and from the command's start."""
    mode = Mode.parse(mode)
    prompt_tokens = sum(s["prompt_tokens"])
    rate = prompt_tokens / s["prefill_s"] if s["prefill_s"] > 0 else float("nan")
    line = (f"[{mode}] prefill {prompt_tokens} prompt tokens in {s['prefill_s']:.2f} s = "
            f"{rate:.0f} tokens/s | compile {s['compile_s']:.1f} s | "
            f"decode {s['decode_tokens']} tokens in {s['decode_s']:.2f} s = "
            f"{s['decode_tokens_per_s']:.1f} tokens/s | first token {s['ttft_s']:.2f} s "
            f"(compiles excluded), {s['first_token_from_start_s']:.2f} s after the command "
            "started")
    if mode is Mode.SFI and s.get("decode_path") == Mode.DENSE:
        line += " | decoded densely: every prompt + new tokens fit the SFI budget"
    elif mode is Mode.SFI:
        line += f" | slow/fast steps per row {s['slow_steps']}/{s['fast_steps']}"
        if s.get("decode_path") == "sfi+dense":
            line += f", dense steps (the rows still open fit the budget) {s['dense_steps']}"
    if mode is Mode.EXACT:
        line += (f" | verify steps per row {s['verify_steps']}, accepted/drafted "
                 f"{sum(s['accepted'])}/{sum(s['drafted'])}")
    return line
