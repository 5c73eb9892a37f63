"""Tokenizers: byte-level counts against len(text.encode()), HF against tokenizers' own encode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers, processors, trainers

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.spec import TokenizerKind, TokenizerSpec
from loomdata.sources.tokenizer import ByteTokenizer, make_tokenizer

TEXTS = ["", "hello world", "héllo wörld ✓", "emoji 🙂🙂 and tabs\t\n", "日本語のテキスト", "x" * 5000]


def train_bpe(path: Path) -> Path:
    """A small BPE tokenizer trained offline, with a BOS post-processor (so special tokens matter)."""
    tok = HFTok(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["[UNK]", "[BOS]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [f"def f{i}(x):\n    return x * {i} + {i * i}  # héllo wörld" for i in range(300)]
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


def test_byte_tokenizer_counts_and_tokens_are_utf8_bytes() -> None:
    tok = make_tokenizer(TokenizerSpec())
    assert tok.vocab_size == 256
    counts = tok.count_batch(TEXTS)
    assert counts.dtype == np.uint32
    assert counts.tolist() == [len(t.encode()) for t in TEXTS]
    encoded = tok.encode_batch(TEXTS)
    for t, e in zip(TEXTS, encoded, strict=True):
        assert e.dtype == np.int32
        assert e.tolist() == list(t.encode())


@pytest.mark.parametrize("typ", [pa.string(), pa.large_string()])
def test_byte_tokenizer_accepts_sliced_and_chunked_arrow(typ: pa.DataType) -> None:
    tok = ByteTokenizer()
    arr = pa.array(["skip me", *TEXTS], type=typ).slice(1)
    chunked = pa.chunked_array([arr.slice(0, 2), arr.slice(2)])
    for batch in (arr, chunked):
        assert tok.count_batch(batch).tolist() == [len(t.encode()) for t in TEXTS]
        assert [e.tolist() for e in tok.encode_batch(batch)] == [list(t.encode()) for t in TEXTS]
    assert tok.encode_batch([]) == []
    assert tok.count_batch([]).tolist() == []


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",))), max_size=20))
def test_byte_count_equals_encode_length(texts: list[str]) -> None:
    tok = ByteTokenizer()
    assert tok.count_batch(texts).tolist() == [len(e) for e in tok.encode_batch(texts)]


def test_huggingface_tokenizer_matches_its_own_encode(tmp_path: Path) -> None:
    path = train_bpe(tmp_path)
    ref = HFTok.from_file(str(path))
    tok = make_tokenizer(TokenizerSpec(kind=TokenizerKind.HUGGINGFACE, path=path))
    assert tok.vocab_size == ref.get_vocab_size()
    texts = ["def f7(x):\n    return x * 7", "héllo wörld", "", "unseen zq words"]
    expected = [ref.encode(t, add_special_tokens=False).ids for t in texts]
    assert 1 not in [i for ids in expected for i in ids]  # no [BOS]: special tokens are off
    assert [e.tolist() for e in tok.encode_batch(texts)] == expected
    assert tok.count_batch(texts).tolist() == [len(e) for e in expected]
    assert tok.count_batch(pa.array(texts)).tolist() == [len(e) for e in expected]
    # BPE merges: fewer tokens than bytes for text like the training corpus.
    assert tok.count_batch(texts[:1])[0] < len(texts[0].encode())


def test_make_tokenizer_is_cached_per_spec(tmp_path: Path) -> None:
    assert make_tokenizer(TokenizerSpec()) is make_tokenizer(TokenizerSpec(kind=TokenizerKind.BYTES))
    path = train_bpe(tmp_path)
    a = make_tokenizer(TokenizerSpec(kind=TokenizerKind.HUGGINGFACE, path=path))
    assert a is make_tokenizer(TokenizerSpec(kind=TokenizerKind.HUGGINGFACE, path=path))


def test_bad_tokenizer_file_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(SourceDataError, match=r"broken\.json"):
        make_tokenizer(TokenizerSpec(kind=TokenizerKind.HUGGINGFACE, path=bad))
