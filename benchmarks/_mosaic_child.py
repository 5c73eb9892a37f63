"""Mosaic Streaming's side of benchmarks/object_store.py; runs in the peers' own venv (never loomdata's).

    python _mosaic_child.py convert DOCS.npz OUT_DIR          # MDS shards of the same documents
    python _mosaic_child.py read REMOTE LOCAL SAMPLES BATCH   # stream from S3 ($S3_ENDPOINT_URL), print JSON

`read` streams `SAMPLES` documents through a torch DataLoader(num_workers=2) over a StreamingDataset
(shuffle on, py1e, the peer's default shuffle algorithm) in batches of `BATCH` documents and prints delivered
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


def convert(docs_npz: str, out_dir: str) -> None:
    import numpy as np
    from streaming import MDSWriter

    z = np.load(docs_npz)
    tokens, offsets = z["tokens"], z["offsets"]
    with MDSWriter(out=out_dir, columns={"tokens": "ndarray:int32"}, size_limit=1 << 25) as w:
        for i in range(len(offsets) - 1):
            w.write({"tokens": tokens[offsets[i] : offsets[i + 1]]})


def _collate(batch: list[dict[str, Any]]) -> list[Any]:
    return [b["tokens"] for b in batch]


def read(remote: str, local: str, samples: int, batch: int) -> None:
    import torch
    from streaming import StreamingDataset

    t0, self0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    ds = StreamingDataset(remote=remote, local=local, shuffle=True, shuffle_seed=0, batch_size=batch)
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=2, collate_fn=_collate)
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
        convert(sys.argv[2], sys.argv[3])
    else:
        read(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
