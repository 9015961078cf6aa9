"""What several command modules share: argument parsers, small readers, the console, the
``-o json`` output and the ``--log-format`` logging of long-running components (the parsers
of option values, ``type=positive_float`` and the like, are in ``cli/flagtypes.py``).

Exit codes, the same for every command (docs/cli.md, "Exit codes"):

====  =====================================================================================
0     success
1     the command ran and found a failure: a check failed, a service could not be planned,
      a layout is invalid, a benchmark gate failed, no GPU to act on
2     usage error or bad input: unknown option, bad value, unreadable or invalid file
      (the message names the option or the file and field, and what was expected)
3     not running: ``gpuslice status`` or ``switch`` with no local mode running
130   interrupted (Ctrl-C)
====  =====================================================================================
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import math
import os
import re
import sys
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

from rich.console import Console

from gpuslice.core.errors import Unavailable, ValidationError

if TYPE_CHECKING:
    from gpuslice.adapters.nvml.port import NvmlPort

# the type of argparse's add_subparsers() (a string: the class is not generic at run time)
Sub: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

KUBECONFIG_HELP = ("kubeconfig file (default: the service account's in a pod, else $KUBECONFIG "
                   "or ~/.kube/config)")


# ---- the parsers: help layout, examples, unknown options, deprecated spellings ---------------


class HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, except that in a description or an epilog a line that starts with
    a space is kept as written (the examples), while the other lines are wrapped."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        for line in text.splitlines():
            if line.startswith(" ") or not line.strip():
                out.append(indent + line if line.strip() else "")
            else:
                out.append(textwrap.fill(" ".join(line.split()), width,
                                         initial_indent=indent, subsequent_indent=indent))
        return "\n".join(out)


def examples(*lines: str) -> str:
    """The epilog of a command's help: one or two example command lines."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


class Parser(argparse.ArgumentParser):
    """Every ``gpuslice`` parser (``add_subparsers`` makes its sub-commands of the same class):
    examples kept as written; an unknown option is refused by the sub-command it was given to,
    with that sub-command's usage (argparse would show the top level's); a missing
    sub-command is named with the choices and what each does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        ns, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(unknown_arguments(self, extra))
        return ns, extra

    def error(self, message: str) -> NoReturn:
        missing = re.fullmatch(r"the following arguments are required: (.*)", message)
        commands = self._commands()
        if missing and commands is not None and {commands.dest, commands.metavar} & set(
                missing.group(1).split(", ")):
            # `gpuslice --nonsense`: the option is named, then the commands
            unknown = [t for t in getattr(self, "_given", []) if t.startswith("-") and
                       t.split("=", 1)[0] not in self._option_string_actions]
            message = missing_command(self.prog, commands)
            if unknown:
                message = f"{unknown_arguments(self, unknown)}; {message}"
        choice = re.match(r"argument (\S+): invalid choice: '?([^'\s]*)'?", message)
        if choice:  # the action it names: "argument --objective" or "argument COMMAND"
            named = [a for a in self._actions if choice.group(1) in
                     (*a.option_strings, "/".join(a.option_strings), a.metavar, a.dest)]
            message += did_you_mean(choice.group(2), named)
        super().error(message)

    def _commands(self) -> argparse._SubParsersAction[argparse.ArgumentParser] | None:
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                return a
        return None


def unknown_arguments(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """``unrecognized arguments: --exmaple (--exmaple: did you mean --example?)``: the
    options given that the parser does not know, and a close match of each where there is
    one (among the options its help lists)."""
    known = [o for a in parser._actions if a.help != argparse.SUPPRESS
             for o in a.option_strings]
    hints = []
    for text in extra:
        if text.startswith("-"):
            close = difflib.get_close_matches(text.split("=", 1)[0], known, n=1, cutoff=0.75)
            if close:
                hints.append(f"{text}: did you mean {close[0]}?")
    return f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})"
                                                           if hints else "")


def did_you_mean(text: str, actions: Sequence[argparse.Action]) -> str:
    """`` (did you mean simulate?)`` for an invalid choice (a command, or an option's value)
    close to one of the choices of ``actions``; empty when none is close."""
    for action in actions:
        if action.choices is None:
            continue
        close = difflib.get_close_matches(text, [str(c) for c in action.choices], n=1,
                                          cutoff=0.75)
        if close and text not in action.choices:
            return f" (did you mean {close[0]}?)"
    return ""


def missing_command(prog: str, commands: argparse._SubParsersAction[argparse.ArgumentParser],
                    ) -> str:
    """``gpuslice bench``, no command: which there are, and what each does (names only when
    there are many)."""
    helps = {a.dest: a.help for a in commands._choices_actions}
    if len(helps) <= 4:
        listed = "; ".join(f"{name} ({helps[name]})" if helps.get(name) else name
                           for name in commands.choices)
    else:
        listed = ", ".join(commands.choices)
    return f"which command? '{prog}' needs one of: {listed} ('{prog} COMMAND --help' for more)"


class DeprecatedAlias(argparse.Action):
    """An old spelling of an option, kept working but hidden from the help: it does what the
    new spelling does, after a one-line note on stderr naming the new one."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str,
                 apply: Callable[[argparse.ArgumentParser, argparse.Namespace, Any], None],
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new, self.apply = new, apply

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        sys.stderr.write(f"{parser.prog}: note: {option_string} is deprecated and will be "
                         f"removed; use {self.new}\n")
        self.apply(parser, namespace, values)


def deprecated_alias(p: argparse.ArgumentParser, old: str, new: argparse.Action, *,
                     value: object = None,
                     apply: Callable[[argparse.Namespace, str], None] | None = None,
                     metavar: str | None = None) -> argparse.Action:
    """Keep ``old`` working as a hidden spelling of the option ``new`` (the action
    ``add_argument`` returned): given ``value``, ``old`` takes no argument and means ``new
    value`` (``--json`` -> ``-o json``); given ``apply``, its argument goes to ``apply(args,
    text)``; else it takes what ``new`` takes."""
    name = max(new.option_strings, key=len)
    if value is not None:
        fixed = str(value)

        def set_value(parser: argparse.ArgumentParser, ns: argparse.Namespace,
                      _: object) -> None:
            new(parser, ns, fixed, name)

        return p.add_argument(old, action=DeprecatedAlias, dest=argparse.SUPPRESS, nargs=0,
                              default=argparse.SUPPRESS,
                              new=f"{'/'.join(new.option_strings)} {value}",
                              apply=set_value)
    if apply is not None:
        fn = apply

        def apply_text(parser: argparse.ArgumentParser, ns: argparse.Namespace,
                       text: str) -> None:
            fn(ns, text)

        return p.add_argument(old, action=DeprecatedAlias, dest=argparse.SUPPRESS,
                              default=argparse.SUPPRESS, new=f"{name} {new.metavar or ''}"
                              .strip(), apply=apply_text, metavar=metavar)

    def same(parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any) -> None:
        new(parser, ns, values, name)

    kwargs: dict[str, Any] = {"type": new.type} if new.type is not None else {}
    return p.add_argument(old, action=DeprecatedAlias, dest=argparse.SUPPRESS, nargs=new.nargs,
                          choices=new.choices, default=argparse.SUPPRESS, metavar=new.metavar,
                          new=name, apply=same, **kwargs)


def add_write_json(p: argparse.ArgumentParser, what: str) -> None:
    """``--write-json FILE`` (formerly ``--json FILE``: ``--json`` is ``-o json`` elsewhere)."""
    new = p.add_argument("--write-json", type=Path, metavar="FILE",
                         help=f"write {what} as JSON to FILE (-o json prints it instead)")
    deprecated_alias(p, "--json", new)


def add_export_dir(p: argparse.ArgumentParser, what: str) -> None:
    """``--out DIR``, where the plan's files go: the one spelling of an output folder
    (simulate, demo, bench); ``--export DIR``, its former spelling (``--export`` is a format
    in ``router``), still works, hidden."""
    new = p.add_argument("--out", type=Path, metavar="DIR",
                         help=f"write plan.json, mig-parted.yaml and manifests.yaml{what} into "
                         "this folder")
    deprecated_alias(p, "--export", new)


def add_lease(p: argparse.ArgumentParser, default: str, help: str, *,
              none: bool = False) -> argparse.Action:
    """``--lease NAMESPACE/NAME`` (``|none`` where a Lease is optional): one spelling of a
    Lease on every command."""
    return p.add_argument("--lease", default=default,
                          metavar="NAMESPACE/NAME|none" if none else "NAMESPACE/NAME",
                          help=f"{help} (default {default})")


PREVIOUS_KEY_HELP = ("during a key rotation, a file holding the previous HMAC key: "
                     "assignments it signed still verify (running pods keep their GPUs), new "
                     "ones are signed with --key-file's; a path that does not exist is no "
                     "previous key (the Secret's optional 'previous' entry)")


def read_previous_keys(path: Path | None) -> tuple[bytes, ...]:
    """The previous key of a rotation from ``path`` (none when the path is not given or the
    file does not exist: the Secret's entry is optional)."""
    if path is None or not path.exists():
        return ()
    try:
        return (read_key(path),)
    except ValidationError as exc:
        raise ValidationError("--previous-key-file", exc.expected, exc.got) from None


def read_key(path: Path) -> bytes:
    """The HMAC key shared by the extender and the node agents, from its file."""
    try:
        key = path.read_bytes().strip()
    except OSError as exc:
        raise ValidationError("--key-file", "a readable file", str(exc)) from None
    if len(key) < 16:
        raise ValidationError("--key-file", "a key of at least 16 bytes", len(key))
    return key


# ---- input files (argparse types) and outputs checked before the work --------------------


def input_path(kind: str) -> Callable[[str], Path]:
    """argparse ``type=`` of an input file option that also takes the inputs shipped with
    gpuslice by name (``builtin:NAME``, ``adapters/profiles/builtin.py``): a path, or the
    shipped file's path; an unknown name is refused at parse time, listing the known ones."""
    from gpuslice.adapters.profiles import builtin

    def parse(text: str) -> Path:
        if not builtin.is_builtin(text):
            return Path(text)
        try:
            return builtin.resolve(kind, text, kind)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(f"expected a path or one of {exc.expected}, "
                                             f"got {text!r}") from None

    parse.__name__ = f"{kind} file"  # argparse names the type in some messages
    return parse


def builtin_help(kind: str) -> str:
    """The help text's note of the shipped inputs of ``kind``."""
    from gpuslice.adapters.profiles import builtin

    shipped = ", ".join(builtin.PREFIX + n for n in builtin.names(kind)) or "none"
    return f"or a name shipped with gpuslice: {shipped}"


def builtin_path(kind: str, name: str) -> Path:
    """The path of a shipped input (``--example``'s defaults)."""
    from gpuslice.adapters.profiles import builtin

    return builtin.resolve(kind, name, kind)


def read_yaml(path: Path, field: str) -> object:
    """The document of a YAML (or JSON) file; a file that is missing, unreadable or not valid
    YAML is one line naming the file, the line and column, and the problem."""
    import yaml

    from gpuslice.adapters.http.config import read_text
    from gpuslice.adapters.yamlfile import yaml_problem

    text = read_text(path, field)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValidationError(str(path), "valid YAML", yaml_problem(exc)) from None


def writable_dir(path: Path, field: str,
                 expected: str = "a folder that can be created and written") -> Path:
    """Create the output folder ``path`` if need be and check a file can be written in it,
    before the work whose results go there."""
    from gpuslice.adapters.outputs import check_out_dir

    return check_out_dir(path, (), field, expected)


def writable_file(path: Path, field: str) -> Path:
    """Check the output file ``path`` can be written (its folder created if need be; a device
    such as ``/dev/stdout`` will do), before the work whose result goes there."""
    from gpuslice.adapters.outputs import FILE_EXPECTED, check_out_file

    return check_out_file(path, field, devices_ok=True, folder_expected=FILE_EXPECTED)


MPS_HOST_HELP = ("the MPS control daemons are started by `gpuslice mps-host` (its own "
                 "DaemonSet, not rolled by upgrades) from the records this component writes "
                 "in --mps-pipe-dir, so that they outlive this process's pod; without it this "
                 "process starts them and they die with its container")
FAKE_GPUS_HELP = ("N: N simulated A100-80GB GPUs (no CUDA and no MPS: the replicas run on "
                  "the CPU; to try local mode on a laptop), or a fake NVML inventory (YAML)")
FAKE_INVENTORY_HELP = ("instead of NVML: FILE, a fake NVML inventory (YAML, with MIG "
                       "instances and faults), or N simulated A100-80GB GPUs")


def add_fake_gpus(p: argparse.ArgumentParser, help: str = FAKE_GPUS_HELP, *,
                  old_fake: bool = False) -> argparse.Action:
    """``--fake-gpus N|FILE``, the one spelling of "no real GPU" (``old_fake``: keep the
    former ``--fake FILE`` of node-agent, dra-driver and mig-apply as a deprecated one)."""
    new = p.add_argument("--fake-gpus", metavar="N|FILE", help=help)
    if old_fake:
        deprecated_alias(p, "--fake", new)
    return new


def fake_nvml(args: argparse.Namespace, node: str = "local") -> NvmlPort | None:
    """The NVML stand-in ``--fake-gpus`` asks for, or None (real NVML)."""
    from gpuslice.adapters.nvml.port import FakeNvml

    if not getattr(args, "fake_gpus", None):
        return None
    n = simulated_gpus(args)
    if n is not None:
        return FakeNvml.simulated(n)
    path = Path(args.fake_gpus)
    if not path.is_file():
        raise ValidationError("--fake-gpus", "a number of simulated GPUs or a YAML "
                              "inventory file", str(path))
    return FakeNvml.from_yaml(path, node)


def no_gpu(nvml: NvmlPort, what: str = "") -> Unavailable:
    """The one error of every command that needs a GPU and finds none (exit 1): why, and
    how to try the command without one."""
    why = nvml.why_empty() or "none found"
    return Unavailable(f"no GPU{' ' + what if what else ''}: {why}; to try it without one, "
                       "--fake-gpus N simulates N GPUs (--fake-gpus FILE reads a YAML "
                       "inventory)")


def simulated_gpus(args: argparse.Namespace) -> int | None:
    """The N of ``--fake-gpus N``, or None (real GPUs or a YAML inventory)."""
    text = getattr(args, "fake_gpus", None)
    if text is None or not str(text).strip().isdigit():
        return None
    n = int(str(text))
    if not 1 <= n <= 64:
        raise ValidationError("--fake-gpus", "1 to 64 simulated GPUs, or a YAML inventory", n)
    return n


def local_nvml(args: argparse.Namespace, node: str = "local") -> NvmlPort:
    """NVML, or the stand-in ``--fake-gpus`` names."""
    from gpuslice.adapters.nvml.real import load

    fake = fake_nvml(args, node)
    return fake if fake is not None else load()


def local_gpus_or_fail(args: argparse.Namespace) -> NvmlPort:
    """:func:`local_nvml`, refusing with :func:`no_gpu` when it has no GPU."""
    nvml = local_nvml(args)
    if not nvml.devices():
        raise no_gpu(nvml)
    return nvml


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
    width = _columns()
    if width is None and "COLUMNS" in os.environ:  # rich would take COLUMNS=0 as no width
        try:
            width = os.get_terminal_size((sys.stderr if stderr else sys.stdout).fileno()).columns
        except (OSError, ValueError, AttributeError):
            width = 80
    console = Console(stderr=stderr, width=width)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, width=_columns() or PIPE_WIDTH)


def _columns() -> int | None:
    """``$COLUMNS`` when it is a usable width (a whole number of at least 20), else None: a
    stray value (``abc``, ``0``) must not break, or blank, every command's output."""
    text = os.environ.get("COLUMNS", "")
    return int(text) if text.isascii() and text.isdigit() and 20 <= int(text) <= 100_000 \
        else None


def add_output(p: argparse.ArgumentParser, *, json_alias: bool = False) -> None:
    """``-o/--output table|json`` on a listing or status command (``json_alias``: the old
    ``--json`` flag of the same meaning, kept as a deprecated spelling)."""
    new = p.add_argument("-o", "--output", choices=("table", "json"), default="table",
                         help="table (default) or json: one JSON document on stdout")
    if json_alias:
        deprecated_alias(p, "--json", new, value="json")


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


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


class RepeatFilter(logging.Filter):
    """Identical warnings (the same text: a claim's name is in it, so it is per claim) pass
    once per ``window_s``; the next one after the window says how many were dropped ("...
    (and N more like it since it was last logged)", field ``repeated``). A component retrying
    a refused write every pass thus logs it once a minute, not hundreds of times. Records
    below WARNING always pass. ``clock`` is monotonic seconds (a fake one in tests)."""

    def __init__(self, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s, self.clock = window_s, clock
        self._seen: dict[str, tuple[float, int]] = {}  # text -> (last passed, dropped since)
        self._pruned = clock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        now = self.clock()
        if now - self._pruned >= self.window_s:  # forget texts not seen for two windows
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < 2 * self.window_s}
            self._pruned = now
        text = record.getMessage()
        key = _ADDRESS.sub("0x", text)  # "<... object at 0x7f...>" differs call to call
        passed, dropped = self._seen.get(key, (-math.inf, 0))
        if now - passed < self.window_s:
            self._seen[key] = (passed, dropped + 1)
            return False
        self._seen[key] = (now, 0)
        if dropped:
            record.msg = f"{text} (and {dropped} more like it since it was last logged)"
            record.args = None
            record.repeated = dropped
        return True


def setup_logging(fmt: str, component: str, level: int = logging.INFO,
                  repeats_every_s: float | None = None) -> logging.Logger:
    """Send the ``gpuslice`` loggers to stderr in ``fmt`` (text or json); returns the
    component's logger (``gpuslice.<component>``). ``repeats_every_s``: let an identical
    warning through once per that many seconds (:class:`RepeatFilter`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component) if fmt == "json" else TextFormatter(component))
    if repeats_every_s is not None:
        handler.addFilter(RepeatFilter(repeats_every_s))
    root = logging.getLogger("gpuslice")
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    return logging.getLogger(f"gpuslice.{component}")
