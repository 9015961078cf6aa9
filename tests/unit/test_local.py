"""Local mode's placement and GPU selection (pure core)."""

from __future__ import annotations

import pytest

from gpuslice.core.errors import ValidationError
from gpuslice.core.local import LocalGpu, LocalSlice, NoRoom, SliceWant, place_local, select_gpu

GPUS = [LocalGpu("GPU-a", 0, "A100-80GB", 81920), LocalGpu("GPU-b", 1, "A100-80GB", 81920)]


def test_sized_slices_are_packed_best_fit_and_the_rest_share_fairly() -> None:
    wants = [SliceWant("r0", "a", 60, 20000), SliceWant("r1", "b", 30, 10000),
             SliceWant("r2", "c"), SliceWant("r3", "c")]
    got = {s.replica: s for s in place_local(GPUS, wants)}
    assert got["r0"].gpu_uuid == got["r1"].gpu_uuid == "GPU-a"  # best fit packs them
    # the fair replicas go where compute is left: both on GPU-b, half each, memory split
    assert {got["r2"].gpu_uuid, got["r3"].gpu_uuid} == {"GPU-b"}
    assert got["r2"].compute_pct == got["r3"].compute_pct == 50
    assert got["r2"].memory_mib == 81920 // 2
    assert sum(s.compute_pct for s in got.values() if s.gpu_uuid == "GPU-a") <= 100


def test_a_replica_that_fits_nowhere_is_named_with_each_gpus_room() -> None:
    with pytest.raises(NoRoom, match=r"replica r2 \(70% compute.*GPU 0 has 30%"):
        place_local(GPUS, [SliceWant("r0", "a", 70), SliceWant("r1", "a", 70),
                           SliceWant("r2", "a", 70)])
    with pytest.raises(NoRoom, match="memory caps"):
        place_local(GPUS[:1], [SliceWant("r0", "a", None, 60000),
                               SliceWant("r1", "a", None, 30000)])


def test_bad_shares_and_pins_are_refused_with_the_field() -> None:
    with pytest.raises(ValidationError, match=r"services\[a\].compute"):
        place_local(GPUS, [SliceWant("r0", "a", 0)])
    with pytest.raises(ValidationError, match=r"services\[a\].gpu"):
        place_local(GPUS, [SliceWant("r0", "a", 10, gpu="7")])
    got = place_local(GPUS, [SliceWant("r0", "a", 10, gpu="1")])
    assert got[0].gpu_uuid == "GPU-b"


def test_select_counts_measured_use_and_slices_already_handed_out() -> None:
    busy = [LocalGpu("GPU-a", 0, "A100-80GB", 81920, used_mib=70000, utilization_pct=10),
            LocalGpu("GPU-b", 1, "A100-80GB", 81920, used_mib=1000, utilization_pct=20)]
    assert select_gpu(busy, [], 8192, 30).uuid == "GPU-b"
    held = [LocalSlice("x", "s", "GPU-b", 1, 75, 4096)]
    with pytest.raises(NoRoom, match=r"GPU 0 .* 11920 MiB and 90% free; GPU 1 .* 25% free"):
        select_gpu(busy, held, 20000, 30)
    assert select_gpu(busy, held, 8192, 30).uuid == "GPU-a"  # GPU-b has 25% left
    assert select_gpu(busy, held, 8192, 20).uuid == "GPU-b"  # more headroom than GPU-a
    with pytest.raises(ValidationError, match="--compute"):
        select_gpu(busy, [], 1, 101)


@pytest.mark.parametrize(("text", "mib"), [(8192, 8192), ("8192M", 8192), ("8G", 8192),
                                           ("8Gi", 8192), ("1.5GiB", 1536), ("1T", 1048576)])
def test_memory_amounts(text: object, mib: int) -> None:
    from gpuslice.core.local import parse_memory

    assert parse_memory("memory", text) == mib


@pytest.mark.parametrize("bad", ["8X", "-1G", "lots", True, "0"])
def test_bad_memory_amounts_name_the_field(bad: object) -> None:
    from gpuslice.core.local import parse_memory

    with pytest.raises(ValidationError, match=r"services\.a\.memory"):
        parse_memory("services.a.memory", bad)
