"""Errors the core raises. Each names the field, what was expected and what was given."""

from __future__ import annotations


def note_once(problems: list[str] | None, text: str, window: int = 10) -> bool:
    """Add ``text`` to ``problems`` (when one is kept) unless it is among the last ``window``:
    a fault that recurs every pass, an outage above all, must not grow the list. Returns
    whether it was added (so that a caller logs it once)."""
    if problems is not None and text not in problems[-window:]:
        problems.append(text)
        return True
    return False


class GpusliceError(Exception):
    """Base of every error gpuslice raises on purpose (the CLI prints these in one line)."""


class ValidationError(GpusliceError, ValueError):
    """A value that breaks a contract: ``field`` names it, ``expected`` says what would do.
    ``got`` None is a value not given at all, said in words ("--nodes is missing: expected
    ..."), not as Python's ``None``."""

    def __init__(self, field: str, expected: str, got: object) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        super().__init__(f"{field} is missing: expected {expected}" if got is None else
                         f"{field}: expected {expected}, got {got!r}")


class Unavailable(GpusliceError):
    """Something the command needs is not there: no GPU, no NVML, a package or program that
    is not installed. The input was fine; the CLI exits 1 (a failure), not 2 (bad input)."""


class MissingDependency(Unavailable, ImportError):
    """An optional dependency is not installed: names the package, what needs it and the extra
    that brings it."""

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        self.package = package
        self.extra = extra
        super().__init__(f"{purpose} needs {package}, which is not installed: "
                         f"pip install 'gpuslice[{extra}]'")
