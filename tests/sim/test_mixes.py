"""Task mixes made the way the FGD paper's trace variants are (sim.mixes), on the embedded
task list: each reaches the share that names it, keeps what the variant keeps, and is the same
for a seed."""

from __future__ import annotations

import numpy as np
import pytest

from gpuslice.core.errors import ValidationError
from gpuslice.sim.default import default_tasks
from gpuslice.sim.mixes import (
    MIXES,
    cpu_only_share,
    is_sharing,
    make_mix,
    multi_share,
    sharing_share,
    with_cpu_only,
    with_multi_gpu,
    with_sharing,
)

BASE = default_tasks()


def _shapes(t):  # type: ignore[no-untyped-def]
    return set(zip(t.cpu_milli.tolist(), t.num_gpu.tolist(), t.gpu_milli.tolist(), strict=True))


@pytest.mark.parametrize("share", [0.05, 0.6, 0.95])
def test_sharing_share_is_reached_by_swapping_gpu_tasks(share: float) -> None:
    got = with_sharing(BASE, share, np.random.default_rng(1))
    assert len(got) == len(BASE)  # one task swapped for another: the count stays
    assert abs(sharing_share(got) - share) < 0.02
    # CPU-only tasks are untouched, every task is one of the list's own shapes
    assert (got.num_gpu == 0).sum() == (BASE.num_gpu == 0).sum()
    assert _shapes(got) <= _shapes(BASE)
    if share > sharing_share(BASE):
        assert is_sharing(got).sum() > is_sharing(BASE).sum()


def test_cpu_only_share_appends_or_drops_cpu_only_tasks() -> None:
    gpu_tasks = int((BASE.num_gpu > 0).sum())
    for share in (0.05, 0.3):
        got = with_cpu_only(BASE, share, np.random.default_rng(2))
        assert cpu_only_share(got) == pytest.approx(share, abs=1 / len(got))
        assert int((got.num_gpu > 0).sum()) == gpu_tasks
        assert _shapes(got) <= _shapes(BASE)


def test_multi_gpu_share_appends_the_lists_multi_gpu_tasks() -> None:
    got = with_multi_gpu(BASE, 0.5, np.random.default_rng(3))
    assert multi_share(BASE) < 0.2 and 0.5 <= multi_share(got) < 0.55
    assert np.array_equal(got.num_gpu[: len(BASE)], BASE.num_gpu)  # the list, then additions
    assert (got.num_gpu[len(BASE):] > 1).all()


def test_named_mixes_are_the_same_for_a_seed_and_refuse_unknown_names() -> None:
    for name in MIXES:
        a, b = make_mix(name, BASE), make_mix(name, BASE)
        assert np.array_equal(a.cpu_milli, b.cpu_milli) and np.array_equal(a.num_gpu, b.num_gpu)
    assert make_mix("default", BASE) is BASE
    assert sharing_share(make_mix("sharing-heavy", BASE)) >= 0.8
    assert sharing_share(make_mix("whole-gpu-heavy", BASE)) <= 0.1
    assert cpu_only_share(make_mix("cpu-heavy", BASE)) == pytest.approx(0.25, abs=0.001)
    with pytest.raises(ValidationError):
        make_mix("gpu-heavy", BASE)
    for bad in (lambda: with_sharing(BASE, 1.5, np.random.default_rng()),
                lambda: with_cpu_only(BASE, 1.0, np.random.default_rng()),
                lambda: with_multi_gpu(BASE, -0.1, np.random.default_rng())):
        with pytest.raises(ValidationError):
            bad()
