"""Retrieval tasks built from long natural text: passkey, needle-in-a-haystack (single, multi-key,
multi-value) and variable tracking.

Every sample is a prompt (haystack with the needles, then the question) plus a fixed lead-in
that the decoder is fed (teacher-forced) before the answer, e.g. " The pass key is". The answer
itself is generated after the lead-in, so for SFI its tokens come from fast decode steps: the
first decode step (always slow) only feeds the first lead-in token, and the lead-in holds no
trigger token. The needle therefore has to be in the set the slow step selected.
"""

from __future__ import annotations

import dataclasses
import random
import re

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
_WORDS_A = ("gentle", "silver", "quiet", "bright", "hollow", "amber", "frozen", "golden", "rapid",
            "misty", "crimson", "lonely", "ancient", "polished", "sudden", "humble")
_WORDS_B = ("river", "lantern", "meadow", "falcon", "harbor", "violin", "compass", "orchard",
            "glacier", "pepper", "canyon", "ribbon", "thimble", "beacon", "walnut", "saddle")


@dataclasses.dataclass
class RetrievalSample:
    """prompt_ids: haystack + question; lead_in_ids: fed before the answer; answers: the values
    that must all appear in the generated answer (order free); needle_spans: [start, end) token
    ranges of each needle in prompt_ids; depth: needle position as a fraction of the haystack."""

    task: str
    prompt_ids: list[int]
    lead_in_ids: list[int]
    answers: list[str]
    needle_spans: list[tuple[int, int]]
    depth: float
    answer_tokens: int  # tokens to generate after the lead-in

    @property
    def max_new_tokens(self) -> int:
        return len(self.lead_in_ids) + self.answer_tokens

    def onset(self) -> "RetrievalSample":
        """The same sample with the lead-in moved into the prompt: the answer is the first thing
        generated (its first token from the prefill, its second from the first decode step)."""
        return dataclasses.replace(self, prompt_ids=self.prompt_ids + self.lead_in_ids,
                                   lead_in_ids=[])


def _number(rng, digits):
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def _key(rng, used, first=_WORDS_A, second=_WORDS_B):
    while True:
        k = f"{rng.choice(first)}-{rng.choice(second)}"
        if k not in used:
            used.add(k)
            return k


def _var(rng, used):
    while True:
        v = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if v not in used:
            used.add(v)
            return v


def _spec(task, rng):
    """needles (sentences), question, lead-in and answers of one sample."""
    used: set = set()
    if task == "passkey":
        key = _number(rng, 5)
        needles = [f" The pass key is {key}. Remember it. {key} is the pass key."]
        return needles, "What is the pass key?", " The pass key is", [key]
    if task == "niah_single":
        k, v = _key(rng, used), _number(rng, 7)
        needles = [f" One of the special magic numbers for {k} is: {v}."]
        return (needles, f"What is the special magic number for {k} mentioned in the provided text?",
                f" The special magic number for {k} is", [v])
    if task == "niah_multikey":
        keys = [_key(rng, used) for _ in range(4)]
        vals = [_number(rng, 7) for _ in keys]
        needles = [f" One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, vals)]
        k = keys[0]
        return (needles, f"What is the special magic number for {k} mentioned in the provided text?",
                f" The special magic number for {k} is", [vals[0]])
    if task == "niah_multivalue":
        k = _key(rng, used)
        vals = [_number(rng, 7) for _ in range(2)]
        needles = [f" One of the special magic numbers for {k} is: {v}." for v in vals]
        return (needles, f"What are all the special magic numbers for {k} mentioned in the provided "
                "text?", f" The special magic numbers for {k} are", vals)
    if task == "vartrack":
        names = [_var(rng, used) for _ in range(3)]
        value = _number(rng, 5)
        needles = [f" VAR {names[0]} = {value}."] + [
            f" VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        return (needles, f"Find all variables that are assigned the value {value} in the text "
                "above.", f" The variables assigned the value {value} are: VAR", names)
    raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")


TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "vartrack")
ANSWER_TOKENS = {"passkey": 8, "niah_single": 10, "niah_multikey": 10, "niah_multivalue": 20,
                 "vartrack": 16}


def make_sample(task: str, text, tokenizer, context: int, *, seed: int, depth: float | None = None,
                chat: bool = False, new_tokens: int | None = None) -> RetrievalSample:
    """A sample whose prompt + lead-in + answer (or + lead-in + new_tokens, if larger) fit in
    `context`, with the lead-in either generated or (`onset()`) part of the prompt.

    text: a `TokenText`. Needles go between whole verses: at `depth` (fraction of the haystack;
    random in [0.05, 0.9] when None) for one needle, spread over the haystack for several (the
    first one at `depth`). chat=True wraps the prompt in the tokenizer's chat template.
    """
    rng = random.Random(f"{task}-{context}-{seed}")
    needles, question, lead_in, answers = _spec(task, rng)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    if chat:
        head = enc("<|im_start|>user\n" + INTRO)
        tail = enc("\n" + question + "<|im_end|>\n<|im_start|>assistant\n")
        lead = enc(lead_in.lstrip())
    else:
        head = enc(INTRO)
        tail = enc("\n" + question + "\nAnswer:")
        lead = enc(lead_in)
    needle_ids = [enc(n) for n in needles]
    reserve = len(lead) + max(ANSWER_TOKENS[task], new_tokens or 0)
    budget = context - len(head) - len(tail) - reserve - sum(len(n) for n in needle_ids)
    if budget < 64:
        raise ValueError(f"context {context} is too short for task {task!r}")
    start = rng.randrange(len(text.starts))
    verses = text.verse_span(start, budget)
    depth = rng.uniform(0.05, 0.9) if depth is None else float(depth)
    n = len(needle_ids)
    if task == "vartrack":  # a chain, in order, spread over the haystack
        spots = [depth + (1 - depth) * 0.9 * i / n for i in range(n)]
    elif n > 1:
        spots = [depth] + [rng.uniform(0.05, 0.9) for _ in range(n - 1)]
    else:
        spots = [depth]
    cut = sorted(((round(s * len(verses)), i) for i, s in enumerate(spots)), key=lambda t: t)
    ids, spans, vi = list(head), [None] * n, 0
    for at, i in cut:
        while vi < at:
            ids.extend(verses[vi])
            vi += 1
        spans[i] = (len(ids), len(ids) + len(needle_ids[i]))
        ids.extend(needle_ids[i])
    for v in verses[vi:]:
        ids.extend(v)
    ids.extend(tail)
    return RetrievalSample(task=task, prompt_ids=ids, lead_in_ids=lead, answers=answers,
                           needle_spans=spans, depth=depth, answer_tokens=ANSWER_TOKENS[task])


_NUM = re.compile(r"\d+")
_NAME = re.compile(r"\b[A-Z]{5}\b")


def extract_answers(task: str, text: str) -> list[str]:
    """Values named in a generated answer (numbers, or variable names for vartrack)."""
    return _NAME.findall(text) if task == "vartrack" else _NUM.findall(text)
