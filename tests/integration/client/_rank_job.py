"""One rank of a real torch.distributed (gloo) job: consume LoomDataset batches, check them, all_reduce.

Run as `python _rank_job.py PLAN_DIR RANK WORLD PORT OUT_JSON` with a running executor of the plan.
Each batch is checked against an independent pyarrow read of the source files (the test oracle).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path


def main() -> None:
    plan_dir, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/, for the shared `loomtest` helpers
    from loomdata.schemas import SEGMENT_DTYPE, Batch
    from loomdata.torch import LoomDataset
    from loomtest import stream as helpers

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    oracle = helpers.Oracle(Path(plan_dir))
    data = LoomDataset(plan_dir, rank)
    tokens = 0
    batches = 0
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable NumPy array" warning fails the rank
        for item in data:
            ids = item["input_ids"]
            assert ids.dtype == torch.int32
            seg_rows = oracle.expected_segments(item["step"], rank, item["micro_batch"])
            segments = __import__("numpy").zeros(len(seg_rows), dtype=SEGMENT_DTYPE)
            for i, c in enumerate(("source", "sample", "offset", "length")):
                segments[c] = seg_rows[:, i]
            batch = Batch(
                step=item["step"],
                dp_rank=item["dp_rank"],
                micro_batch=item["micro_batch"],
                lane=item["lane"],
                input_ids=ids.numpy(),
                labels=item["labels"].numpy(),
                position_ids=item["position_ids"].numpy(),
                cu_seqlens=item["cu_seqlens"].numpy(),
                segments=segments,
            )
            tokens += oracle.check(batch)
            batches += 1
    elapsed = time.perf_counter() - t0
    state = data.state_dict()
    data.close()
    total = torch.tensor([float(tokens), 1.0])
    dist.all_reduce(total)
    Path(out).write_text(
        json.dumps(
            {
                "rank": rank,
                "tokens": tokens,
                "batches": batches,
                "all_tokens": int(total[0]),
                "ranks_seen": int(total[1]),
                "elapsed_s": elapsed,
                "state": state,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
