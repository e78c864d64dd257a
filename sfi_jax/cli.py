"""Command line: `python -m sfi_jax.generate` (the entry point lives here so tests can import it
without shadowing the `sfi_jax.generate` function)."""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def build_parser() -> argparse.ArgumentParser:
    from sfi_jax.config import POLICIES

    p = argparse.ArgumentParser(
        prog="python -m sfi_jax.generate",
        description="Generate text with Slow-Fast Inference (or dense decoding). With no "
                    "arguments it runs the embedded SmolLM2-135M-Instruct on an example prompt.")
    p.add_argument("--model", default="smollm2-135m",
                   help="preset name (smollm2-135m = embedded real weights; qwen3-* = random "
                        "weights), local Hugging Face or Orbax directory, .gguf file, or hub id")
    p.add_argument("--tokenizer", default=None,
                   help="where to load the tokenizer from (default: the model source)")
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt; repeat the flag for a batch of prompts")
    p.add_argument("--prompt-file", default=None,
                   help="file with one prompt per line, or JSONL with a 'prompt' field per line")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each prompt with the tokenizer's chat template (default: on for "
                        "the built-in example prompt, off otherwise)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--mode", choices=("sfi", "dense", "exact"), default="sfi",
                   help="decoding mode (exact: SFI fast steps draft, a dense step verifies; "
                   "the tokens are dense decoding's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k best tokens (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--k-major", choices=("auto", "on", "off"), default="auto",
                   help="store the output and dense MLP weights transposed for the K-major "
                        "decode kernel (one GPU: faster for small models decoding up to 4 "
                        "prompts, slower for larger ones; benchmarks/kmajor.md). auto: on where "
                        "it was measured faster (load_model's k_major_pays)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights and KV cache dtype (auto: float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--impl", default=None, choices=("auto", "xla", "pallas_gpu", "pallas_tpu"),
                   help="attention kernels (a shortcut for --opt attention=IMPL)")
    p.add_argument("--opt", action="append", default=[], metavar="FIELD=VALUE",
                   help="an engine option (a field of sfi_jax.EngineOptions, e.g. moe=xla or "
                        "layer_unroll=all); repeat the flag for several")
    p.add_argument("--no-stop-at-eos", dest="stop_at_eos", action="store_false",
                   help="keep generating after the end-of-sequence token")
    p.add_argument("--chunk-steps", type=int, default=32,
                   help="decode steps per device call (text streams between calls)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with tokens, text and stats instead of text")
    g = p.add_argument_group("SFI (defaults from the paper)")
    g.add_argument("--n-sink", type=int, default=4, help="sink tokens per head")
    g.add_argument("--n-recent", type=int, default=256, help="recent-window tokens")
    g.add_argument("--k-select", type=int, default=2048, help="selected tokens per KV head")
    g.add_argument("--t-max", type=int, default=64, help="max steps between slow steps")
    g.add_argument("--policy", choices=POLICIES, default="sfi",
                   help="refresh policy (sfi; or a baseline: tmax, streaming, prefill_only, oracle)")
    g.add_argument("--draft-len", type=int, default=3,
                   help="exact mode: fast steps drafted per dense verify step (1..15)")
    g.add_argument("--successor-radius", type=int, default=0,
                   help="extension: also keep the next N positions after strong ones (helps "
                        "copying, e.g. pass keys; 0 = the method as specified)")
    g.add_argument("--evidence-window", type=int, default=1,
                   help="extension: select from each layer's last W decode queries (1 = as "
                        "specified)")
    g.add_argument("--refresh-rows", type=int, default=None,
                   help="rows refreshed per step at most (default: the whole batch)")
    c = p.add_argument_group("caches")
    c.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="JAX's persistent compilation cache: a second run skips compiling "
                        "(default: $SFI_JAX_CACHE_DIR/jax, else $XDG_CACHE_HOME/sfi_jax/jax, "
                        "else ~/.cache/sfi_jax/jax)")
    c.add_argument("--no-compile-cache", dest="compile_cache_off", action="store_true",
                   help="compile every program afresh")
    d = p.add_argument_group("multi-device / multi-host")
    d.add_argument("--mesh", default=None,
                   help="device mesh as data x model (x expert), e.g. '2x4' or '1x4x2'; the "
                        "sizes multiply to the number of devices (default: one device)")
    d.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (multi-host TPU / GPU: run "
                        "the same command on every host; needs --mesh)")
    return p


def read_prompts(args) -> tuple[list[str], bool]:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if line.lstrip().startswith("{"):
                    try:
                        prompts.append(json.loads(line)["prompt"])
                    except (json.JSONDecodeError, KeyError) as e:
                        raise SystemExit(f"{args.prompt_file}:{n}: expected a JSON object with a "
                                         f"'prompt' field ({e})")
                else:
                    prompts.append(line)
    if prompts:
        return prompts, bool(args.chat)
    return [DEFAULT_PROMPT], args.chat is not False


def _compile_cache(args) -> None:
    from sfi_jax.cache import default_compilation_cache_dir, enable_compilation_cache

    if args.compile_cache_off:
        if args.compile_cache:
            raise SystemExit("error: --compile-cache and --no-compile-cache contradict each other")
        return
    directory = args.compile_cache or default_compilation_cache_dir()
    if directory:
        enable_compilation_cache(directory)


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
    parser = build_parser()
    args = parser.parse_args(argv)
    options = engine_options(parser, args)
    _compile_cache(args)  # before anything is compiled
    if args.distributed:
        import jax

        jax.distributed.initialize()
    import jax
    import numpy as np

    import sfi_jax
    from sfi_jax.config import SFIConfig

    prompts, chat = read_prompts(args)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    try:
        sfi = SFIConfig(n_sink=args.n_sink, n_recent=args.n_recent, k_select=args.k_select,
                        t_max=args.t_max, policy=args.policy, refresh_rows=args.refresh_rows,
                        successor_radius=args.successor_radius,
                        evidence_window=args.evidence_window, draft_len=args.draft_len)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    mesh = None
    if args.distributed and not args.mesh and jax.process_count() > 1:
        raise SystemExit(f"error: --distributed with {jax.process_count()} processes needs "
                         f"--mesh DxM covering all {jax.device_count()} devices")
    if args.mesh:
        from sfi_jax.models.sharding import make_mesh

        try:
            mesh = make_mesh(args.mesh)
        except ValueError as e:
            raise SystemExit(f"error: --mesh: {e}")
    try:
        k_major = {"on": True, "off": False}.get(args.k_major, "auto")
        model = sfi_jax.load_model(args.model, dtype=dtype, mesh=mesh, k_major=k_major,
                                   decode_rows=len(prompts))
        tokenizer = sfi_jax.load_tokenizer(args.tokenizer or args.model)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")
    if chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    stream = not args.json and len(prompts) == 1 and jax.process_index() == 0
    printed = [""]
    got: list[int] = []

    def on_tokens(new):
        if not stream:
            return
        got.extend(new[0])
        text = tokenizer.decode(got, skip_special_tokens=True)
        if text.startswith(printed[0]):
            sys.stdout.write(text[len(printed[0]):])
            sys.stdout.flush()
            printed[0] = text

    bar = _PrefillBar(enabled=jax.process_index() == 0 and not args.json)
    try:
        result = sfi_jax.generate(
            model, prompts, max_new_tokens=args.max_new_tokens, mode=args.mode, sfi=sfi,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            stop_at_eos=args.stop_at_eos, tokenizer=tokenizer, chunk_steps=args.chunk_steps,
            options=options, on_tokens=on_tokens, progress=bar)
    except (ValueError, MemoryError, FloatingPointError) as e:
        raise SystemExit(f"error: {e}")
    finally:
        bar.close()
    if jax.process_index() != 0:
        return 0
    s = result.stats
    if args.json:
        stats = {k: (v.astype(int).tolist() if isinstance(v, np.ndarray) else v)
                 for k, v in s.items()}
        print(json.dumps({"model": args.model, "prompts": prompts, "tokens": result.tokens,
                          "text": result.text, "stats": stats}))
        return 0
    if stream:
        print()
    else:
        for i, text in enumerate(result.text):
            print(f"--- [{i}] {text}")
    line = (f"[{args.mode}] prefill {s['prefill_s']:.2f} s | compile {s['compile_s']:.1f} s | "
            f"decode {s['decode_tokens']} tokens in {s['decode_s']:.2f} s = "
            f"{s['decode_tokens_per_s']:.1f} tokens/s | first token {s['ttft_s']:.2f} s "
            f"({s['prefill_tokens_per_s']:.0f} prompt tokens/s)")
    if args.mode == "sfi":
        line += f" | slow/fast steps per row {s['slow_steps']}/{s['fast_steps']}"
    if args.mode == "exact":
        line += (f" | verify steps per row {s['verify_steps']}, accepted/drafted "
                 f"{sum(s['accepted'])}/{sum(s['drafted'])}")
    print(line, file=sys.stderr)
    return 0
