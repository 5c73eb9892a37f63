"""Tokenizers for raw-text sources: the built-in byte-level one and Hugging Face `tokenizers`.

The index job needs token counts and checksums (`count_and_check`), loaders the tokens (`encode_batch`);
both take a batch of texts as a Python sequence or an Arrow string array, so callers that already
hold Arrow columns (Parquet) never build Python strings for counting. `count_batch` always equals
the lengths of `encode_batch`. `make_tokenizer` caches one tokenizer per spec per process.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.records import TokenizerKind
from loomdata.sources._integrity import TOKEN_DTYPE, checksums, checksums_flat

if TYPE_CHECKING:  # annotations only: a serving worker reads records, not the pydantic spec
    from loomdata.schemas.records import AnyTokenizer

__all__ = ["BYTE_VOCAB_SIZE", "ByteTokenizer", "HFTokenizer", "Texts", "Tokenizer", "make_tokenizer"]

BYTE_VOCAB_SIZE = 256

Texts: TypeAlias = Sequence[str] | pa.Array | pa.ChunkedArray
"""A batch of texts: Python strings or an Arrow string/large_string array (no nulls)."""


class Tokenizer(abc.ABC):
    """Turns a batch of texts into int32 token arrays, or just counts their tokens."""

    vocab_size: int
    checksum_dtype: ClassVar[np.dtype] = TOKEN_DTYPE
    """The dtype texts' tokens are checksummed in (`sources._integrity`): int32 ids unless narrower ones say it all."""

    @abc.abstractmethod
    def encode_batch(self, texts: Texts) -> list[np.ndarray]:
        """One int32 token array per text, without special tokens."""

    @abc.abstractmethod
    def count_batch(self, texts: Texts) -> np.ndarray:
        """uint32 token counts, equal to the lengths of `encode_batch(texts)`."""

    def count_and_check(self, texts: Texts) -> tuple[np.ndarray, np.ndarray]:
        """uint32 token counts and checksums (`sources._integrity`) of `encode_batch(texts)`."""
        tokens = self.encode_batch(texts)
        counts = np.fromiter((len(t) for t in tokens), dtype=np.uint32, count=len(tokens))
        return counts, checksums(tokens, self.checksum_dtype)


def _as_arrow(texts: Texts) -> pa.Array:
    """`texts` as one large_string Arrow array (cheap when it already is Arrow)."""
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks() if texts.num_chunks != 1 else texts.chunk(0)
    if isinstance(texts, pa.Array):
        return texts.cast(pa.large_string()) if texts.type != pa.large_string() else texts
    return pa.array(texts, type=pa.large_string())


class ByteTokenizer(Tokenizer):
    """Tokens are the UTF-8 bytes of the text (vocab 256): no files, exact, vectorised."""

    vocab_size = BYTE_VOCAB_SIZE
    checksum_dtype: ClassVar[np.dtype] = np.dtype(np.uint8)  # the tokens are the UTF-8 bytes: the raw text is hashed

    def encode_batch(self, texts: Texts) -> list[np.ndarray]:
        arr = _as_arrow(texts)
        if len(arr) == 0:
            return []
        offsets_buf, data_buf = arr.buffers()[1], arr.buffers()[2]
        offsets = np.frombuffer(offsets_buf, dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
        data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        flat = data[offsets[0] : offsets[-1]].astype(np.int32)
        return np.split(flat, (offsets[1:-1] - offsets[0]).astype(np.intp))

    def count_batch(self, texts: Texts) -> np.ndarray:
        arr = _as_arrow(texts)
        return pc.binary_length(arr).to_numpy(zero_copy_only=False).astype(np.uint32)

    def count_and_check(self, texts: Texts) -> tuple[np.ndarray, np.ndarray]:
        arr = _as_arrow(texts)
        if len(arr) == 0:
            return np.zeros(0, np.uint32), np.zeros(0, np.uint32)
        offsets_buf, data_buf = arr.buffers()[1], arr.buffers()[2]
        offsets = np.frombuffer(offsets_buf, dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
        data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        rel = offsets - offsets[0]  # the bytes are the tokens: the text's own bytes are hashed, in place
        return np.diff(rel).astype(np.uint32), checksums_flat(data[offsets[0] : offsets[-1]], rel)


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json, encoding without special tokens."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _HF

        try:
            self._tok = _HF.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception subclasses for bad files
            hint = "point tokenizer.path at a valid tokenizer.json"
            raise SourceDataError(str(path), f"cannot load tokenizer: {e}", hint=hint) from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def _texts(self, texts: Texts) -> list[str]:
        if isinstance(texts, pa.Array | pa.ChunkedArray):
            return [str(t) for t in texts.to_pylist()]
        return list(texts)

    def encode_batch(self, texts: Texts) -> list[np.ndarray]:
        encs = self._tok.encode_batch_fast(self._texts(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def count_batch(self, texts: Texts) -> np.ndarray:
        encs = self._tok.encode_batch_fast(self._texts(texts), add_special_tokens=False)
        return np.fromiter((len(e.ids) for e in encs), dtype=np.uint32, count=len(encs))


@functools.lru_cache(maxsize=8)
def make_tokenizer(spec: AnyTokenizer) -> Tokenizer:
    """The tokenizer `spec` describes, built once per process (loaders and scan tasks reuse it)."""
    if spec.kind is TokenizerKind.BYTES:
        return ByteTokenizer()
    if spec.path is None:
        raise SourceDataError("<spec>", "tokenizer kind huggingface needs `path` (a tokenizer.json)")
    return HFTokenizer(spec.path)
