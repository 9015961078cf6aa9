from __future__ import annotations

import numpy as np
import pytest

from gpuslice.core.errors import ValidationError
from gpuslice.core.frag import (
    FragTables,
    Shape,
    TargetWorkload,
    model_pressure,
    node_frag,
    typical_shapes,
)
from gpuslice.core.model import ClusterSnapshot
from tests.builders import MakeNode

TW = TargetWorkload.of(
    [Shape(2000, 1, 500), Shape(4000, 0, 0), Shape(20000, 1, 1000)], [0.5, 0.25, 0.25]
)


@pytest.mark.parametrize(
    ("node", "expected"),
    [
        # A fits: only the 300-milli GPU is a fragment; CPU-only and too-big shapes see all 1300.
        (MakeNode("n").gpus("T4", 2).used(0, 700).cpu(32000, 10000), 0.5 * 300 + 0.5 * 1300),
        # plenty of CPU: C fits on GPU 0 too, so it sees only the 300 leftover as fragment
        (MakeNode("n").gpus("T4", 2).used(0, 700).cpu(32000), 0.5 * 300 + 0.25 * 1300 + 0.25 * 300),
        # no CPU at all: every shape sees all idle GPU as fragment
        (MakeNode("n").gpus("T4", 2).used(0, 700).cpu(32000, 0), 1300.0),
        # fully used node: nothing idle, nothing fragmented
        (MakeNode("n").gpus("T4", 2).used(1000, 1000), 0.0),
    ],
)
def test_node_fragmentation_follows_the_fgd_definition(node: MakeNode, expected: float) -> None:
    arrays = ClusterSnapshot.of([node.obj()]).arrays
    got = node_frag(arrays, TW, FragTables.build(arrays, TW))
    assert got[0] == pytest.approx(expected)


def test_model_constrained_shape_sees_other_models_as_fragment() -> None:
    tw = TargetWorkload.of([Shape(1000, 1, 500, frozenset({"V100M16"}))], [1.0])
    arrays = ClusterSnapshot.of([MakeNode("t4").gpus("T4", 1).obj(),
                                 MakeNode("v").gpus("V100M16", 1).obj()]).arrays
    assert node_frag(arrays, tw, FragTables.build(arrays, tw)).tolist() == [1000.0, 0.0]


def test_memory_aware_shapes_count_memory_starved_nodes() -> None:
    tw = TargetWorkload.of([Shape(1000, 1, 500)], [1.0]).with_memory([4096])
    arrays = ClusterSnapshot.of([MakeNode("a").gpus("T4", 1).mem(8192, 1024).obj()]).arrays
    assert node_frag(arrays, tw, FragTables.build(arrays, tw))[0] == 1000.0


def test_typical_shapes_cover_the_threshold_and_renormalise() -> None:
    shapes = [Shape(1000, 1, 500)] * 60 + [Shape(2000, 1, 1000)] * 30 + [Shape(0, 0, 0)] * 6 + \
        [Shape(1, 8, 1000)] * 4
    tw = typical_shapes(shapes, coverage_pct=95.0, step=1)
    assert [s.milli for s in tw.shapes] == [500, 1000, 0]
    assert tw.popularity.sum() == pytest.approx(1.0)
    assert tw.popularity[0] == pytest.approx(60 / 96)


def test_typical_shapes_ties_prefer_larger_cpu() -> None:
    tw = typical_shapes([Shape(1000, 1, 500), Shape(3000, 1, 500)], coverage_pct=50, step=1)
    assert tw.shapes == (Shape(3000, 1, 500),)


def test_target_workload_validation() -> None:
    with pytest.raises(ValidationError, match="popularity"):
        TargetWorkload.of([Shape(1, 1, 1)], [0.5])
    with pytest.raises(ValidationError, match="task list"):
        typical_shapes([])


def test_model_pressure_is_zero_without_constraints_and_high_on_scarce_models() -> None:
    arrays = ClusterSnapshot.of([MakeNode("t4").gpus("T4", 8).obj(),
                                 MakeNode("p").gpus("P100", 2).obj()]).arrays
    free = TargetWorkload.of([Shape(1000, 1, 500)], [1.0])
    assert np.all(model_pressure(arrays, free) == 0)
    tw = TargetWorkload.of([Shape(1000, 1, 500), Shape(1000, 1, 500, frozenset({"P100"}))],
                           [0.5, 0.5])
    p = model_pressure(arrays, tw)
    t4, p100 = arrays.models.index("T4"), arrays.models.index("P100")
    assert p[p100] > 1.0 > p[t4] == 0
    assert p[-1] == 0


def test_cpu_per_milli_counts_cpu_only_tasks_only_when_cpu_runs_out() -> None:
    from gpuslice.core.frag import cpu_per_milli

    arrays = ClusterSnapshot.of([MakeNode("n").gpus("T4", 4).cpu(64000).obj()]).arrays
    light = TargetWorkload.of([Shape(8000, 1, 1000), Shape(4000, 0, 0)], [0.5, 0.5])
    assert cpu_per_milli(arrays, light) == pytest.approx(8.0)  # GPU tasks only
    heavy = TargetWorkload.of([Shape(8000, 1, 1000), Shape(24000, 0, 0)], [0.5, 0.5])
    # (8000 + 24000) / 1000 = 32 CPU per milli x 4000 milli >= 64000: CPU runs out first
    assert cpu_per_milli(arrays, heavy) == pytest.approx(32.0)
    assert cpu_per_milli(arrays, TargetWorkload.of([Shape(4000, 0, 0)], [1.0])) == 0.0


def test_cpu_bound_fragmentation_counts_the_gpus_the_cpu_cannot_feed() -> None:
    from gpuslice.core.frag import shape_frag

    tw = TargetWorkload.of([Shape(4000, 1, 1000)], [1.0])
    # 4 GPUs free and CPU for two of the shape's tasks: FGD sees no fragment, the CPU-bound
    # measure the two GPUs no task can use; with CPU for all four, both see none
    for cpu_free, fgd, bound in ((9000, 0.0, 2000.0), (16000, 0.0, 0.0), (3000, 4000.0, 4000.0)):
        arrays = ClusterSnapshot.of([MakeNode("n").gpus("T4", 4).cpu(32000, cpu_free).obj()]).arrays
        tables = FragTables.build(arrays, tw)
        assert node_frag(arrays, tw, tables)[0] == fgd
        assert node_frag(arrays, tw, tables, cpu_bound=True)[0] == bound
        got = shape_frag(arrays.gpu_free.sum(axis=1), arrays.cpu_free, arrays.mem_free,
                         tables.access, tables.count, tables.big, tw, cpu_bound=True)
        assert got[0, 0] == bound
    # a shape asking for no CPU is never capped by it
    free_cpu = TargetWorkload.of([Shape(0, 1, 1000)], [1.0])
    arrays = ClusterSnapshot.of([MakeNode("n").gpus("T4", 4).cpu(32000, 0).obj()]).arrays
    assert node_frag(arrays, free_cpu, FragTables.build(arrays, free_cpu), cpu_bound=True)[0] == 0


def test_cpu_demand_ratio_and_its_error_when_measured() -> None:
    from gpuslice.core.frag import cpu_demand_error, cpu_demand_ratio

    # 4 GPUs and 32 cores: 8 cores a GPU. Tasks of one GPU and 8 cores fill both at once;
    # a CPU-only task of 8 cores for every GPU task makes the CPU run out at half the GPUs
    arrays = ClusterSnapshot.of([MakeNode("n").gpus("T4", 4).cpu(32000).obj()]).arrays
    even = TargetWorkload.of([Shape(8000, 1, 1000)], [1.0])
    heavy = TargetWorkload.of([Shape(8000, 1, 1000), Shape(8000, 0, 0)], [0.5, 0.5])
    assert cpu_demand_ratio(arrays, even) == pytest.approx(1.0)
    assert cpu_demand_ratio(arrays, heavy) == pytest.approx(2.0)
    # known in advance: no error; measured: one that shrinks with the square root of the count
    assert cpu_demand_error(arrays, heavy) == 0.0
    assert cpu_demand_error(arrays, even) == 0.0
    few = TargetWorkload.of(heavy.shapes, heavy.popularity.tolist(), observed=25)
    many = TargetWorkload.of(heavy.shapes, heavy.popularity.tolist(), observed=100)
    assert cpu_demand_error(arrays, few) == pytest.approx(2 * cpu_demand_error(arrays, many))
    # every task alike: nothing to be unsure of, however few were seen
    assert cpu_demand_error(arrays, TargetWorkload.of(even.shapes, [1.0], observed=3)) == 0.0
    with pytest.raises(ValidationError):
        TargetWorkload.of(even.shapes, [1.0], observed=-1)
