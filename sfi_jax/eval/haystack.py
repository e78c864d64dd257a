"""Haystack text for the retrieval suite, from sources every install has offline.

Each source is a list of units (a line of code, a paragraph) joined by a separator; a haystack is
a run of whole units from a seeded start. None of them is the King James text that the
teacher-forced evaluation uses:

- "code": the Python standard library's top-level modules (source lines);
- "docstrings": the docstrings of those modules, their classes and functions (paragraphs);
- "licenses": Python's LICENSE.txt and the license files of sfi_jax's dependencies
  (site-packages *.dist-info), paragraphs;
- "generated": sentences from a small seeded grammar (no real text at all).

The standard library and the installed dependencies differ between Python versions and
environments, so a haystack is reproducible for a given environment (the report records it).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import os
import random
import sysconfig

SOURCES = ("code", "docstrings", "licenses", "generated")
_MAX_CHARS = 600_000  # per source: enough for many 8K haystacks, cheap to tokenize
_LICENSE_PACKAGES = ("jax", "jaxlib", "flax", "numpy", "safetensors", "transformers",
                     "huggingface_hub", "gguf", "orbax_checkpoint", "tqdm", "jinja2",
                     "tokenizers", "markupsafe", "ml_dtypes", "opt_einsum", "scipy")


@dataclasses.dataclass
class Haystack:
    """Units of one source, in order, with the separator that joins them."""

    name: str
    units: list[str]
    sep: str

    def __post_init__(self):
        if not self.units:
            raise ValueError(f"haystack source {self.name!r} is empty")


def _stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(root, "*.py")))


def _read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _paragraphs(text: str) -> list[str]:
    out = []
    for p in text.split("\n\n"):
        p = " ".join(p.split())
        if len(p) >= 40:
            out.append(p)
    return out


def _code() -> Haystack:
    lines, size = [], 0
    for path in _stdlib_files():
        for line in _read(path).splitlines():
            if line.strip():
                lines.append(line.rstrip())
                size += len(line)
        if size > _MAX_CHARS:
            break
    return Haystack("code", lines, "\n")


def _docstrings() -> Haystack:
    paras, size = [], 0
    for path in _stdlib_files():
        try:
            tree = ast.parse(_read(path))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                for p in _paragraphs(doc or ""):
                    paras.append(p)
                    size += len(p)
        if size > _MAX_CHARS:
            break
    return Haystack("docstrings", paras, "\n\n")


def _licenses() -> Haystack:
    stdlib = sysconfig.get_paths()["stdlib"]
    site = sysconfig.get_paths()["purelib"]
    files = [os.path.join(stdlib, "LICENSE.txt")]
    for pkg in _LICENSE_PACKAGES:
        for info in sorted(glob.glob(os.path.join(site, f"{pkg}-*.dist-info"))):
            files += sorted(f for f in glob.glob(os.path.join(info, "**", "*"), recursive=True)
                            if os.path.isfile(f) and ("LICENSE" in os.path.basename(f).upper()
                                                      or "COPYING" in os.path.basename(f).upper()))
    paras: list[str] = []
    for f in files:
        if os.path.exists(f):
            paras += _paragraphs(_read(f))
    return Haystack("licenses", paras, "\n\n")


_SUBJ = ("The old mill", "A quiet village", "The northern road", "Every winter", "The market",
         "A narrow bridge", "The harbour", "Most travellers", "The library", "A small garden",
         "The east wind", "The night train", "Each morning", "The clock tower", "The valley")
_VERB = ("stands near", "looks over", "leads past", "waits beside", "turns toward", "hides behind",
         "opens onto", "rests under", "winds around", "reaches across")
_OBJ = ("the grey hills", "a field of barley", "the frozen lake", "an empty square",
        "the pine forest", "a row of cottages", "the stone wall", "the slow river", "a crowded inn",
        "the far coast")
_TAIL = ("and nobody remembers why.", "as it always has.", "in the pale light.",
         "before the rain comes.", "while the bells ring.", "long after dusk.", "without a sound.",
         "for most of the year.")


def _generated(seed: int = 0, n: int = 40_000) -> Haystack:
    rng = random.Random(f"generated-{seed}")
    sents = [f"{rng.choice(_SUBJ)} {rng.choice(_VERB)} {rng.choice(_OBJ)} {rng.choice(_TAIL)}"
             for _ in range(n)]
    return Haystack("generated", sents, " ")


@functools.lru_cache(maxsize=None)
def load_haystack(name: str) -> Haystack:
    """One of SOURCES, read once per process."""
    makers = {"code": _code, "docstrings": _docstrings, "licenses": _licenses,
              "generated": _generated}
    if name not in makers:
        raise ValueError(f"unknown haystack source {name!r}; choose one of {SOURCES}")
    return makers[name]()


class TokenHaystack:
    """A Haystack's units tokenized (lazily, each with its separator in front), to cut runs of
    whole units of a token budget."""

    def __init__(self, hay: Haystack, tokenizer):
        self.hay = hay
        self.tokenizer = tokenizer
        self._ids: dict[int, list[int]] = {}

    def unit_ids(self, i: int) -> list[int]:
        i %= len(self.hay.units)
        if i not in self._ids:
            self._ids[i] = self.tokenizer(self.hay.sep + self.hay.units[i],
                                          add_special_tokens=False)["input_ids"]
        return self._ids[i]

    def run(self, start: int, n_tokens: int) -> list[int]:
        """Unit indices from `start` (wrapping) whose tokens total <= n_tokens."""
        out, used, i = [], 0, start
        while len(out) < len(self.hay.units):
            n = len(self.unit_ids(i))
            if used + n > n_tokens:
                break
            out.append(i % len(self.hay.units))
            used += n
            i += 1
        return out
