"""A/B engine variants end to end: bench_e2e.py once per variant, each in its own process
(XLA flags are read once per process), then one comparison table.

    python scripts/bench/bench_variants.py --out /tmp/ab \\
        --variant base= --variant xla_repack=repack=xla \\
        --variant radix=selector_topk=radix,XLA_FLAGS=--xla_gpu_enable_command_buffer= \\
        -- --models qwen3-4b --contexts 131072,8192 --no-check

A variant is NAME=[SETTING,...]: a lower-case FIELD=VALUE is an engine option (a field of
sfi_jax.EngineOptions, passed as bench_e2e's `--opt FIELD=VALUE`), an upper-case VAR=VALUE an
environment variable of the variant's process.

--args NAME=ARGS adds bench_e2e arguments to one variant (after the shared ones).
--tree NAME=DIR runs one variant from another checkout (its scripts/bench/bench_e2e.py, or
scripts/bench/bench_e2e.py in a checkout from before the scripts were grouped, which imports that
checkout's package): an A/B against an earlier commit, e.g. after
`git worktree add /tmp/base HEAD~1`, `--variant base= --tree base=/tmp/base`.

Each variant writes <out>/<name>.json (bench_e2e's e2e.json) and <name>.log; the table goes to
stdout and <out>/variants.md. A variant that fails or runs past --timeout is reported, not fatal.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_variant(text: str):
    """'name=K1=V1,K2=V2' -> (name, {K1: V1, K2: V2}); 'name=' changes nothing. A comma not
    followed by KEY= belongs to the value (XLA_FLAGS lists are comma-separated)."""
    name, _, rest = text.partition("=")
    if not name:
        raise SystemExit(f"--variant {text!r}: expected NAME=[VAR=VALUE,...]")
    env = {}
    for item in filter(None, re.split(r",(?=[A-Za-z_][A-Za-z0-9_]*=)", rest)):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--variant {text!r}: {item!r} is not KEY=VALUE")
        env[key] = value
    return name, env


def e2e_script(tree=None):
    """bench_e2e.py of this checkout or of the checkout at `tree` (either layout)."""
    if tree is None:
        return os.path.join(HERE, "bench_e2e.py")
    for rel in (("scripts", "bench", "bench_e2e.py"), ("scripts", "bench_e2e.py")):
        if os.path.exists(os.path.join(tree, *rel)):
            return os.path.join(tree, *rel)
    raise SystemExit(f"--tree {tree}: no scripts/bench/bench_e2e.py or scripts/bench/bench_e2e.py")


def split_settings(settings: dict):
    """A variant's settings -> (environment, bench_e2e arguments): lower-case keys are engine
    options (`--opt key=value`), upper-case ones environment variables."""
    env = {k: v for k, v in settings.items() if k.isupper()}
    opts = [a for k, v in settings.items() if not k.isupper() for a in ("--opt", f"{k}={v}")]
    return env, opts


def run_variant(name, settings, bench_args, out, timeout, extra=(), tree=None):
    script = e2e_script(tree)
    env, opts = split_settings(settings)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, script, "--out", tmp, *bench_args, *opts, *extra]
        with open(os.path.join(out, f"{name}.log"), "w") as log:
            try:
                rc = subprocess.run(cmd, env={**os.environ, **env}, stdout=log,
                                    stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        src = os.path.join(tmp, "e2e.json")
        if os.path.exists(src):  # bench_e2e writes after every context: keep partial runs
            shutil.copy(src, os.path.join(out, f"{name}.json"))
            return rc, json.load(open(src))["results"]
    return rc, []


def table(rows):
    head = ("| variant | model | ctx | batch | dense tok/s | SFI tok/s | speedup | fast step ms "
            "| SFI of floor | rc |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for name, rc, r in rows:
        if r is None:
            lines.append(f"| {name} | - | - | - | - | - | - | - | - | {rc} |")
            continue
        lines.append(f"| {name} | {r['model']} | {r['context']} | {r['batch']} | "
                     f"{r['dense_tokens_per_s']:.0f} | {r['sfi_tokens_per_s']:.0f} | "
                     f"{r['speedup']:.2f}x | {r['fast_step_s'] * 1e3:.2f} | "
                     f"{r['sfi_of_floor']:.2f} | {rc} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", required=True, metavar="NAME=[KEY=VALUE,...]")
    p.add_argument("--args", action="append", default=[], metavar="NAME=ARGS",
                   help="extra bench_e2e arguments for variant NAME (space-separated)")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="run variant NAME from the checkout at DIR")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per variant")
    args = p.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    variants = [parse_variant(v) for v in args.variant]
    if len({n for n, _ in variants}) != len(variants):
        raise SystemExit("variant names must be distinct")
    extra = {}
    for item in args.args:
        name, sep, rest = item.partition("=")
        if not sep or name not in {n for n, _ in variants}:
            raise SystemExit(f"--args {item!r}: expected NAME=ARGS for a --variant NAME")
        extra[name] = rest.split()
    trees = {}
    for item in args.tree:
        name, sep, tree = item.partition("=")
        if not sep or name not in {n for n, _ in variants}:
            raise SystemExit(f"--tree {item!r}: expected NAME=DIR for a --variant NAME")
        trees[name] = tree
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name, env in variants:
        rc, results = run_variant(name, env, bench_args, args.out, args.timeout,
                                  extra.get(name, ()), trees.get(name))
        rows += [(name, rc, r) for r in results] or [(name, rc, None)]
        print(f"{name}: rc={rc}, {len(results)} result(s)", flush=True)
    text = table(rows)
    with open(os.path.join(args.out, "variants.md"), "w") as f:
        trees_note = "".join(f"; {n} from {t}" for n, t in trees.items())
        f.write(f"Variants: {', '.join(args.variant)}{trees_note}\n\n"
                f"bench_e2e.py {' '.join(bench_args)}\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
