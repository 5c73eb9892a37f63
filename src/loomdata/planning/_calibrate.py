"""Calibrating the cost model from measured times: the measurement file, the fit and its quality, the new `cost:` block.

Measurement file (`loom calibrate SPEC MEASUREMENTS`): JSON lines, UTF-8; blank lines and lines starting
with `#` are skipped. One object per line, for one rank's micro-batch or one rank's whole step:

    {"lengths": [4096, 812, 77], "seconds": 0.231}
    {"lengths": [1024, 300], "image_tokens": [576, 0], "seconds": 0.05, "step": 3, "rank": 1}

- `lengths`: token counts of the document segments the run held (a non-empty list of positive integers);
- `image_tokens` (optional): image tokens of each segment, as many entries as `lengths` (0 for text);
- `seconds`: the measured time of that run on one rank (forward + backward), a positive number.
Any other key (step, rank, micro_batch, arm, ...) is an annotation the fit ignores. A bad line raises
MeasurementError naming the file and line; fewer than 2 lines is an error too.

The fit is `fit_cost` (non-negative least squares, scaled to attention = 1). Its quality is judged on
the runs it was fitted to: predicted seconds = s * cost(run), with s the least-squares seconds per cost
unit; R^2 = 1 - SS_res / SS_tot, and the relative error |predicted - measured| / measured per line
(median and p90). `with_cost_block` rewrites a spec's YAML text with only its top-level `cost:` block
replaced (every other line and comment kept); `balance_change` plans a spec with its old and its fitted
cost and compares their balance, both as each plan's own report says and under the fitted cost.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import yaml

from loomdata.planning._cost import fit_cost, segment_cost
from loomdata.schemas import (
    INDEX_SCHEMA,
    ContractError,
    CostSpec,
    IndexFiles,
    Spec,
    read_index,
    read_manifest,
    read_plan,
)

__all__ = [
    "BalanceChange",
    "CalibrationFit",
    "Measurement",
    "MeasurementError",
    "balance_change",
    "calibrate",
    "plan_rank_costs",
    "read_measurements",
    "read_spec_index",
    "with_cost_block",
    "write_measurements",
]


class MeasurementError(ContractError):
    """A measurement file (JSON lines of segment lengths and seconds) is missing, malformed or too short."""


@dataclass(frozen=True)
class Measurement:
    """One measured run: the segment lengths (and image tokens) one rank held, and its seconds."""

    lengths: np.ndarray
    seconds: float
    image_tokens: np.ndarray | None = None
    notes: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """One line of the measurement file."""
        row: dict[str, Any] = {"lengths": [int(x) for x in self.lengths], "seconds": float(self.seconds)}
        if self.image_tokens is not None:
            row["image_tokens"] = [int(x) for x in self.image_tokens]
        row.update({k: v for k, v in self.notes.items() if k not in row})
        return json.dumps(row, separators=(",", ":"))


def _int_list(value: Any, key: str, allow_zero: bool) -> np.ndarray:
    if not isinstance(value, list) or not value:
        raise ValueError(f"`{key}` must be a non-empty list of integers, got {value!r:.60}")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ValueError(f"`{key}` must hold integers only, got {value!r:.60}")
    arr = np.asarray(value, dtype=np.int64)
    if (arr < 0).any() or (not allow_zero and (arr == 0).any()):
        raise ValueError(f"`{key}` must hold {'non-negative' if allow_zero else 'positive'} integers")
    return arr


def _parse_line(text: str) -> Measurement:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    missing = [k for k in ("lengths", "seconds") if k not in row]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)} (each line needs `lengths` and `seconds`)")
    lengths = _int_list(row["lengths"], "lengths", allow_zero=False)
    secs = row["seconds"]
    if isinstance(secs, bool) or not isinstance(secs, (int, float)) or not np.isfinite(secs) or secs <= 0:
        raise ValueError(f"`seconds` must be a positive number, got {secs!r}")
    img = None
    if row.get("image_tokens") is not None:
        img = _int_list(row["image_tokens"], "image_tokens", allow_zero=True)
        if len(img) != len(lengths):
            raise ValueError(f"`image_tokens` has {len(img)} entries but `lengths` has {len(lengths)}")
    notes = {k: v for k, v in row.items() if k not in ("lengths", "seconds", "image_tokens")}
    return Measurement(lengths=lengths, seconds=float(secs), image_tokens=img, notes=notes)


def read_measurements(path: str | Path) -> list[Measurement]:
    """Every measured run of a measurement file; MeasurementError names the file and line of a bad one."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise MeasurementError(f"{p}: cannot read measurements: {e.strerror}") from None
    except UnicodeDecodeError:
        raise MeasurementError(f"{p}: not UTF-8 text; expected JSON lines of segment lengths and seconds") from None
    out = []
    for no, line in enumerate(text.splitlines(), start=1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            out.append(_parse_line(s))
        except ValueError as e:
            raise MeasurementError(
                f'{p}, line {no}: {e}; expected {{"lengths": [int, ...], "seconds": float}}'
            ) from None
    if len(out) < 2:
        raise MeasurementError(
            f"{p}: {len(out)} measured run(s); the fit needs at least 2 (one line per rank per micro-batch or step)"
        )
    return out


def write_measurements(path: str | Path, runs: Iterable[Measurement], *, append: bool = False) -> int:
    """Write runs as JSON lines (appending when asked); returns how many lines were written."""
    n = 0
    with Path(path).open("a" if append else "w", encoding="utf-8") as f:
        for m in runs:
            f.write(m.to_json() + "\n")
            n += 1
    return n


@dataclass(frozen=True)
class CalibrationFit:
    """A fitted cost model and how well it predicts the runs it was fitted to."""

    cost: CostSpec
    seconds_per_unit: float
    r2: float
    median_rel_error: float
    p90_rel_error: float
    runs: int
    predicted: np.ndarray
    measured: np.ndarray

    @property
    def crossover_length(self) -> float:
        """Segment length at which attention equals the linear term (linear / attention); inf without attention."""
        return self.cost.linear / self.cost.attention if self.cost.attention > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {
            "cost": self.cost.model_dump(),
            "seconds_per_cost_unit": self.seconds_per_unit,
            "crossover_length": self.crossover_length,
            "r2": self.r2,
            "median_rel_error": self.median_rel_error,
            "p90_rel_error": self.p90_rel_error,
            "runs": self.runs,
        }


def _run_costs(runs: Sequence[Measurement], cost: CostSpec) -> np.ndarray:
    """Cost of each run (sum over its segments), vectorised over all segments at once."""
    counts = np.array([len(m.lengths) for m in runs])
    lengths = np.concatenate([m.lengths for m in runs])
    img = None
    if any(m.image_tokens is not None for m in runs):
        img = np.concatenate(
            [m.image_tokens if m.image_tokens is not None else np.zeros(len(m.lengths), np.int64) for m in runs]
        )
    seg = segment_cost(lengths, img, cost)
    return np.add.reduceat(seg, np.concatenate([[0], np.cumsum(counts)[:-1]]))


def fit_quality(runs: Sequence[Measurement], cost: CostSpec) -> CalibrationFit:
    """How well `cost` (scaled by the best seconds per unit) predicts the measured seconds of `runs`."""
    y = np.array([m.seconds for m in runs])
    c = _run_costs(runs, cost)
    scale = float(c @ y / (c @ c)) if (c @ c) > 0 else 0.0
    pred = scale * c
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res <= 1e-24 else 0.0)
    rel = np.abs(pred - y) / y
    return CalibrationFit(
        cost=cost,
        seconds_per_unit=scale,
        r2=r2,
        median_rel_error=float(np.median(rel)),
        p90_rel_error=float(np.quantile(rel, 0.9)),
        runs=len(runs),
        predicted=pred,
        measured=y,
    )


def calibrate(runs: Sequence[Measurement]) -> CalibrationFit:
    """Fit the cost model to measured runs (fit_cost) and judge the fit on them."""
    if len(runs) < 2:
        raise MeasurementError(f"{len(runs)} measured run(s); the fit needs at least 2")
    have_img = any(m.image_tokens is not None for m in runs)
    cost = fit_cost(
        [m.lengths for m in runs],
        [m.seconds for m in runs],
        [m.image_tokens if m.image_tokens is not None else np.zeros(len(m.lengths)) for m in runs]
        if have_img
        else None,
    )
    return fit_quality(runs, cost)


def _yaml_float(x: float) -> str:
    """A float YAML 1.1 (PyYAML) reads back as a float: 6 significant digits, always with a dot."""
    s = f"{x:.6g}"
    mant, _, exp = s.partition("e")
    if "." not in mant:
        mant += ".0"
    return mant + ("e" + exp if exp else "")


_COST_KEY = re.compile(r"^cost\s*:")


def with_cost_block(text: str, cost: CostSpec, note: str = "") -> tuple[str, bool]:
    """The spec's YAML text with its top-level `cost:` block replaced by `cost` (appended when absent).

    Every other line, comments included, is kept; the comments inside the old block go. Returns the text
    and whether comments were kept: when the edited text does not read back as the same spec with the
    new cost (an unusual layout), the whole spec is dumped again instead, without comments.
    """
    block = [f"cost:{'  # ' + note if note else ''}\n"] + [
        f"  {k}: {_yaml_float(getattr(cost, k))}\n" for k in ("attention", "linear", "encoder")
    ]
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if _COST_KEY.match(line)), None)
    if start is None:
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        new_lines = [*lines, "\n", *block] if lines else block
    else:
        end = start + 1
        while end < len(lines) and (lines[end][:1] in (" ", "\t") or not lines[end].strip()):
            end += 1
        while end > start + 1 and not lines[end - 1].strip():  # trailing blank lines stay outside the block
            end -= 1
        new_lines = lines[:start] + block + lines[end:]
    new_text = "".join(new_lines)
    old = yaml.safe_load(text) or {}
    want = {**old, "cost": cost.model_dump()} if isinstance(old, dict) else None
    try:
        got = yaml.safe_load(new_text)
    except yaml.YAMLError:
        got = None
    if want is not None and isinstance(got, dict) and _same(got, want):
        return new_text, True
    dumped = yaml.safe_dump(want if want is not None else {"cost": cost.model_dump()}, sort_keys=False)
    header = "# written by `loom calibrate` (the original's comments were dropped)" + (f": {note}" if note else "")
    return f"{header}\n{dumped}", False


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal specs but for the cost block, and equal cost blocks to the 6 digits written."""
    ca, cb = a.get("cost"), b.get("cost")
    rest_a = {k: v for k, v in a.items() if k != "cost"}
    rest_b = {k: v for k, v in b.items() if k != "cost"}
    if rest_a != rest_b or not isinstance(ca, dict) or not isinstance(cb, dict):
        return False
    return all(np.isclose(float(ca.get(k, 0.0)), float(cb[k]), rtol=1e-5) for k in cb)


def plan_rank_costs(
    plan_dir: Path, spec: Spec, cost: CostSpec, image_tokens: Mapping[str, np.ndarray] | None = None
) -> np.ndarray:
    """Cost (steps x dp) of every rank of every step of a stored plan under `cost` (its lanes' cp sizes)."""
    meta = read_plan(plan_dir)
    m = read_manifest(plan_dir, meta)
    step = m["step"].to_numpy().astype(np.int64)
    rank = m["dp_rank"].to_numpy().astype(np.int64)
    length = m["length"].to_numpy()
    lane = m["lane"].to_numpy()
    long_cp = spec.long_context.cp_size if spec.long_context is not None else 1
    cp = np.where(lane == 1, long_cp, spec.training.cp_size)
    img = None
    if image_tokens is not None and cost.encoder:
        src = m["source"].to_numpy().astype(np.int64)
        sample = m["sample"].to_numpy().astype(np.int64)
        img = np.zeros(len(m), np.int64)
        for k, name in enumerate(meta.sources):
            sel = src == k
            if name in image_tokens and sel.any():
                img[sel] = np.asarray(image_tokens[name])[sample[sel]]
    seg = segment_cost(length, img, cost, cp)
    out = np.zeros((meta.steps, meta.dp_size))
    np.add.at(out, (step, rank), seg)
    return out


def _max_over_mean(rank_cost: np.ndarray) -> float:
    mean = rank_cost.mean(axis=1)
    return float(np.mean(rank_cost.max(axis=1) / np.where(mean > 0, mean, 1.0)))


@dataclass(frozen=True)
class BalanceChange:
    """Predicted balance (mean over steps of max/mean rank cost) of plans made with the old and the fitted cost."""

    old_own: float  # old plan, as its own report says (old cost)
    new_own: float  # new plan, its own report (fitted cost)
    old_under_fit: float  # old plan's ranks costed with the fitted cost: what the fitted model predicts for it
    new_under_fit: float
    old_plan_dir: Path
    new_plan_dir: Path

    def to_dict(self) -> dict[str, Any]:
        return {
            "old_plan_max_over_mean": {"own_cost": self.old_own, "fitted_cost": self.old_under_fit},
            "new_plan_max_over_mean": {"own_cost": self.new_own, "fitted_cost": self.new_under_fit},
            "predicted_gain_of_replan": self.old_under_fit / self.new_under_fit if self.new_under_fit else None,
        }


def read_spec_index(spec: Spec) -> tuple[dict[str, pa.Table], dict[str, str]] | None:
    """The spec's index tables and fingerprints from workdir/index, or None when no source is indexed yet."""
    if not any(IndexFiles.of(spec.workdir, n).samples.exists() for n in spec.source_names):
        return None
    tables, fps = {}, {}
    for name in spec.source_names:  # a partial or broken index raises its own LoomError
        samples, _, fp = read_index(spec.workdir, name, columns=list(INDEX_SCHEMA.names))
        tables[name], fps[name] = samples, fp
    return tables, fps


def balance_change(
    spec: Spec,
    new_cost: CostSpec,
    *,
    index: Mapping[str, pa.Table],
    fingerprints: Mapping[str, str],
    workdir: Path | None = None,
) -> BalanceChange:
    """Plan `spec` with its cost and with `new_cost` (into `workdir`, a temporary folder by default) and compare.

    Both plans are costed with `new_cost` as well, which says what re-planning buys if the fitted model
    is the true one (the own-cost figures only say how well each plan met its own model).
    """
    from loomdata.planning._plan import make_plan  # imported late: planning/__init__ imports this module
    from loomdata.planning._report import plan_report

    def run(root: Path) -> BalanceChange:
        res = {}
        for key, cost in (("old", spec.cost), ("new", new_cost)):
            s = spec.model_copy(update={"cost": cost, "workdir": root})
            r = make_plan(s, index=index, fingerprints=fingerprints)
            rep = plan_report(r.plan_dir)
            img = {
                n: t["num_image_tokens"].to_numpy() for n, t in index.items() if "num_image_tokens" in t.schema.names
            }
            rank_cost = plan_rank_costs(r.plan_dir, s, new_cost, img)
            res[key] = (r.plan_dir, float(rep["max_over_mean"]["loomdata"]), rank_cost)
        return BalanceChange(
            old_own=res["old"][1],
            new_own=res["new"][1],
            old_under_fit=_max_over_mean(res["old"][2]),
            new_under_fit=_max_over_mean(res["new"][2]),
            old_plan_dir=res["old"][0],
            new_plan_dir=res["new"][0],
        )

    if workdir is not None:
        return run(Path(workdir))
    with tempfile.TemporaryDirectory(prefix="loom-calibrate-") as tmp:
        return run(Path(tmp))
