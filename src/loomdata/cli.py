"""The `loom` command: the one place that wires the stages (generate, index, plan, inspect, calibrate, serve,
demo, certs).

Every subcommand prints a human summary, or only JSON with `--json`. Errors loomdata raises on
purpose (`LoomError`) print as one message without a traceback (add `--debug` to see it) and exit 2.
Clusters are TLS-secured: embedded ones make their own credentials; `--tls-ca-file/--tls-cert/--tls-key`
(or LOOM_TLS_*) reach an existing `--scheduler`; `--insecure` is plain TCP, with a warning.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loomdata.schemas import LoomError, SpecError

__all__ = ["main"]


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def _progress_wanted(args: argparse.Namespace) -> bool:
    return not args.json and sys.stderr.isatty()


def _cmd_generate(args: argparse.Namespace) -> int:
    from loomdata.testing import generate_corpus

    t0 = time.perf_counter()
    summary = generate_corpus(Path(args.dir), args.size, seed=args.seed)
    out = {**summary.to_dict(), "elapsed_s": round(time.perf_counter() - t0, 3)}
    if args.json:
        _print_json(out)
    else:
        print(f"corpus written to {args.dir} in {out['elapsed_s']:.1f}s")
        _print_table_dict(out.get("sources", {}))
    return 0


def _check_workdir(workdir: Path, origin: str) -> None:
    """A workdir loomdata can create and write, else a SpecError saying why (not an OSError traceback later)."""
    probe = Path(workdir)
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise SpecError([f"workdir: {workdir} lies under {probe}, which is a file, not a folder"], origin)
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == Path(workdir) else f"cannot be created: {probe} is not writable"
        raise SpecError([f"workdir: {workdir} {what} by this user; choose another workdir"], origin)


def _tls(args: argparse.Namespace) -> Any:
    """The user's TLS credentials from the flags or LOOM_TLS_* (None: none given); insecure conflicts."""
    from loomdata.execution._security import user_tls
    from loomdata.schemas import ExecutionError

    try:
        tls = user_tls(args.tls_ca_file, args.tls_cert, args.tls_key)
    except ValueError as e:
        raise ExecutionError(str(e)) from None
    if tls is not None and args.insecure:
        raise ExecutionError("--insecure and TLS credentials exclude each other; drop one")
    return tls


def _add_security(sp: argparse.ArgumentParser, *, dashboard: bool = True) -> None:
    sp.add_argument("--tls-ca-file", default=None, help="CA certificate (PEM) of an existing TLS cluster")
    sp.add_argument("--tls-cert", default=None, help="this client's certificate (PEM), signed by that CA")
    sp.add_argument("--tls-key", default=None, help="this client's private key (PEM)")
    sp.add_argument(
        "--insecure",
        action="store_true",
        help="plain TCP without authentication (anyone reaching the port can run code here); prints a warning",
    )
    if dashboard:
        sp.add_argument("--dashboard", action="store_true", help="start the Dask dashboard, on 127.0.0.1 only")


def _cmd_certs(args: argparse.Namespace) -> int:
    from loomdata.execution._security import make_certs

    made = make_certs(Path(args.dir), list(args.host), days=args.days)
    out = {
        "ca_file": str(made.ca_file),
        **{role: {"cert": str(c), "key": str(k)} for role, (c, k) in made.roles.items()},
    }
    if args.json:
        _print_json(out)
    else:
        print(f"CA and certificates written to {made.folder} (folder 0700, files 0600); valid {args.days} days")
        for role, (c, k) in made.roles.items():
            print(f"  {role:>9}: {c}  {k}")
        print(
            "  dask scheduler --tls-ca-file {ca} --tls-cert {s} --tls-key {sk} ...; loom serve PLAN --scheduler "
            "tls://HOST:PORT --tls-ca-file {ca} --tls-cert {c} --tls-key {ck}".format(
                ca=made.ca_file,
                s=made.roles["scheduler"][0],
                sk=made.roles["scheduler"][1],
                c=made.roles["client"][0],
                ck=made.roles["client"][1],
            )
        )
    return 0


def _cmd_index(args: argparse.Namespace) -> int:
    from loomdata.execution import open_cluster
    from loomdata.indexing import build_index
    from loomdata.schemas import load_spec

    spec = load_spec(args.spec)
    _check_workdir(spec.workdir, args.spec)
    tls = _tls(args)
    with open_cluster(args.scheduler, n_workers=args.workers, tls=tls, insecure=args.insecure) as client:
        summary = build_index(spec, client, progress=_progress_wanted(args))
    out = summary.to_dict()
    if args.json:
        _print_json(out)
    else:
        print(f"index of {spec.name!r} in {spec.index_dir} ({out['elapsed_s']:.1f}s)")
        _print_table_dict(out["sources"])
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from loomdata.planning import PlanResume, make_plan, plan_report, wants_cluster
    from loomdata.schemas import load_spec

    spec = load_spec(args.spec, check_paths=False)
    _check_workdir(spec.workdir, args.spec)
    resume = None if args.resume_from is None else PlanResume(plan_dir=Path(args.resume_from), at_step=args.at_step)
    if args.scheduler or wants_cluster(spec, args.workers):  # an embedded cluster for 20M+ samples only
        from loomdata.execution import open_cluster

        with open_cluster(args.scheduler, n_workers=args.workers, tls=_tls(args), insecure=args.insecure) as client:
            result = make_plan(spec, progress=_progress_wanted(args), resume_from=resume, client=client)
    else:
        result = make_plan(spec, progress=_progress_wanted(args), resume_from=resume)
    report = plan_report(result.plan_dir)
    if args.json:
        _print_json(report)
    else:
        _print_report(report)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from loomdata.planning import plan_report, plot_plan

    steps = None
    if args.steps:
        first, _, last = args.steps.partition(":")
        try:
            steps = (int(first), int(last or first))
        except ValueError:
            raise SystemExit(f"loom inspect: --steps wants FIRST:LAST (inclusive), got {args.steps!r}") from None
    report = plan_report(Path(args.plan_dir), steps)
    if args.plot:
        plot_plan(Path(args.plan_dir), Path(args.plot))
    if args.json:
        _print_json(report)
    else:
        _print_report(report)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from loomdata.planning import balance_change, calibrate, read_measurements, read_spec_index, with_cost_block
    from loomdata.schemas import load_spec

    spec = load_spec(args.spec, check_paths=False)
    fit = calibrate(read_measurements(args.measurements))
    out: dict[str, Any] = {"spec": args.spec, "measurements": args.measurements, "old_cost": spec.cost.model_dump()}
    out.update(fit.to_dict())
    if args.write_spec:
        note = f"fitted by loom calibrate: {fit.runs} runs, R2 {fit.r2:.4f}, median error {fit.median_rel_error:.1%}"
        text, kept = with_cost_block(Path(args.spec).read_text(), fit.cost, note)
        Path(args.write_spec).write_text(text)
        load_spec(args.write_spec, check_paths=False)  # the written spec must load
        out["written_spec"] = {"path": args.write_spec, "comments_kept": kept}
    index = read_spec_index(spec) if args.replan else None
    if index is not None:
        out["balance"] = balance_change(spec, fit.cost, index=index[0], fingerprints=index[1]).to_dict()
    else:
        out["balance"] = None
    if args.json:
        _print_json(out)
        return 0
    c = fit.cost
    print(f"fitted on {fit.runs} runs: attention {c.attention:.6g}, linear {c.linear:.6g}, encoder {c.encoder:.6g}")
    print(
        f"  (was {spec.cost.attention:.6g} / {spec.cost.linear:.6g} / {spec.cost.encoder:.6g}); attention = linear "
        f"at L = {fit.crossover_length:,.0f}; {fit.seconds_per_unit:.4g} s per cost unit"
    )
    print(
        f"  fit quality: R2 {fit.r2:.4f}, relative error per run: median {fit.median_rel_error:.1%}, "
        f"p90 {fit.p90_rel_error:.1%}"
    )
    if args.write_spec:
        how = "comments kept" if out["written_spec"]["comments_kept"] else "comments dropped"
        print(f"  spec with the fitted cost written to {args.write_spec} ({how})")
    if out["balance"] is not None:
        b = out["balance"]
        old, new = b["old_plan_max_over_mean"]["fitted_cost"], b["new_plan_max_over_mean"]["fitted_cost"]
        print(
            f"  predicted max/mean rank cost under the fitted cost: plan with the old cost {old:.4f}, "
            f"re-plan {new:.4f} (predicted step-time gain of the re-plan {b['predicted_gain_of_replan']:.3f}x)"
        )
    else:
        why = "--no-replan" if not args.replan else f"no index under {spec.index_dir}"
        print(f"  balance change not computed ({why})")
    return 0


IN_PROCESS_ARROW_POOL = "jemalloc"
"""Arrow's allocator chosen for `loom serve --workers 0` before pyarrow loads (a user's own setting wins): the
workers' (`execution._arrow_pool.WORKER_ARROW_POOL`)."""


def _arrow_pool_before_import(args: argparse.Namespace) -> None:
    """Choose this serving process's Arrow allocator before pyarrow loads (`execution._arrow_pool`).

    Arrow ties part of its allocations to the pool chosen at import, so setting it later is too late. With
    `--workers 0` the worker runs here: jemalloc (the in-process layout held 809 MiB warm without it and 405 MiB
    with it at 300 sources, 16 ranks; results/memory_n300_r16_s8_loomonly_inprocess*.json). Otherwise this
    process runs the scheduler and the Executor, whose manifest scans kept 25-37 MiB of mimalloc's freed pages:
    glibc's allocator (the workers still get jemalloc). A user's ARROW_DEFAULT_MEMORY_POOL wins; nothing changes
    where pyarrow is loaded already.
    """
    from loomdata.execution._arrow_pool import choose_before_import, serving_pool

    choose_before_import(serving_pool(args.workers, args.scheduler))


def _cmd_serve(args: argparse.Namespace) -> int:
    _arrow_pool_before_import(args)
    from loomdata.execution import Autoscaling, ServeConfig, serve

    try:
        config = ServeConfig(
            constructors=args.constructors,
            window=args.window,
            n_workers=args.workers,
            peers=args.peers,
            loaders_per_source=args.loaders_per_source,
            autoscale=Autoscaling() if args.autoscale else None,
            loader_memory=args.loader_memory * 1024 * 1024,
            bytes_in_flight=args.bytes_in_flight * 1024,
            constructor_bytes=args.constructor_bytes * 1024,
            loader_prefetch=args.loader_prefetch,
            local_read_ahead=args.local_read_ahead,
        )
    except ValueError as e:
        print(f"loom serve: error: {e}", file=sys.stderr)
        return 2
    serve(
        Path(args.plan_dir),
        config,
        scheduler=args.scheduler,
        json_out=args.json,
        tls=_tls(args),
        insecure=args.insecure,
        dashboard=args.dashboard,
        spec=args.spec,
    )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from loomdata._demo import run_demo

    report = run_demo(
        spec_path=Path(args.spec),
        data_dir=Path(args.data),
        size=args.size,
        ranks=args.ranks,
        scheduler=args.scheduler,
        progress=_progress_wanted(args),
        echo=(lambda _msg: None) if args.json else print,
        tls=_tls(args),
        insecure=args.insecure,
        dashboard=args.dashboard,
    )
    if args.json:
        _print_json(report)
    return 0


def _print_table_dict(rows: dict[str, dict[str, Any]], label: str = "source") -> None:
    """Print {row name: {column: value}} as an aligned table."""
    if not rows:
        return
    cols = list(next(iter(rows.values())).keys())
    cols = [c for c in cols if not isinstance(next(iter(rows.values()))[c], (dict, list))]
    header = [label, *cols]
    table = [[name] + [_fmt(r.get(c)) for c in cols] for name, r in rows.items()]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table, strict=True)]
    for line in [header, *table]:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths, strict=True)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _print_report(report: dict[str, Any]) -> None:
    """Human form of a plan report: scalar figures first, then nested sections as tables."""
    for k, v in report.items():
        if not isinstance(v, (dict, list)):
            print(f"{k:>28}: {_fmt(v)}")
    for k, v in report.items():
        if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
            print(f"\n{k}:")
            _print_table_dict(v, label="")
        elif isinstance(v, dict):
            print(f"\n{k}: " + ", ".join(f"{a}={_fmt(b)}" for a, b in v.items()))


def _parser() -> argparse.ArgumentParser:
    from loomdata.execution import ServeConfig

    defaults = ServeConfig()  # the one place serving defaults live
    p = argparse.ArgumentParser(prog="loom", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(fn=fn)
        sp.add_argument("--json", action="store_true", help="print only JSON")
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks")
        return sp

    g = add("generate", _cmd_generate, "write a seeded multi-source corpus (Parquet, JSONL, Megatron, WebDataset)")
    g.add_argument("dir")
    g.add_argument("--size", choices=["tiny", "small", "large"], default="tiny")
    g.add_argument("--seed", type=int, default=0)

    i = add("index", _cmd_index, "scan every source of SPEC into index tables (a Dask job)")
    i.add_argument("spec")
    i.add_argument("--scheduler", default=None, help="address of an existing Dask scheduler")
    i.add_argument(
        "--workers", type=int, default=defaults.n_workers, help="worker processes of the embedded LocalCluster"
    )
    _add_security(i, dashboard=False)

    pl = add("plan", _cmd_plan, "make the global plan (manifest) for SPEC from its index")
    pl.add_argument("spec")
    pl.add_argument(
        "--resume-from",
        default=None,
        metavar="PLAN_DIR",
        help="elastic resume: keep this plan's steps before --at-step, re-plan the rest for SPEC's training shape",
    )
    pl.add_argument("--at-step", type=int, default=None, metavar="S")
    pl.add_argument("--scheduler", default=None, help="balance step ranges on this Dask scheduler's workers")
    pl.add_argument(
        "--workers",
        type=int,
        default=defaults.n_workers,
        help="worker processes of an embedded LocalCluster, started only for an index of 20M+ samples; 1: never",
    )
    _add_security(pl, dashboard=False)

    ins = add("inspect", _cmd_inspect, "report on a stored plan (imbalance vs baseline, mixture)")
    ins.add_argument("plan_dir")
    ins.add_argument("--plot", default=None, metavar="OUT.png")
    ins.add_argument(
        "--steps", default=None, metavar="FIRST:LAST", help="also figures of these steps (read by step range)"
    )

    cal = add(
        "calibrate",
        _cmd_calibrate,
        "fit SPEC's cost model to measured times (MEASUREMENTS: JSON lines, one per rank per micro-batch or step: "
        '{"lengths": [segment tokens, ...], "image_tokens": [...] optional, "seconds": float}); print the fit '
        "quality and, when SPEC is indexed, how the predicted balance of a re-plan changes",
    )
    cal.add_argument("spec")
    cal.add_argument("measurements")
    cal.add_argument("--write-spec", default=None, metavar="OUT.yaml", help="write SPEC with the fitted `cost:` block")
    cal.add_argument(
        "--replan",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan with the old and the fitted cost (in a temporary folder) to compare their balance",
    )

    s = add("serve", _cmd_serve, "serve a plan's batches from Source Loader and Data Constructor actors")
    s.add_argument("plan_dir")
    s.add_argument(
        "--spec",
        default=None,
        metavar="SPEC.yaml",
        help="the spec the plan was made from: its sources' storage_options (endpoints, credentials) reach the "
        "loaders in memory, never a file (plan.json holds none); refused unless it is the plan's spec",
    )
    s.add_argument("--scheduler", default=None)
    s.add_argument("--constructors", type=int, default=defaults.constructors)
    s.add_argument("--window", type=int, default=defaults.window, help="steps built ahead of the slowest rank")
    s.add_argument(
        "--workers",
        type=int,
        default=defaults.n_workers,
        help="worker processes of the embedded LocalCluster; 0: one worker thread inside the serving process "
        "(least memory: Arrow's allocator is jemalloc unless ARROW_DEFAULT_MEMORY_POOL says otherwise; no worker can "
        "be lost alone, so none is recovered)",
    )
    s.add_argument("--peers", type=int, default=None, help="processes per dp rank (default: the plan's tp*pp*cp)")
    s.add_argument(
        "--loaders-per-source",
        type=int,
        default=defaults.loaders_for(""),
        help="Source Loader actors per source (the start, with autoscale)",
    )
    s.add_argument(
        "--loader-memory",
        type=int,
        default=defaults.loader_memory // (1024 * 1024),
        metavar="MIB",
        help="MiB of decoded rows the loaders on one worker keep together (the rows planned steps read, or a "
        "whole row group when enough of it is), each until its last planned use; a cap",
    )
    s.add_argument(
        "--bytes-in-flight",
        type=int,
        default=defaults.bytes_in_flight // 1024,
        metavar="KIB",
        help="KiB of a rank's batches built ahead of it (the window widens to hold them; a take moves up to half)",
    )
    s.add_argument(
        "--constructor-bytes",
        type=int,
        default=defaults.constructor_bytes // 1024,
        metavar="KIB",
        help="KiB of batches one constructor builds ahead for all its ranks together (each rank gets at most "
        "--bytes-in-flight of it, and never fewer than 64 steps where --bytes-in-flight holds them; 0: --window alone)",
    )
    s.add_argument(
        "--loader-prefetch",
        type=int,
        default=defaults.loader_prefetch,
        metavar="N",
        help="row groups each loader reads ahead at once for its next planned steps, within --loader-memory (0: none; "
        "object URLs: at least N, more when the measured rate x the store's latency needs them, at most 32)",
    )
    s.add_argument(
        "--local-read-ahead",
        choices=["auto", "on", "off"],
        default=defaults.local_read_ahead,
        help="whether loaders of local files read ahead (--loader-prefetch deep): auto (default) only once their own "
        "reads are measured to stall the steps (a cold or networked disk), on, or off; object URLs always read ahead",
    )
    s.add_argument(
        "--autoscale",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="resize each source's loaders by demand x measured cost while serving "
        "(--no-autoscale: a fixed --loaders-per-source)",
    )
    _add_security(s)

    d = add("demo", _cmd_demo, "generate, index, plan, serve and train tiny ranks end to end")
    d.add_argument("--spec", default="configs/demo.yaml")
    d.add_argument("--data", default="demo-work/data", help="where the demo corpus is generated")
    d.add_argument("--size", choices=["tiny", "small", "large"], default="tiny")
    d.add_argument("--ranks", type=int, default=4)
    d.add_argument("--scheduler", default=None)
    _add_security(d)

    c = add("certs", _cmd_certs, "create a CA and scheduler, worker and client TLS certificates in DIR")
    c.add_argument("dir")
    c.add_argument("--host", action="append", default=[], help="a host name or IP to name in the certificates")
    c.add_argument("--days", type=int, default=365, help="how long the certificates are valid")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `loom` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "plan" and (args.resume_from is None) != (args.at_step is None):
        parser.error("--resume-from and --at-step go together: the base plan dir and the step to re-plan from")
    try:
        code: int = args.fn(args)
        return code
    except LoomError as e:
        if args.debug:
            raise
        print(f"loom {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"loom {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
