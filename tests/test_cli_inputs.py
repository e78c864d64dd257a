"""The command line's inputs and outputs: streamed text equals the final text for multi-byte
scripts, every bad input is one line before the model loads, Ctrl-C is one line, --json is
strict JSON, --help names every default, and the stats line's numbers agree with each other.

The model is never loaded here: `load_model` and `generate` are replaced (the tokenizer is the
real embedded one), so each case takes well under a second."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import re

import numpy as np
import pytest

import sfi_jax
from sfi_jax import cli
from sfi_jax.config import PAPER, SFIConfig
from sfi_jax.runtime.generation import GenerateResult

TEXTS = ["巴黎是哪个国家的首都？", "🔥🔥🔥🔥", "e\u0301 n\u0303o a\u0308\u0304", "naïve 東京 👩‍👩‍👧 ok",
         "ελληνικά и русский"]


@pytest.fixture(scope="module")
def tokenizer():
    return sfi_jax.load_tokenizer("smollm2-135m")


def _final_text(tokenizer, tokens, eos_ids):
    """The result's text as `generate` builds it: EOS ids dropped, special tokens skipped."""
    return tokenizer.decode([t for t in tokens if t not in eos_ids], skip_special_tokens=True)


# ---- streaming ----

@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_final_text(tokenizer, text, chunk):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text) // 2  # multi-byte characters span several tokens
    out = io.StringIO()
    streamer = cli.Streamer(tokenizer, out)
    writes = []
    for start in range(0, len(ids), chunk):
        streamer([ids[start:start + chunk]])
        writes.append(out.getvalue())
    assert all("\ufffd" not in w for w in writes)  # never a partial character
    streamer.finish(_final_text(tokenizer, ids, ()))
    assert out.getvalue() == text + "\n"


def test_text_cut_inside_a_character_ends_as_the_result_does(tokenizer):
    """max_new_tokens can stop in the middle of a character: the result then ends in U+FFFD,
    and so does the stream (nothing is lost, nothing added)."""
    ids = tokenizer("巴黎🔥", add_special_tokens=False)["input_ids"]
    for cut in range(1, len(ids) + 1):
        out = io.StringIO()
        streamer = cli.Streamer(tokenizer, out)
        for t in ids[:cut]:
            streamer([[t]])
        final = _final_text(tokenizer, ids[:cut], ())
        streamer.finish(final)
        assert out.getvalue() == final + "\n", cut


class _StubModel:
    def __init__(self, vocab_size=49152):
        self.config = argparse.Namespace(vocab_size=vocab_size)


@pytest.fixture()
def fake_run(monkeypatch, tokenizer):
    """The CLI with the real tokenizer and a stand-in model whose `generate` streams the
    given token ids in chunks of 3 (as decode chunks do) and returns them as the result."""
    calls = {"load_model": 0, "generate": 0}
    plan = {"tokens": [], "stats": {}, "interrupt_after": None}

    def load_model(*a, **k):
        calls["load_model"] += 1
        return _StubModel()

    def generate(model, prompts, *, on_tokens, tokenizer, **kw):
        calls["generate"] += 1
        calls["prompts"] = prompts
        calls["sfi"] = kw.get("sfi")
        tokens = plan["tokens"]
        on_tokens([[tokens[0]] for _ in prompts])
        for n, start in enumerate(range(1, len(tokens), 3)):
            if plan["interrupt_after"] == n:
                raise KeyboardInterrupt
            on_tokens([tokens[start:start + 3] for _ in prompts])
        eos = (2,)
        stats = {"mode": kw["mode"], "prompt_tokens": [5] * len(prompts), "prefill_s": 0.25,
                 "compile_s": 1.5, "decode_tokens": len(tokens) - 1, "decode_s": 0.5,
                 "decode_tokens_per_s": (len(tokens) - 1) / 0.5, "ttft_s": 0.3,
                 "prefill_tokens_per_s": 100.0, "slow_steps": [1] * len(prompts),
                 "fast_steps": [2] * len(prompts),
                 "slow_timeline": np.zeros((len(prompts), 3), bool), **plan["stats"]}
        return GenerateResult(tokens=[list(tokens)] * len(prompts),
                              text=[_final_text(tokenizer, tokens, eos)] * len(prompts),
                              stats=stats)

    monkeypatch.setattr(sfi_jax, "load_model", load_model)
    monkeypatch.setattr(sfi_jax, "load_tokenizer", lambda *a, **k: tokenizer)
    monkeypatch.setattr(sfi_jax, "generate", generate)
    return calls, plan


def test_cli_streams_exactly_the_result_text(fake_run, tokenizer, capsys):
    calls, plan = fake_run
    text = "".join(TEXTS)
    plan["tokens"] = tokenizer(text, add_special_tokens=False)["input_ids"] + [2]
    assert cli.main(["--prompt", "hi", "--no-compile-cache", "--mode", "dense"]) == 0
    out, err = capsys.readouterr()
    assert out == text + "\n"
    assert calls["generate"] == 1
    assert "after the command started" in err


@pytest.mark.parametrize("argv,want", [
    ([], SFIConfig()),
    (["--paper"], SFIConfig.paper()),
    (["--successor-radius", "0", "--warmup-steps", "0", "--selection-memory", "off"],
     SFIConfig.paper()),
    (["--paper", "--warmup-steps", "8"], SFIConfig.paper(warmup_steps=8)),
    (["--selection-memory", "0.5"], SFIConfig(selection_memory=0.5)),
    (["--successor-radius", "3", "--evidence-window", "4"],
     SFIConfig(successor_radius=3, evidence_window=4)),
])
def test_sfi_flags_default_to_sfi_config(fake_run, tokenizer, argv, want):
    """The CLI's SFI defaults are SFIConfig's (its extensions too); --paper, or each
    extension's flag at its off value, is the paper's method; a flag given wins over --paper."""
    calls, plan = fake_run
    plan["tokens"] = tokenizer("ok", add_special_tokens=False)["input_ids"] + [2]
    assert cli.main(["--prompt", "hi", "--no-compile-cache", *argv]) == 0
    assert calls["sfi"] == want


# ---- bad input: one line, before the model loads ----

def _error(argv, capsys=None) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    message = e.value.code
    assert isinstance(message, str) and message.startswith("error: "), message
    assert "\n" not in message
    return message


@pytest.fixture()
def no_model(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(sfi_jax, "load_model", fail)
    monkeypatch.setattr(sfi_jax, "load_tokenizer", fail)
    monkeypatch.setattr(sfi_jax, "generate", fail)


def _file(tmp_path, content, name="prompts.txt"):
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return str(path)


@pytest.mark.parametrize("content", ["", "\n\n", "   \n\t\n  "])
def test_empty_prompt_file(no_model, tmp_path, content):
    path = _file(tmp_path, content)
    assert f"the prompt file {path} holds no prompt" in _error(["--prompt-file", path])


@pytest.mark.parametrize("line,expected", [
    ('{"prompt": 123}', "'prompt' must be a string, got int 123"),
    ('{"prompt": null}', "'prompt' must be a string, got NoneType None"),
    ('{"prompt": [1, 2]}', "'prompt' must be a string, got list [1, 2]"),
    ('{"prompt": "  "}', "'prompt' is empty"),
    ('{"text": "hi"}', "exactly one of the fields 'prompt'"),
    ('{"prompt": "a", "token_ids": [1]}', "exactly one of the fields 'prompt'"),
    ('{"token_ids": [1, true]}', "'token_ids' holds True"),
    ('{"token_ids": [1, -3]}', "'token_ids' holds -3"),
    ('{"token_ids": "12"}', "'token_ids' must be a non-empty list"),
    ('{"token_ids": []}', "'token_ids' must be a non-empty list"),
    ('{"prompt": "a"', "not valid JSON"),
])
def test_bad_jsonl_lines(no_model, tmp_path, line, expected):
    path = _file(tmp_path, '{"prompt": "fine"}\n' + line + "\n", "p.jsonl")
    message = _error(["--prompt-file", path])
    assert f"{path}:2: " in message and expected in message, message


def test_jsonl_text_and_token_ids(tmp_path):
    path = _file(tmp_path, '{"prompt": "123"}\n\n{"token_ids": [5, 6]}\nplain line\n')
    args = cli.build_parser().parse_args(["--prompt-file", path])
    assert cli.read_prompts(args) == (["123", [5, 6], "plain line"], False)
    args = cli.build_parser().parse_args(["--prompt-file", path, "--chat"])
    with pytest.raises(SystemExit, match="cannot wrap a JSONL 'token_ids' prompt"):
        cli.read_prompts(args)


def test_unreadable_prompt_files(no_model, tmp_path):
    missing = str(tmp_path / "nope.txt")
    assert f"cannot read the prompt file {missing}: No such file" in \
        _error(["--prompt-file", missing])
    assert f"cannot read the prompt file {tmp_path}" in _error(["--prompt-file", str(tmp_path)])
    latin1 = _file(tmp_path, "caf\u00e9\n".encode("latin-1"))
    assert f"{latin1} is not UTF-8 text (byte 0xe9 at offset 3)" in \
        _error(["--prompt-file", latin1])
    binary = _file(tmp_path, b"\x00\x01\x02 abc\n", "blob.bin")
    assert f"{binary} holds NUL bytes" in _error(["--prompt-file", binary])


@pytest.mark.parametrize("argv,expected", [
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--top-p", "nan"], "--top-p must be in (0, 1]"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--chunk-steps", "0"], "--chunk-steps must be >= 1, got 0"),
    (["--prompt", ""], "--prompt number 1 is empty"),
    (["--prompt", "ok", "--prompt", " \n"], "--prompt number 2 is empty"),
    (["--k-select", "-5"], "k_select"),
    (["--successor-radius", "-1"], "successor_radius"),
    (["--evidence-window", "0"], "evidence_window"),
    (["--warmup-steps", "-1"], "warmup_steps"),
    (["--selection-memory", "nan"], "selection_memory"),
])
def test_bad_values_before_loading(no_model, argv, expected):
    assert expected in _error(argv + ["--no-compile-cache"])


def test_top_k_above_the_vocabulary(fake_run, monkeypatch):
    calls, _ = fake_run
    monkeypatch.setattr(sfi_jax, "load_model", lambda *a, **k: _StubModel(vocab_size=100))
    message = _error(["--prompt", "hi", "--top-k", "101", "--temperature", "1",
                      "--no-compile-cache"])
    assert "--top-k 101 exceeds the vocabulary size 100" in message
    assert calls["generate"] == 0


# ---- Ctrl-C, --json, --help, stats ----

def test_ctrl_c_is_one_line(fake_run, tokenizer, capsys):
    _, plan = fake_run
    plan["tokens"] = tokenizer("one two three four five", add_special_tokens=False)["input_ids"]
    plan["interrupt_after"] = 1
    assert cli.main(["--prompt", "hi", "--no-compile-cache"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted (Ctrl-C)"


def test_json_is_strict(fake_run, tokenizer, capsys):
    _, plan = fake_run
    plan["tokens"] = tokenizer("🔥 done", add_special_tokens=False)["input_ids"]
    plan["stats"] = {"acceptance_rate": [float("nan"), 0.5], "decode_tokens_per_s": float("inf"),
                     "memory_bytes": {"kv": np.int64(7)}, "drafted": np.array([0, 2])}
    assert cli.main(["--prompt", "a", "--prompt", "b", "--json", "--mode", "exact",
                     "--no-compile-cache"]) == 0
    out = capsys.readouterr().out

    def refuse(constant):
        raise AssertionError(f"bare {constant} in the JSON output")

    obj = json.loads(out, parse_constant=refuse)
    stats = obj["stats"]
    assert stats["acceptance_rate"] == [None, 0.5]
    assert stats["decode_tokens_per_s"] is None
    assert stats["memory_bytes"] == {"kv": 7} and stats["drafted"] == [0, 2]
    assert obj["text"] == ["🔥 done"] * 2
    assert stats["first_token_from_start_s"] > 0


def test_help_names_every_default():
    parser = cli.build_parser()
    formatter = parser._get_formatter()
    sfi_defaults = dataclasses.asdict(SFIConfig())
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = formatter._expand_help(action)
        assert "default" in text, action.option_strings
        if action.default not in (None, False, []) and "default: " not in (action.help or ""):
            assert f"(default: {action.default})" in text, action.option_strings
        field = action.dest
        if field in PAPER:  # an extension: None (its default, or the paper's under --paper)
            assert action.default is None, field
            assert f"default {sfi_defaults[field]:g}" in text, (field, text)
        elif field in sfi_defaults and sfi_defaults[field] is not None:
            assert action.default == sfi_defaults[field], field
            assert f"(default: {sfi_defaults[field]})" in text, field
    sfi_group = next(g for g in parser._action_groups if g.title.startswith("SFI"))
    assert len(sfi_group._group_actions) >= 9


def test_stats_line_prompt_rate_matches_its_time():
    s = {"prompt_tokens": [300, 100], "prefill_s": 0.5, "compile_s": 2.0, "decode_tokens": 10,
         "decode_s": 0.25, "decode_tokens_per_s": 40.0, "ttft_s": 0.6,
         "first_token_from_start_s": 7.25, "slow_steps": [1, 1], "fast_steps": [3, 3],
         "prefill_tokens_per_s": 9999.0}
    line = cli.stats_line("sfi", s)
    m = re.search(r"prefill (\d+) prompt tokens in ([\d.]+) s = (\d+) tokens/s", line)
    assert m, line
    tokens, seconds, rate = int(m[1]), float(m[2]), float(m[3])
    assert tokens == 400 and seconds == 0.5 and rate == 800
    assert "first token 0.60 s (compiles excluded), 7.25 s after the command started" in line
