"""Probe 3: the node inventory annotation (``gpuslice.io/inventory``, read by the extender for
every node) refuses a number that is not a whole number >= 0, naming the field, instead of
an OverflowError (``1e400`` is infinity in JSON) or a negative index or memory."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpuslice.adapters.kube.objects import INVENTORY_ANNOTATION, node_inventory
from gpuslice.core.errors import ValidationError


def node(gpu: str) -> dict[str, Any]:
    return {"metadata": {"name": "n", "annotations": {INVENTORY_ANNOTATION: f"[{gpu}]"}}}


GPU = '{"uuid": "u", "index": 0, "model": "A100-80GB", "memoryMiB": 81920'


@pytest.mark.parametrize(("gpu", "field"), [
    ('{"uuid": "u", "index": 0, "model": "A100-80GB", "memoryMiB": 1e400}', "memoryMiB"),
    ('{"uuid": "u", "index": 0, "model": "A100-80GB", "memoryMiB": -1e400}', "memoryMiB"),
    ('{"uuid": "u", "index": 0, "model": "A100-80GB", "memoryMiB": NaN}', "memoryMiB"),
    ('{"uuid": "u", "index": 0, "model": "A100-80GB", "memoryMiB": -5}', "memoryMiB"),
    ('{"uuid": "u", "index": -1, "model": "A100-80GB", "memoryMiB": 81920}', "index"),
    ('{"uuid": "u", "index": 1e400, "model": "A100-80GB", "memoryMiB": 81920}', "index"),
    ('{"uuid": "u", "index": 0.5, "model": "A100-80GB", "memoryMiB": 81920}', "index"),
    (GPU + ', "mig": [{"uuid": "m", "profile": "3g.40gb", "start": -4}]}', "mig[0].start"),
    (GPU + ', "mig": [{"uuid": "m", "profile": "3g.40gb", "start": 0, "memoryMiB": 1e400}]}',
     "mig[0].memoryMiB"),
])
def test_a_number_out_of_range_is_refused_naming_the_field(gpu: str, field: str) -> None:
    with pytest.raises(ValidationError) as exc:
        node_inventory(node(gpu))
    assert exc.value.field == f"node n: inventory[0].{field}"
    assert exc.value.expected == "a whole number >= 0"


def test_a_good_inventory_still_reads() -> None:
    gpu = json.loads(GPU + ', "mig": [{"uuid": "m", "profile": "3g.40gb", "start": 4}]}')
    (got,) = node_inventory(node(json.dumps(gpu)))
    assert (got.index, got.memory_mib, got.mig[0].start, got.mig[0].memory_mib) == \
        (0, 81920, 4, 0)
    with pytest.raises(ValidationError, match="uuid, index, model and memoryMiB"):
        node_inventory(node('{"uuid": "u", "model": "A100-80GB"}'))
