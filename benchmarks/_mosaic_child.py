"""Mosaic Streaming's side of benchmarks/object_store.py; runs in the peers' own venv (never loomdata's).

    python _mosaic_child.py convert DOCS.npz OUT_DIR [SHARD_MIB]                     # MDS shards (default 32 MiB)
    python _mosaic_child.py read REMOTE LOCAL SAMPLES BATCH [WORKERS [PREDOWNLOAD]]  # stream from S3, print JSON

`read` streams `SAMPLES` documents through a torch DataLoader(num_workers=WORKERS, default 2) over a
StreamingDataset (shuffle on, py1e, the peer's default shuffle algorithm; `predownload` samples ahead per worker,
Mosaic's default 8 x batch when absent) from $S3_ENDPOINT_URL in batches of `BATCH` documents and prints delivered
tokens, seconds, the time to the first batch (and its tokens), the consumer's wait per batch and the CPU seconds of the
rank and its DataLoader workers.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import time
from typing import Any


def convert(docs_npz: str, out_dir: str, shard_mib: float = 32) -> None:
    import numpy as np
    from streaming import MDSWriter

    z = np.load(docs_npz)
    tokens, offsets = z["tokens"], z["offsets"]
    with MDSWriter(out=out_dir, columns={"tokens": "ndarray:int32"}, size_limit=int(shard_mib * (1 << 20))) as w:
        for i in range(len(offsets) - 1):
            w.write({"tokens": tokens[offsets[i] : offsets[i + 1]]})


def _collate(batch: list[dict[str, Any]]) -> list[Any]:
    return [b["tokens"] for b in batch]


def read(remote: str, local: str, samples: int, batch: int, workers: int = 2, predownload: int | None = None) -> None:
    import torch
    from streaming import StreamingDataset

    t0, self0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    ds = StreamingDataset(
        remote=remote, local=local, shuffle=True, shuffle_seed=0, batch_size=batch, predownload=predownload
    )
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=_collate)
    tokens, n, waits, first, first_tokens = 0, 0, [], None, 0
    t = time.perf_counter()
    for b in dl:
        now = time.perf_counter()
        waits.append(now - t)
        tokens += sum(len(x) for x in b)
        if first is None:
            first, first_tokens = now - t0, tokens
        n += len(b)
        t = time.perf_counter()
        if n >= samples:
            break
    secs = time.perf_counter() - t0
    del dl  # its worker processes are joined, so their CPU counts among this process's children
    gc.collect()
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = me.ru_utime + me.ru_stime - self0.ru_utime - self0.ru_stime + kids.ru_utime + kids.ru_stime
    print(
        json.dumps(
            {
                "tokens": tokens,
                "samples": n,
                "seconds": secs,
                "first_batch_s": first,
                "first_tokens": first_tokens,
                "waits": waits,
                "cpu_s": cpu,  # this rank from its dataset construction (imports left out) and its DataLoader workers
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "convert":
        convert(sys.argv[2], sys.argv[3], *(float(a) for a in sys.argv[4:5]))
    else:
        extra = [int(a) for a in sys.argv[6:8]]
        read(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), *extra)
