"""Probe 3: an opaque GPU model's memory must be a positive whole number of MiB; text, NaN,
infinity, a fraction or a bool from a user's file is a ValidationError, not a TypeError or a
model of ``nan`` MiB."""

from __future__ import annotations

import math

import pytest

from gpuslice.core import catalog
from gpuslice.core.errors import ValidationError


@pytest.mark.parametrize("memory", ["abc", math.nan, math.inf, 1.5, True, [1], 0, -5])
def test_an_opaque_model_refuses_a_memory_that_is_not_a_positive_whole_number(
        memory: object) -> None:
    with pytest.raises(ValidationError, match="gpu memory_mib"):
        catalog.opaque_model("G2", memory)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="gpu memory_mib"):
        catalog.resolve("G2", memory)  # type: ignore[arg-type]


def test_an_opaque_model_with_its_memory_still_resolves() -> None:
    assert catalog.resolve("G2", 32768).memory_mib == 32768
