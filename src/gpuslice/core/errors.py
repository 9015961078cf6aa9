"""Errors the core raises. Each names the field, what was expected and what was given."""

from __future__ import annotations


class GpusliceError(Exception):
    """Base of every error gpuslice raises on purpose (the CLI prints these in one line)."""


class ValidationError(GpusliceError, ValueError):
    """A value that breaks a contract: ``field`` names it, ``expected`` says what would do."""

    def __init__(self, field: str, expected: str, got: object) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        super().__init__(f"{field}: expected {expected}, got {got!r}")
