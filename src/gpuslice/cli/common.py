"""What several command modules share: argument parsers, small readers, the console, the
``-o json`` output and the ``--log-format`` logging of long-running components.

Exit codes, the same for every command (README, "Exit codes"):

====  =====================================================================================
0     success
1     the command ran and found a failure: a check failed, a service could not be planned,
      a layout is invalid, a benchmark gate failed, no GPU to act on
2     usage error or bad input: unknown option, bad value, unreadable or invalid file
      (the message names the option or the file and field, and what was expected)
3     not running: ``gpuslice status`` with no local mode running
130   interrupted (Ctrl-C)
====  =====================================================================================
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from rich.console import Console

from gpuslice.core.errors import ValidationError
from gpuslice.core.policies import make_policy, policy_names

if TYPE_CHECKING:
    import argparse

    from gpuslice.adapters.nvml.port import NvmlPort

# the type of argparse's add_subparsers() (a string: the class is not generic at run time)
Sub: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

KUBECONFIG_HELP = ("kubeconfig file (default: the service account's in a pod, else $KUBECONFIG "
                   "or ~/.kube/config)")


def parse_seeds(text: str) -> list[int]:
    """``42-51``, ``42,43`` or ``42`` -> a list of seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        item = part.strip()
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        try:
            if sep:
                a, b = int(lo), int(hi)
                if b < a:
                    raise ValueError
                seeds.extend(range(a, b + 1))
            else:
                seeds.append(int(item))
        except ValueError:
            raise ValidationError("--seeds", "seeds like 42-51, 42,43 or 42", text) from None
    if not seeds:
        raise ValidationError("--seeds", "at least one seed", text)
    return seeds


def parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ValidationError("--policy", f"policy names from {', '.join(policy_names())}", text)
    for n in names:
        make_policy(n)
    return names


def read_key(path: Path) -> bytes:
    """The HMAC key shared by the extender and the node agents, from its file."""
    try:
        key = path.read_bytes().strip()
    except OSError as exc:
        raise ValidationError("--key-file", "a readable file", str(exc)) from None
    if len(key) < 16:
        raise ValidationError("--key-file", "a key of at least 16 bytes", len(key))
    return key


FAKE_GPUS_HELP = ("N: N simulated A100-80GB GPUs (no CUDA and no MPS: the replicas run on "
                  "the CPU; to try local mode on a laptop), or a fake NVML inventory (YAML)")


def simulated_gpus(args: argparse.Namespace) -> int | None:
    """The N of ``--fake-gpus N``, or None (real GPUs or a YAML inventory)."""
    text = getattr(args, "fake_gpus", None)
    if text is None or not str(text).strip().isdigit():
        return None
    n = int(str(text))
    if not 1 <= n <= 64:
        raise ValidationError("--fake-gpus", "1 to 64 simulated GPUs, or a YAML inventory", n)
    return n


def local_nvml(args: argparse.Namespace) -> NvmlPort:
    from gpuslice.adapters.nvml.port import FakeNvml
    from gpuslice.adapters.nvml.real import load

    n = simulated_gpus(args)
    if n is not None:
        return FakeNvml.simulated(n)
    if args.fake_gpus:
        path = Path(args.fake_gpus)
        if not path.is_file():
            raise ValidationError("--fake-gpus", "a number of simulated GPUs or a YAML "
                                  "inventory file", str(path))
        return FakeNvml.from_yaml(path, "local")
    return load()


# ---- exit codes ---------------------------------------------------------------------------

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_RUNNING = 3
EXIT_INTERRUPTED = 130

# ---- console and -o json --------------------------------------------------------------------

# a pipe or a file gets whole lines: rich would otherwise cut tables to 80 columns
PIPE_WIDTH = 1000


def make_console(*, stderr: bool = False) -> Console:
    """A rich console; when the output is not a terminal, as wide as the content needs."""
    console = Console(stderr=stderr)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, width=int(os.environ.get("COLUMNS") or PIPE_WIDTH))


def add_output(p: argparse.ArgumentParser) -> None:
    """``-o/--output table|json`` on a listing or status command."""
    p.add_argument("-o", "--output", choices=("table", "json"), default="table",
                   help="table (default) or json: one JSON document on stdout")


def print_json(doc: object) -> None:
    sys.stdout.write(json.dumps(doc, indent=1, default=str) + "\n")
    sys.stdout.flush()


# ---- --log-format ---------------------------------------------------------------------------

LOG_FORMATS = ("text", "json")


def add_log_format(p: argparse.ArgumentParser) -> None:
    """``--log-format text|json`` on a long-running component (its log goes to stderr)."""
    p.add_argument("--log-format", choices=LOG_FORMATS,
                   default=os.environ.get("GPUSLICE_LOG_FORMAT", "text"),
                   help="log lines on stderr as text (default, or $GPUSLICE_LOG_FORMAT) or as "
                   "one JSON object per line (ts, level, component, msg and the event's "
                   "fields)")


# attributes every LogRecord has: the rest were passed with extra={...}
_RECORD_KEYS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "component"}


class JsonFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "component": self.component,
            "logger": record.name, "msg": record.getMessage()}
        doc.update(fields(record))
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        line = f"{ts} {record.levelname:<7} {self.component}: {record.getMessage()}"
        extra = fields(record)
        if extra:
            line += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def fields(record: logging.LogRecord) -> Mapping[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _RECORD_KEYS}


def setup_logging(fmt: str, component: str, level: int = logging.INFO) -> logging.Logger:
    """Send the ``gpuslice`` loggers to stderr in ``fmt`` (text or json); returns the
    component's logger (``gpuslice.<component>``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component) if fmt == "json" else TextFormatter(component))
    root = logging.getLogger("gpuslice")
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    return logging.getLogger(f"gpuslice.{component}")
