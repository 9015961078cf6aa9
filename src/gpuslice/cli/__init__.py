"""``gpuslice`` command line: one module per command group, each with ``register(sub)``.

``main()`` returns an exit code (``cli/common.py`` and docs/cli.md's table): 0 ok, 1 a check
failed, 2 usage error or bad input, 3 not running, 130 interrupted.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gpuslice._version import VersionAction
from gpuslice.cli import (
    bench,
    demo,
    dev_cluster,
    dra_allocator,
    dra_driver,
    extender,
    gpus,
    local,
    mig,
    mps_host,
    node_agent,
    plan,
    profile,
    reconfig,
    replan,
    router,
    simulate,
    webhook,
)
from gpuslice.cli.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    Parser,
    examples,
    make_console,
)
from gpuslice.cli.flagtypes import parse_policies, parse_seeds
from gpuslice.core.errors import GpusliceError, Unavailable

__all__ = ["main", "parse_policies", "parse_seeds"]

# the order of `gpuslice --help`
COMMANDS = (simulate, plan, replan, router, extender, webhook, node_agent, mps_host, dra_driver,
            mig, gpus, demo, local, reconfig, dra_allocator, profile, bench, dev_cluster)


def _build_parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="gpuslice", description="GPU sharing for ML inference on Kubernetes: slices, "
        "fragmentation-aware placement, SLA planning and request routing. Exit codes: 0 ok, "
        "1 a check failed, 2 usage error or bad input, 3 not running, 130 interrupted.",
        epilog=examples("gpuslice plan --example", "gpuslice up examples/local/tiny.yaml "
                        "--fake-gpus 1"))
    ap.add_argument("--version", action=VersionAction)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND",
                            title="commands (gpuslice COMMAND --help for each)")
    for command in COMMANDS:
        command.register(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    console = make_console()
    err = make_console(stderr=True)
    try:
        args = _build_parser().parse_args(argv)
        return int(args.handler(args, console))
    except Unavailable as exc:  # the input was fine; what it needs is not here
        err.print(f"gpuslice: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_FAILED
    except GpusliceError as exc:
        err.print(f"gpuslice: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_USAGE
    # what an input can make a reader raise before any check of its own sees it: bad input too
    except UnicodeDecodeError as exc:
        err.print(f"gpuslice: error: an input file is not UTF-8 text ({exc.reason} at byte "
                  f"{exc.start})", markup=False, highlight=False, soft_wrap=True)
        return EXIT_USAGE
    except OverflowError as exc:
        err.print(f"gpuslice: error: a number in the input is too large ({exc})", markup=False,
                  highlight=False, soft_wrap=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.print("gpuslice: interrupted")
        return EXIT_INTERRUPTED
