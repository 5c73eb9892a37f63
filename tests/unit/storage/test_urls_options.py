"""Locations, storage options and their redaction: URLs stay strings, secrets never reach a dump."""

from __future__ import annotations

from pathlib import Path

import pytest

from loomdata.schemas import Spec, parse_spec
from loomdata.storage import REDACTED, is_url, location, options_for, protocol_of, redact, suffix_of


def test_plain_paths_and_file_urls_are_local_paths() -> None:
    assert location("/data/a.parquet") == Path("/data/a.parquet")
    assert location("file:///data/a.parquet") == Path("/data/a.parquet")
    assert location(Path("rel/x.jsonl")) == Path("rel/x.jsonl")
    assert not is_url("/data/a.parquet") and not is_url(Path("s3:/folded")) and not is_url("file:///x")


@pytest.mark.parametrize(
    ("url", "proto"),
    [("s3://bkt/a/b.parquet", "s3"), ("gs://bkt/x", "gs"), ("https://host/x.jsonl", "https"), ("S3://B/k", "s3")],
)
def test_object_urls_stay_strings_with_their_double_slash(url: str, proto: str) -> None:
    loc = location(url)
    assert loc == url and isinstance(loc, str) and is_url(loc) and protocol_of(loc) == proto


def test_an_unknown_scheme_is_refused_with_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"unsupported URL scheme 'ftp'.*s3"):
        location("ftp://host/x")


def test_suffix_of_paths_and_urls() -> None:
    assert suffix_of("s3://b/books/a.jsonl.gz") == ".gz"
    assert suffix_of("https://h/a.parquet?X-Amz-Signature=abc") == ".parquet"
    assert suffix_of(Path("/x/a.zst")) == ".zst"


def test_redact_hides_secrets_at_any_depth_and_keeps_public_settings() -> None:
    opts = {
        "s3": {
            "key": "AKIA1",
            "secret": "s3cr3t",
            "endpoint_url": "http://127.0.0.1:9",
            "client_kwargs": {"aws_session_token": "tok"},
        }
    }
    shown = redact(opts)
    assert shown["s3"]["key"] == REDACTED and shown["s3"]["secret"] == REDACTED
    assert shown["s3"]["client_kwargs"]["aws_session_token"] == REDACTED
    assert shown["s3"]["endpoint_url"] == "http://127.0.0.1:9"
    assert "s3cr3t" not in repr(shown) and opts["s3"]["secret"] == "s3cr3t"  # the input is untouched


def test_options_for_merges_protocol_aliases() -> None:
    opts = {"gcs": {"project": "p"}, "gs": {"token": "t"}, "s3": {"anon": True}}
    assert options_for("gs", opts) == {"project": "p", "token": "t"}
    assert options_for("s3", opts) == {"anon": True}
    assert options_for("https", None) == {}


def _spec(tmp_path: Path, secret: str) -> Spec:
    raw = {
        "name": "t",
        "workdir": str(tmp_path / "w"),
        "sources": [
            {
                "name": "web",
                "format": "parquet",
                "paths": ["s3://bkt/web/*.parquet"],
                "tokens_field": "tokens",
                "storage_options": {"s3": {"key": "id", "secret": secret}},
            }
        ],
        "mixture": {"weights": {"web": 1.0}},
        "training": {"seq_len": 64, "steps": 2, "dp_size": 1, "micro_batches": 1},
    }
    return parse_spec(raw, tmp_path, check_paths=False)


def test_storage_options_reach_the_source_but_no_dump_repr_or_hash(tmp_path: Path) -> None:
    secret = "loomSECRETunit0123"
    spec = _spec(tmp_path, secret)
    assert spec.sources[0].storage_options["s3"]["secret"] == secret
    for text in (spec.canonical_json(), spec.content_json(), repr(spec), str(spec.model_dump())):
        assert secret not in text and '"storage_options"' not in text and "storage_options=" not in text
    assert spec.spec_hash() == _spec(tmp_path, "another").spec_hash()


def test_a_spec_without_storage_options_dumps_as_before(tmp_path: Path) -> None:
    dumped = _spec(tmp_path, "x").sources[0].model_dump(mode="json")
    assert "storage_options" not in dumped


def test_top_level_storage_options_reach_every_source_under_its_own(tmp_path: Path) -> None:
    raw = {
        "name": "t",
        "workdir": str(tmp_path / "w"),
        "storage_options": {"s3": {"endpoint_url": "http://127.0.0.1:1", "secret": "sharedSEC"}},
        "sources": [
            {"name": "a", "format": "parquet", "paths": ["s3://bkt/a/*.parquet"], "tokens_field": "tokens"},
            {
                "name": "b",
                "format": "parquet",
                "paths": ["s3://bkt/b/*.parquet"],
                "tokens_field": "tokens",
                "storage_options": {"s3": {"secret": "ownSEC"}},
            },
        ],
        "mixture": {"weights": {"a": 1.0, "b": 1.0}},
        "training": {"seq_len": 64, "steps": 2, "dp_size": 1, "micro_batches": 1},
    }
    spec = parse_spec(raw, tmp_path, check_paths=False)
    a, b = (s.storage_options["s3"] for s in spec.sources)
    assert a == {"endpoint_url": "http://127.0.0.1:1", "secret": "sharedSEC"}
    assert b == {"endpoint_url": "http://127.0.0.1:1", "secret": "ownSEC"}
    assert "sharedSEC" not in spec.canonical_json() and "ownSEC" not in spec.canonical_json()
