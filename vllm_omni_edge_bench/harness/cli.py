"""edge-harness: measure arms of a grid in interleaved passes, then report.

    edge-harness run GRID.yaml [--out DIR] [--passes N] [--rotate] [--reverse-alternate] [--prime] [--keep-going]
    edge-harness report DIR
    edge-harness standing [--update FILE]
    edge-harness results-index [--write FILE | --check FILE]
    edge-harness routing-table [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_omni_edge_bench.harness.grid import GridError, describe_axes, load_grid, parse_grid

EXIT_OK, EXIT_NOT_OK, EXIT_BAD_GRID = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    axes = "Every axis a grid file can set:\n\n" + describe_axes()
    parser = argparse.ArgumentParser(
        prog="edge-harness", description=__doc__, epilog=axes, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run", help="run a grid and write its artifacts and report", epilog=axes,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("grid", type=Path, help="grid YAML file (see the axes below)")
    run.add_argument("--out", type=Path, help="results directory [default: results/<date>-<grid name>]")
    run.add_argument("--passes", type=int, help="override the grid's passes (at least 3)")
    run.add_argument("--rotate", action="store_true", help="rotate the first arm of each pass")
    run.add_argument("--reverse-alternate", action="store_true",
                     help="run every other pass in reverse order, so no arm always follows the same arm")
    run.add_argument("--prime", action="store_true",
                     help="run each vLLM arm once, unmeasured, before the passes (fills compile caches)")
    run.add_argument("--timeout-s", type=float, help="override the grid's per-pass timeout")
    run.add_argument("--keep-going", action="store_true",
                     help="run every pass even after one crashed or was invalid (default: stop)")
    run.add_argument("--sample-interval-ms", type=float, default=200.0, help="memory ledger interval [200]")
    run.add_argument("--check", action="store_true", help="validate the grid and print the schedule; run nothing")
    run.add_argument("--smoke", action="store_true",
                     help="prove the arms run: --passes may be 1 or 2; the report is headed 'smoke', not a measurement")

    report = commands.add_parser("report", help="render report.md and PNGs from a results directory")
    report.add_argument("results_dir", type=Path)
    report.add_argument("--resummarise", action="store_true",
                        help="recompute summary.json from the pass records first (figures added to the harness "
                             "since the run, e.g. tree PSS workload peak); the pass records are not touched")
    standing = commands.add_parser(
        "standing", help="the current-standing table from the runs listed in docs/edge/standing-runs.txt")
    standing.add_argument("--update", type=Path, metavar="FILE",
                          help="rewrite the table between the standing markers in FILE (e.g. README.md)")
    index = commands.add_parser(
        "results-index", help="docs/edge/results.md: the current-standing table and one line per results directory")
    where = index.add_mutually_exclusive_group()
    where.add_argument("--write", type=Path, metavar="FILE", help="write the page to FILE (e.g. docs/edge/results.md)")
    where.add_argument("--check", type=Path, metavar="FILE", help="exit 1 if FILE is not what would be written")
    routing = commands.add_parser(
        "routing-table", help="regenerate vllm_omni_edge/routing/measured_paths.json (and docs/edge/routing.md's copy) "
                              "from the harness's routing_sources/")
    routing.add_argument("--check", action="store_true", help="exit 1 if either is not what the sources give")
    return parser


def _results_index(args: argparse.Namespace) -> int:
    from vllm_omni_edge_bench.harness import results_index, standing

    try:
        page = results_index.render()
    except (standing.StandingError, FileNotFoundError) as error:
        print(f"edge-harness results-index: {error}", file=sys.stderr)
        return EXIT_NOT_OK
    if args.check:
        current = args.check.is_file() and args.check.read_text() == page
        print(f"{args.check}: {'current' if current else 'stale: run edge-harness results-index --write ' + str(args.check)}")
        return EXIT_OK if current else EXIT_NOT_OK
    if args.write:
        changed = not args.write.is_file() or args.write.read_text() != page
        if changed:
            args.write.write_text(page)
        print(f"{args.write}: {'written' if changed else 'already current'}")
    else:
        sys.stdout.write(page)
    return EXIT_OK


def _routing_table(args: argparse.Namespace) -> int:
    from vllm_omni_edge_bench.harness import routing_table

    if args.check:
        stale = routing_table.stale()
        for path in stale:
            print(f"{path}: stale: run edge-harness routing-table")
        if not stale:
            print("routing table: current")
        return EXIT_NOT_OK if stale else EXIT_OK
    _table, changed = routing_table.regenerate()
    for path in changed:
        print(f"{path}: written")
    if not changed:
        print("routing table: already current")
    return EXIT_OK


def _standing(args: argparse.Namespace) -> int:
    from vllm_omni_edge_bench.harness import standing

    try:
        table = standing.render(standing.listed_runs(), standing.listed_arms())
        if args.update:
            changed = standing.update(args.update, table)
            print(f"{args.update}: {'updated' if changed else 'already current'}")
        else:
            print(table)
    except (standing.StandingError, FileNotFoundError) as error:
        print(f"edge-harness standing: {error}", file=sys.stderr)
        return EXIT_NOT_OK
    return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    from vllm_omni_edge_bench.harness import runner
    from vllm_omni_edge_bench.harness.report import write_report
    from vllm_omni_edge_bench.harness.schedule import interleaved

    grid, text = load_grid(args.grid)
    overrides = {
        key: value
        for key, value in (("passes", args.passes), ("timeout_s", args.timeout_s), ("rotate_start", args.rotate or None),
                             ("reverse_alternate", args.reverse_alternate or None),
                             ("prime", args.prime or None))
        if value is not None
    }
    if args.smoke:
        overrides["smoke"] = True
        smoke_passes = overrides.pop("passes", 1)
        if not 1 <= smoke_passes <= 2:
            raise GridError(f"--smoke takes --passes 1 or 2, not {smoke_passes} (3 or more is a measurement)")
        grid = parse_grid({**grid.model_dump(), **{k: v for k, v in overrides.items() if k != "smoke"}})
        grid = grid.model_copy(update={"passes": smoke_passes})  # below the grid's minimum: smoke only
        overrides["passes"] = smoke_passes
    elif overrides:
        grid = parse_grid({**grid.model_dump(), **overrides})  # validated again: --passes 2 is refused
    if args.check:
        runner.check_runnable(grid)
        for scheduled in interleaved(grid.arm_names, grid.passes, grid.rotate_start, grid.reverse_alternate):
            print(f"{scheduled.seq:3d}  pass {scheduled.pass_index}  {scheduled.arm}")
        return EXIT_OK
    out = args.out or runner.default_out_dir(grid)
    options = runner.RunOptions(keep_going=args.keep_going, sample_interval_s=args.sample_interval_ms / 1000)
    summary = runner.run_grid(grid, text, out, options, overrides=overrides)
    report = write_report(out)
    print(f"{summary['status']}: {report}")
    for reason in summary.get("reasons", []):
        print(f"  {reason}")
    return EXIT_OK if summary["status"] == "ok" else EXIT_NOT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "standing":
            return _standing(args)
        if args.command == "results-index":
            return _results_index(args)
        if args.command == "routing-table":
            return _routing_table(args)
        from vllm_omni_edge_bench.harness.report import load_artifacts, resummarise, write_report

        if args.resummarise:
            resummarise(args.results_dir)
        path = write_report(args.results_dir)
        status = load_artifacts(args.results_dir)["summary"]["status"]
        print(f"{status}: {path}")
        return EXIT_OK
    except GridError as error:
        print(f"edge-harness: grid error:\n{error}", file=sys.stderr)
        return EXIT_BAD_GRID
    except FileExistsError as error:
        print(f"edge-harness: {error}", file=sys.stderr)
        return EXIT_BAD_GRID


if __name__ == "__main__":
    sys.exit(main())
