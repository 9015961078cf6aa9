"""The learned target workload (core.learned): the one estimator of the extender, the DRA claim
allocator and the simulator's deployed model."""

from __future__ import annotations

import numpy as np
import pytest

from gpuslice.core.errors import ValidationError
from gpuslice.core.frag import Shape, typical_shapes
from gpuslice.core.learned import WorkloadEstimator, learned_workload


def test_the_prior_is_one_whole_gpu_pod_with_the_median_cpu_of_the_gpu_pods() -> None:
    seen = [Shape(2000, 1, 250)] * 3 + [Shape(8000, 1, 500)] * 2 + [Shape(1000, 0, 0)]
    wl = learned_workload(seen)
    want = typical_shapes([*seen, Shape(2000, 1, 1000)], coverage_pct=95.0, step=1)
    assert wl.shapes == want.shapes
    assert np.allclose(wl.popularity, want.popularity)
    # with no pod at all the workload is the prior alone (a GPU left whole is worth keeping)
    empty = learned_workload([])
    assert empty.shapes == (Shape(0, 1, 1000),) and empty.popularity.tolist() == [1.0]
    # counts and lists are the same input
    counts = {Shape(2000, 1, 250): 3, Shape(8000, 1, 500): 2, Shape(1000, 0, 0): 1}
    assert learned_workload(counts).shapes == wl.shapes
    # it says how many pods it was measured from (the prior's included), so a policy can
    # tell a measured share from noise (core.frag.cpu_demand_error)
    assert wl.observed == 7 and empty.observed == 1 and want.observed == 0


def test_the_estimator_adopts_a_new_workload_only_when_it_moved() -> None:
    est = WorkloadEstimator(drift=0.1, every=0.0)
    for _ in range(50):
        est.add(Shape(2000, 1, 250))
    first = est.current()
    v = est.version
    est.add(Shape(2000, 1, 250))  # the same mix: nothing moves
    assert est.current() is first and est.version == v
    for _ in range(50):  # a new shape among the typical ones
        est.add(Shape(4000, 1, 500))
    moved = est.current()
    assert moved is not first and est.version == v + 1
    assert Shape(4000, 1, 500) in moved.shapes
    for _ in range(50):  # pods gone are forgotten
        est.remove(Shape(4000, 1, 500))
    assert est.pods == 51
    assert Shape(4000, 1, 500) not in est.current().shapes
    est.remove(Shape(9, 9, 9))  # one never counted: no effect, no error
    assert est.pods == 51


def test_the_estimator_re_estimates_after_a_share_of_the_pods_changed() -> None:
    est = WorkloadEstimator(drift=0.0, every=0.5)
    for _ in range(10):
        est.add(Shape(1000, 1, 100))
    first = est.current()
    est.add(Shape(3000, 1, 700))  # 1 change of 11 pods: under half, not looked at yet
    assert est.current() is first
    for _ in range(5):  # 6 changes of 16 pods: still under half
        est.add(Shape(3000, 1, 700))
    assert est.current() is first
    for _ in range(5):  # 11 of 21: looked at, and the mix moved
        est.add(Shape(3000, 1, 700))
    assert est.current() is not first


@pytest.mark.parametrize("kw", [{"drift": -0.1}, {"drift": 3.0}, {"every": 1.0},
                                {"every": -1.0}])
def test_bad_estimator_settings_name_the_field(kw: dict[str, float]) -> None:
    with pytest.raises(ValidationError, match="workload"):
        WorkloadEstimator(**kw)
