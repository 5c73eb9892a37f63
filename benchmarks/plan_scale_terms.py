"""Where one plan's CPU goes, by term: plan_scale's one-core plan (its `child_loom`) with CPU timers wrapped
around the balancing phases, the manifest and report per block and the report's writing, printed as one line
(`term=CPU seconds`; the phases plan_scale times itself are included). Cheaper than a profiler, so terms can be
compared between trees run one after the other (PYTHONPATH picks the tree). The terms nest, do not add them up:
`sink.add_block` holds `report.add_block` and the manifest's writes, and the `bs.*` terms are parts of `balance_span`.

    PYTHONPATH=src .venv/bin/python benchmarks/plan_scale_terms.py --samples 1e7 --sources 300 --dp 4 \
        --workdir /tmp/idx-300
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plan_scale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=float, default=1e7)
    ap.add_argument("--sources", type=int, default=300)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--workdir", type=Path, required=True, help="the index (written there first if missing)")
    args = ap.parse_args(argv)
    from loomdata.planning import _items, _manifest, _ranges, _report, _step
    from loomdata.planning.balance import _block

    if not (args.workdir / "index-info.json").exists():
        args.workdir.mkdir(parents=True, exist_ok=True)
        idx = ["--child", "index", "--samples", str(int(args.samples)), "--n-sources", str(args.sources)]
        plan_scale._call(*idx, "--workdir", str(args.workdir))
    acc: dict[str, float] = collections.defaultdict(float)

    def wrap(obj: Any, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def run(*a: Any, **kw: Any) -> Any:
            c = time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                acc[name] += time.process_time() - c

        setattr(obj, attr, run)

    wrap(_ranges, "balance_span", "balance_span")
    wrap(_step.StepSink, "add_block", "sink.add_block")
    wrap(_manifest.ManifestWriter, "_flush", "manifest._flush")
    wrap(_report.ReportBuilder, "add_block", "report.add_block")
    wrap(_items.StepItems, "_gather", "items._gather")
    wrap(_report.ReportBuilder, "write", "report.write")
    wrap(_report.ReportBuilder, "summary", "report.summary")
    for name in ("deal_flat", "refine_flat", "baselines_flat", "_placed"):
        if hasattr(_block, name):
            wrap(_block, name, f"bs.{name}")
    r = plan_scale.child_loom(args.workdir, args.dp)
    out = {"plan": r["plan_cpu_seconds"], **{k: v["cpu_seconds"] for k, v in r["phases"].items()}, **acc}
    print(" ".join(f"{k}={v:.3f}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
