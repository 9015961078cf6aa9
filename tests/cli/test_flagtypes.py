"""``cli/flagtypes.py``: the parsers of option values, split out of ``cli/common.py`` so that no
module of the command line grows past the project's ~600 lines; what they accept and refuse is
unchanged."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

import gpuslice.cli
from gpuslice.cli import flagtypes
from gpuslice.core.errors import ValidationError

CLI = Path(gpuslice.cli.__file__).parent


def test_no_command_line_module_is_over_600_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in CLI.glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 600} == {}


@pytest.mark.parametrize(("parse", "good", "bad", "says"), [
    (flagtypes.positive_float, ("0.5", 0.5), "0", "a positive number"),
    (flagtypes.non_negative_float, ("0", 0.0), "-1", "a number >= 0"),
    (flagtypes.fraction, ("1", 1.0), "1.5", "a fraction, more than 0 and at most 1"),
    (flagtypes.non_negative_int, ("7", 7), "-1", "a whole number >= 0"),
    (flagtypes.positive_float, ("3", 3.0), "nan", "a positive number"),
])
def test_the_argparse_types(parse: Callable[[str], float], good: tuple[str, float], bad: str,
                            says: str) -> None:
    assert parse(good[0]) == good[1]
    with pytest.raises(argparse.ArgumentTypeError, match=f"expected {says}, got '{bad}'"):
        parse(bad)


def test_the_value_parsers() -> None:
    assert flagtypes.parse_seeds("42-44,50") == [42, 43, 44, 50]
    assert flagtypes.parse_lease("kube-system/gpuslice") == ("kube-system", "gpuslice")
    assert flagtypes.parse_hostport("--listen", "[::1]:8080") == ("::1", 8080)
    assert gpuslice.cli.parse_seeds is flagtypes.parse_seeds
    with pytest.raises(ValidationError, match="--lease: expected NAMESPACE/NAME"):
        flagtypes.parse_lease("no-slash")
