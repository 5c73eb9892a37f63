"""An index knows what it was built from: `loom plan` refuses a spec or a file set that moved on since indexing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed import Client
from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers, trainers

from loomdata.indexing import build_index
from loomdata.planning import make_plan
from loomdata.schemas import StaleIndexError

_FIX = "re-run `loom index`"


def _write(folder: Path, name: str, lines: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(json.dumps({"text": f"the quick brown fox {i} jumps"}) + "\n" for i in range(lines)))
    return path


def _bpe(path: Path) -> None:
    tok = HFTok(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(100)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"]))
    tok.save(str(path))


def _source(*paths: str) -> dict[str, object]:
    return {"name": "books", "format": "jsonl", "paths": list(paths), "text_field": "text"}


def test_a_changed_tokenizer_is_refused_until_reindexed(tmp_path: Path, make_spec, dask_client: Client) -> None:
    _write(tmp_path / "data", "a.jsonl", 200)
    _bpe(tmp_path / "tok.json")
    hf = make_spec(_source("data/*.jsonl"), tokenizer={"kind": "huggingface", "path": "tok.json"})
    build_index(hf, dask_client)
    make_plan(hf)  # fits

    as_bytes = make_spec(_source("data/*.jsonl"))
    with pytest.raises(
        StaleIndexError, match=r"(?s)source 'books': tokenizer: indexed with \"huggingface\".*\"bytes\""
    ):
        make_plan(as_bytes)

    # the same path, other bytes (a tokenizer.json edited or retrained in place)
    (tmp_path / "tok.json").write_text((tmp_path / "tok.json").read_text().replace('"[UNK]"', '"[UNKNOWN]"'))
    with pytest.raises(StaleIndexError, match=r"tokenizer_sha256: indexed with") as err:
        make_plan(hf)
    assert _FIX in str(err.value)
    build_index(hf, dask_client)
    make_plan(hf)


def test_new_and_vanished_shards_are_listed_together(tmp_path: Path, make_spec, dask_client: Client) -> None:
    data = tmp_path / "data"
    _write(data, "a.jsonl", 50)
    gone = _write(data / "old", "b.jsonl", 50)
    spec = make_spec(_source("data/*.jsonl", "data/old/*.jsonl"))
    build_index(spec, dask_client)
    make_plan(spec)

    new = _write(data, "c.jsonl", 50)
    gone.unlink()
    with pytest.raises(StaleIndexError) as err:
        make_plan(spec)
    msg = str(err.value)
    assert f"1 shard(s) the globs match now were not indexed: {new}" in msg
    assert f"1 indexed shard(s) the globs no longer match: {gone}" in msg
    assert "path 'data/old/*.jsonl' matches nothing now (it matched 1 at indexing)" in msg
    assert msg.rstrip().endswith(f"{_FIX} (then `loom plan`)")

    build_index(spec, dask_client)
    make_plan(spec)
