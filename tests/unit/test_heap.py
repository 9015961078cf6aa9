"""services/heap.py: a long-running controller's heap kept out of full collections."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from gpuslice.services.heap import LongLivedHeap


class _Node:
    """A weakly referenceable member of a cycle (a dict is not one)."""

    def __init__(self, cycle: dict[str, object]) -> None:
        self.cycle = cycle
        cycle["node"] = self


@pytest.fixture(autouse=True)
def _thawed() -> Iterator[None]:
    yield
    gc.unfreeze()  # the test process's heap as it was


def test_what_survives_a_pass_is_frozen_and_a_full_collection_comes_on_schedule() -> None:
    now = [0.0]
    heap = LongLivedHeap(full_every_s=60.0, clock=lambda: now[0])
    kept = [{"claim": i} for i in range(1000)]  # the watched lists: long-lived
    heap.settled()
    frozen = gc.get_freeze_count()
    assert frozen >= len(kept) and heap.full_collections == 0
    full: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(info["collected"])

    gc.callbacks.append(seen)
    try:
        young: dict[str, object] = {}
        young["self"] = young  # a cycle made and dropped between two passes...
        freed = weakref.WeakValueDictionary({"young": _Node(young)})
        del young
        now[0] = 10.0
        heap.settled()  # ... is collected with the young generations, not frozen
        assert "young" not in freed and not full
        old: dict[str, object] = {}
        old["self"] = old
        holder = _Node(old)
        freed["old"] = holder
        gc.collect(1)  # the cycle outlives a young collection (in the oldest generation) ...
        del old, holder  # ... and is dropped after it
        now[0] = 30.0
        heap.settled()  # it is frozen with the rest until the full collection
        assert "old" in freed and not full and heap.full_collections == 0
        now[0] = 61.0
        heap.settled()  # an hour's (here a minute's) full collection: everything scanned
        assert heap.full_collections == 1 and full and full[-1] >= 1
        assert "old" not in freed
        assert gc.get_freeze_count() >= len(kept)  # and frozen again after it
    finally:
        gc.callbacks.remove(seen)


def test_a_schedule_must_be_positive() -> None:
    with pytest.raises(ValueError, match="full_every_s"):
        LongLivedHeap(full_every_s=0)
