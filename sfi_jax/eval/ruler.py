"""A RULER-style retrieval suite: needles in haystacks of several offline text sources.

Tasks (RULER's names in brackets):
- "niah_single": one key -> number sentence in the haystack, asked for its number [niah_single];
- "niah_multikey": four such sentences with different keys, asked for one [niah_multikey];
- "niah_multivalue": two numbers for the same key, both asked for [niah_multivalue];
- "vartrack": a chain VAR A = n, VAR B = VAR A, ... spread over the haystack, asked for every
  variable that holds n [vt];
- "json_kv": the context is a JSON object of random keys and numbers, asked for one key's value;
- "code_line": the haystack is standard-library source; asked to copy the line that defines a
  function or class (defined once there), given up to the name: the answer is the signature.

Every prompt ends with its answer's lead-in (" The special magic number for ... is"), so the
answer is the first thing generated. A sample is determined by (task, context, seed) and the
environment's text sources (`haystack`). Scoring is exact: the first number generated (or the
rest of the line, for code_line) must equal the answer; multi-answer tasks need every value.
"""

from __future__ import annotations

import dataclasses
import random
import re

from sfi_jax.eval import tasks
from sfi_jax.eval.haystack import SOURCES, TokenHaystack, load_haystack
from sfi_jax.eval.tasks import _number, _var

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vartrack", "json_kv", "code_line")
ANSWER_TOKENS = {"niah_single": 9, "niah_multikey": 9, "niah_multivalue": 25, "vartrack": 17,
                 "json_kv": 9, "code_line": 17}
"""Tokens generated per task: the answer with room to spare (digits are single tokens; the
model lists multiple values as "\\n\\n- 123456\\n- 654321")."""
TEXT_SOURCES = {"niah_single": SOURCES, "niah_multikey": SOURCES, "niah_multivalue": SOURCES,
                "vartrack": SOURCES, "json_kv": ("json",), "code_line": ("code",)}
"""The haystack source of sample i is TEXT_SOURCES[task][i % len(...)]."""

HEAD = ("Below is a long text. Some important information is hidden inside it. Find it and "
        "memorize it; you will be asked about it.\n\n")
_A = ("gentle", "silver", "quiet", "bright", "hollow", "amber", "frozen", "golden", "rapid",
      "misty", "crimson", "lonely", "ancient", "polished", "sudden", "humble", "velvet", "bitter")
_B = ("river", "lantern", "meadow", "falcon", "harbor", "violin", "compass", "orchard", "glacier",
      "pepper", "canyon", "ribbon", "thimble", "beacon", "walnut", "saddle", "marble", "sparrow")


@dataclasses.dataclass
class Sample:
    """prompt_ids end with the answer's lead-in; answers: the values the answer must hold;
    needle_spans: [start, end) token ranges of the needles in prompt_ids."""

    task: str
    source: str
    seed: int
    prompt_ids: list[int]
    answers: list[str]
    needle_spans: list[tuple[int, int]]
    depth: float
    answer_tokens: int


def _key(rng, used):
    return tasks._key(rng, used, _A, _B)


def _needles(task, rng):
    """(needle sentences, question, lead-in, answers) of the haystack tasks."""
    used: set = set()
    magic = "One of the special magic numbers for {} is: {}."
    if task == "niah_single":
        k, v = _key(rng, used), _number(rng, 6)
        return ([magic.format(k, v)], f"What is the special magic number for {k} mentioned in "
                "the provided text?", f" The special magic number for {k} is", [v])
    if task == "niah_multikey":
        keys = [_key(rng, used) for _ in range(4)]
        vals = [_number(rng, 6) for _ in keys]
        return ([magic.format(k, v) for k, v in zip(keys, vals)],
                f"What is the special magic number for {keys[0]} mentioned in the provided text?",
                f" The special magic number for {keys[0]} is", vals[:1])
    if task == "niah_multivalue":
        k = _key(rng, used)
        vals = [_number(rng, 6) for _ in range(2)]
        return ([magic.format(k, v) for v in vals], f"What are all the special magic numbers for "
                f"{k} mentioned in the provided text?",
                f" The special magic numbers for {k} are", vals)
    if task == "vartrack":
        names = [_var(rng, used) for _ in range(3)]
        value = _number(rng, 5)
        return ([f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}."
                                                   for a, b in zip(names, names[1:])],
                f"Find all variables that are assigned the value {value} in the text above.",
                f" The variables assigned the value {value} are: VAR", names)
    raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")


def _encoder(tokenizer):
    return lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]


def _haystack_sample(task, source, tokenizer, context, rng, depth, reserve):
    enc = _encoder(tokenizer)
    needles, question, lead_in, answers = _needles(task, rng)
    hay = TokenHaystack(load_haystack(source), tokenizer)
    sep = hay.hay.sep
    head, tail = enc(HEAD), enc("\n\n" + question + "\nAnswer:" + lead_in)
    needle_ids = [enc(sep + n) for n in needles]
    budget = context - len(head) - len(tail) - reserve - sum(map(len, needle_ids))
    if budget < 64:
        raise ValueError(f"context {context} is too short for task {task!r}")
    units = hay.run(rng.randrange(len(hay.hay.units)), budget)
    n = len(needle_ids)
    if task == "vartrack":  # the chain in order, spread over the rest of the haystack
        spots = [depth + (1 - depth) * 0.9 * i / n for i in range(n)]
    else:
        spots = [depth] + [rng.uniform(0.05, 0.9) for _ in range(n - 1)]
    cut = sorted((round(s * len(units)), i) for i, s in enumerate(spots))
    ids, spans, u = list(head), [None] * n, 0
    for at, i in cut:
        for j in units[u:at]:
            ids += hay.unit_ids(j)
        u = max(u, at)
        spans[i] = (len(ids), len(ids) + len(needle_ids[i]))
        ids += needle_ids[i]
    for j in units[u:]:
        ids += hay.unit_ids(j)
    return ids + tail, answers, spans


def _json_sample(tokenizer, context, rng, depth, reserve):
    """A JSON object of '"key": number' lines filling the context; one key is asked for."""
    enc = _encoder(tokenizer)
    used: set = set()

    def pair():
        while True:
            k = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6))
            if k not in used:
                used.add(k)
                return k, _number(rng, 5)

    pairs, lines, n_tok = [], [], 0
    head = enc("Below is a JSON object of keys and values. Memorize it; you will be asked "
               "about one key.\n\n{")
    probe = enc("\n}\n\nWhat is the value of the key \"abcdef\" in the JSON object above?\n"
                "Answer: The value of \"abcdef\" is")
    budget = context - len(head) - len(probe) - reserve
    while True:
        k, v = pair()
        line = enc(f'\n  "{k}": {v},')
        if n_tok + len(line) > budget:
            break
        pairs.append((k, v))
        lines.append(line)
        n_tok += len(line)
    if len(pairs) < 8:
        raise ValueError(f"context {context} is too short for task 'json_kv'")
    last = lambda k, v: enc(f'\n  "{k}": {v}')  # noqa: E731  (no comma after the last pair)
    lines[-1] = last(*pairs[-1])
    at = min(int(depth * len(pairs)), len(pairs) - 1)
    key, value = pairs[at]
    tail = enc(f"\n}}\n\nWhat is the value of the key \"{key}\" in the JSON object above?\n"
               f"Answer: The value of \"{key}\" is")

    def build():
        ids = list(head)
        for i, line in enumerate(lines):
            if pairs[i][0] == key:
                span = (len(ids), len(ids) + len(line))
            ids += line
        return ids + tail, span

    ids, span = build()
    while len(ids) + reserve > context:  # the asked key took more tokens than the probe's
        if len(pairs) <= 8:
            raise ValueError(f"context {context} is too short for task 'json_kv'")
        j = len(pairs) - 1 if pairs[-1][0] != key else len(pairs) - 2
        del pairs[j], lines[j]
        lines[-1] = last(*pairs[-1])
        ids, span = build()
    return ids, [value], [span]


_DEF = re.compile(r"^(?:async\s+)?(def|class)\s+(\w+)")
_CODE_TRIES = 200


def _code_sample(tokenizer, context, rng, depth, reserve):
    """A run of standard-library source; asked to copy the line that defines a function or class
    whose name is defined once there. The lead-in gives the line up to its name's bracket, so
    the answer is the rest of the line (the signature)."""
    enc = _encoder(tokenizer)
    hay = TokenHaystack(load_haystack("code"), tokenizer)
    head = enc("Below is some Python source code. You will be asked to copy one of its lines."
               "\n\n")
    tail_len = 48 + 2 * 16  # the question and the answer's lead-in, each naming the definition
    budget = context - len(head) - tail_len - reserve
    def split(lines, names, i):  # (lead-in part, answer part) of a usable definition line
        m = _DEF.match(lines[i])
        if not m or names[m.group(2)] != 1:
            return None
        cut = m.end() + 1 if lines[i][m.end():m.end() + 1] in "(:" else m.end()
        head_, rest = lines[i][:cut], lines[i][cut:]
        if "`" in lines[i] or not 4 <= len(rest) <= 60 or len(enc(rest)) > reserve - 3:
            return None
        return head_, rest

    # A run may hold no usable definition (a data table, or only long signatures): start
    # elsewhere until one does.
    for _ in range(_CODE_TRIES):
        units = hay.run(rng.randrange(len(hay.hay.units)), budget)
        lines = [hay.hay.units[u].strip() for u in units]
        names: dict = {}
        for line in lines:
            m = _DEF.match(line)
            if m:
                names[m.group(2)] = names.get(m.group(2), 0) + 1
        want = int(depth * len(lines))
        order = sorted(range(len(lines)), key=lambda i: (abs(i - want), i))
        i = next((i for i in order if split(lines, names, i)), None)
        if i is not None:
            break
    else:
        raise ValueError(f"no unique definition to ask about in {_CODE_TRIES} code haystacks "
                         f"(context {context})")
    lead, rest = split(lines, names, i)
    name = _DEF.match(lines[i]).group(2)
    ids = list(head)
    for j in units:
        if j == units[i]:
            span = (len(ids), len(ids) + len(hay.unit_ids(j)))
        ids += hay.unit_ids(j)
    ids += enc(f"\n\nCopy the line of the code above that defines `{name}`, exactly, between "
               f"backticks.\nAnswer: `{lead}")
    return ids, [rest], [span]


def make_sample(task: str, tokenizer, context: int, *, seed: int, index: int = 0,
                depth: float | None = None) -> Sample:
    """Sample `index` of `task` at `context` tokens (prompt + answer_tokens <= context).

    The source rotates with index over TEXT_SOURCES[task]; depth (the first needle's position as
    a fraction of the haystack) is random in [0.05, 0.9] when None.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    rng = random.Random(f"ruler-{task}-{context}-{seed}-{index}")
    depth = rng.uniform(0.05, 0.9) if depth is None else float(depth)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    sources = TEXT_SOURCES[task]
    source = sources[index % len(sources)]
    reserve = ANSWER_TOKENS[task]
    if task == "json_kv":
        ids, answers, spans = _json_sample(tokenizer, context, rng, depth, reserve)
    elif task == "code_line":
        ids, answers, spans = _code_sample(tokenizer, context, rng, depth, reserve)
    else:
        ids, answers, spans = _haystack_sample(task, source, tokenizer, context, rng, depth,
                                               reserve)
    if len(ids) + reserve > context:
        raise ValueError(f"sample of {task!r} is {len(ids)} + {reserve} tokens, over the "
                         f"context {context}")
    return Sample(task=task, source=source, seed=seed, prompt_ids=ids, answers=answers,
                  needle_spans=spans, depth=depth, answer_tokens=reserve)


_NUM = re.compile(r"\d+")
_NAME = re.compile(r"\b[A-Z]{5}\b")


def score(task: str, answers: list[str], generated: str) -> bool:
    """Exact match. code_line: the first non-empty generated line, stripped, equals the answer
    line; single-number tasks: the first number generated equals the answer; niah_multivalue and
    vartrack: every expected value is among the numbers (names) generated."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    if task == "code_line":  # the line's rest, up to the closing backtick or the line's end
        first = generated.split("\n")[0].split("`")[0]
        return first.strip() == answers[0].strip()
    found = _NAME.findall(generated) if task == "vartrack" else _NUM.findall(generated)
    if len(answers) == 1:
        return bool(found) and found[0] == answers[0]
    return all(a in found for a in answers)
