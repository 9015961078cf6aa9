"""The admission webhook's policy (core.admission) and GPU selection rule (core.gpuselect),
table-driven over small pods: what it sets, what it translates, what it refuses (naming the
field) and what it only warns about."""

from __future__ import annotations

from typing import Any

import pytest

from gpuslice.core.admission import (
    ContainerAsk,
    Fleet,
    Options,
    PodAsk,
    admit,
    fleet_of,
)
from gpuslice.core.gpuselect import GpuSelection, contradictions, model_key, selection
from gpuslice.core.podrequest import ContainerKind

L4, A100 = ("L4", 24576), ("A100-80GB", 81920)


def fleet(*models: tuple[str, int], per: int = 2) -> Fleet:
    return fleet_of([(m, mem, [f"GPU-{m}-{i}"]) for m, mem in models for i in range(per)])


def ask(*containers: ContainerAsk, scheduler: str = "default-scheduler",
        ann: dict[str, str] | None = None, milli_ann: int | None = None,
        memory_ann: int | None = None) -> PodAsk:
    a = ann or {}
    return PodAsk("pod ml/p", scheduler, containers, a, selection(a), milli_ann, memory_ann)


def c(i: int = 0, kind: ContainerKind = ContainerKind.APP, **res: Any) -> ContainerAsk:
    field = "containers" if kind is ContainerKind.APP else "initContainers"
    return ContainerAsk(f"spec.{field}[{i}]", f"c{i}", kind, **res)


def resources(d: Any) -> list[dict[str, int]]:
    return [dict(ch.resources) for ch in d.containers]


# ---- what it sets ------------------------------------------------------------------------------


def test_a_pod_without_a_gpu_is_let_through_untouched() -> None:
    d = admit(ask(c()), fleet(L4))
    assert d.allowed and not d.changed and not d.warnings


def test_a_share_gets_the_scheduler_and_its_memory_from_the_smallest_gpu_it_may_use() -> None:
    d = admit(ask(c(milli=250)), fleet(L4, A100))
    assert d.allowed and d.scheduler_name == "gpuslice-scheduler"
    assert resources(d) == [{"gpuslice.io/gpu": 1, "gpuslice.io/gpu-milli": 250,
                             "gpuslice.io/gpu-memory": 6144}]
    # a model selection narrows the basis
    d = admit(ask(c(milli=250), ann={"gpuslice.io/gpu-model": "A100-80GB"}), fleet(L4, A100))
    assert resources(d)[0]["gpuslice.io/gpu-memory"] == 20480


@pytest.mark.parametrize(("res", "ann", "milli_ann", "memory_ann", "want"), [
    ({"nvidia_gpus": 1}, {}, None, None, (1, 1000, 24576)),  # a whole GPU
    ({"nvidia_gpus": 1}, {}, 500, None, (1, 500, 12288)),  # the fraction annotation
    ({"nvidia_gpus": 1}, {}, 500, 4096, (1, 500, 4096)),
    ({"nvidia_gpus": 1, "hami_cores": 30, "hami_memory_mib": 3000}, {}, None, None,
     (1, 300, 3000)),  # HAMi's resources
    ({"nvidia_gpus": 2}, {}, None, None, (2, 1000, 24576)),
])
def test_plain_gpu_requests_are_translated(res: dict[str, int], ann: dict[str, str],
                                           milli_ann: int | None, memory_ann: int | None,
                                           want: tuple[int, int, int]) -> None:
    d = admit(ask(c(**res), ann=ann, milli_ann=milli_ann, memory_ann=memory_ann), fleet(L4))
    assert d.allowed, d.refusal
    (ch,) = d.containers
    assert (ch.resources["gpuslice.io/gpu"], ch.resources["gpuslice.io/gpu-milli"],
            ch.resources["gpuslice.io/gpu-memory"]) == want
    assert "nvidia.com/gpu" in ch.remove
    # --no-translate: left alone
    assert not admit(ask(c(**res)), fleet(L4), Options(translate_plain=False)).changed


def test_a_pod_already_explicit_on_the_gpuslice_scheduler_is_unchanged() -> None:
    d = admit(ask(c(gpus=1, milli=250, memory_mib=4096), scheduler="gpuslice-scheduler"),
              fleet(L4))
    assert d.allowed and not d.changed


def test_each_share_container_gets_its_own_memory() -> None:
    d = admit(ask(c(0, milli=200), c(1, milli=300)), fleet(L4))
    assert [r["gpuslice.io/gpu-memory"] for r in resources(d)] == [4915, 7372]


def test_a_mig_isolated_share_gets_the_memory_of_the_instance_it_takes() -> None:
    d = admit(ask(c(milli=429), ann={"gpuslice.io/isolation": "mig"}), fleet(A100))
    # 429 milli is 3 compute slices: the 3g.40gb instance of an A100-80GB
    from gpuslice.core import catalog

    model = catalog.lookup("A100-80GB")
    assert model is not None and model.mig is not None
    assert resources(d)[0]["gpuslice.io/gpu-memory"] == model.mig.profile("3g.40gb").memory_mib


def test_without_an_inventory_the_memory_stays_implicit_with_a_warning() -> None:
    d = admit(ask(c(milli=250)), Fleet())
    assert d.allowed and "gpuslice.io/gpu-memory" not in resources(d)[0]
    assert any("not made explicit" in w for w in d.warnings)
    # a model the pod names gives the basis from the catalogue
    d = admit(ask(c(milli=250), ann={"gpuslice.io/gpu-model": "L4"}), Fleet())
    assert resources(d)[0]["gpuslice.io/gpu-memory"] == 6144


# ---- what it refuses ----------------------------------------------------------------------------


@pytest.mark.parametrize(("pod", "field"), [
    (ask(c(milli=1500)), "spec.containers[0].resources gpuslice.io/gpu-milli"),
    (ask(c(gpus=2, milli=500)), "gpuslice.io/gpu-milli"),
    (ask(c(gpus=0)), "gpuslice.io/gpu"),
    (ask(c(memory_mib=100_000)), "spec.containers[0].resources gpuslice.io/gpu-memory"),
    (ask(c(milli=250, nvidia_gpus=1)), "nvidia.com/gpu"),
    (ask(c(nvidia_gpus=1, hami_cores=150)), "nvidia.com/gpucores"),
    (ask(c(nvidia_gpus=1, hami_memory_percent=50)), "nvidia.com/gpumem-percentage"),
    (ask(c(hami_cores=50)), "nvidia.com/gpu"),
    (ask(c(milli=250), scheduler="volcano"), "spec.schedulerName"),
    (ask(c(milli=250), ann={"gpuslice.io/mig-profile": "5g.50gb"}), "gpuslice.io/mig-profile"),
    (ask(c(milli=250), ann={"gpuslice.io/gpu-model": "L4",
                            "gpuslice.io/gpu-model-exclude": "l4"}), "gpuslice.io/gpu-model"),
    (ask(c(milli=250), ann={"gpuslice.io/gpu-uuid": "GPU-1",
                            "nvidia.com/nouse-gpuuuid": "GPU-1"}), "gpuslice.io/gpu-uuid"),
    # two sidecars at 600 milli each share one GPU: 1200 at once
    (ask(c(0, ContainerKind.SIDECAR, milli=600), c(1, milli=600)), "gpuslice.io/gpu-milli"),
])
def test_what_no_gpu_could_take_is_refused_naming_the_field(pod: PodAsk, field: str) -> None:
    d = admit(pod, fleet(L4, A100))
    assert not d.allowed and field in d.refusal and d.refusal.startswith("pod ml/p"), d.refusal


def test_memory_over_the_largest_gpu_the_pod_may_use_is_refused() -> None:
    pod = ask(c(memory_mib=30000), ann={"gpuslice.io/gpu-model": "L4"})
    assert not admit(pod, fleet(L4, A100)).allowed
    assert admit(ask(c(memory_mib=30000)), fleet(L4, A100)).allowed


def test_a_model_no_node_has_is_only_a_warning() -> None:
    d = admit(ask(c(milli=250), ann={"gpuslice.io/gpu-model": "H100-SXM"}), fleet(L4))
    assert d.allowed and any("no GPU of the cluster matches" in w for w in d.warnings)


# ---- the selection rule -------------------------------------------------------------------------


def test_model_names_match_by_catalogue_and_hami_parts() -> None:
    assert model_key("a100_80gb") == model_key("A100-SXM4-80GB") == "A100-80GB"
    sel = selection({"gpuslice.io/gpu-model": "a100-80gb|L4"})
    assert sel.allowed_models(["A100-80GB", "L4", "T4"]) == {"A100-80GB", "L4"}
    hami = selection({"nvidia.com/use-gputype": "A100", "nvidia.com/nouse-gputype": "40GB"})
    assert hami.allowed_models(["A100-80GB", "A100-40GB", "L4"]) == {"A100-80GB"}
    both = selection({"gpuslice.io/gpu-model": "L4", "nvidia.com/use-gputype": "A100"})
    assert both.allowed_models(["A100-80GB", "L4", "T4"]) == {"A100-80GB", "L4"}


def test_uuid_pins_and_exclusions() -> None:
    sel = selection({"gpuslice.io/gpu-uuid": "GPU-a,GPU-b", "nvidia.com/nouse-gpuuuid": "GPU-b"})
    assert sel.allows_uuid("GPU-a") and not sel.allows_uuid("GPU-b")
    assert not sel.allows_uuid("GPU-c")
    assert sel.allows_uuid("MIG-x", gpu_uuid="GPU-a")  # an instance of a pinned GPU
    assert GpuSelection().allows("anything", "GPU-z") and GpuSelection().empty
    assert contradictions(selection({"gpuslice.io/gpu-uuid": "GPU-b",
                                     "gpuslice.io/gpu-uuid-exclude": "GPU-b"}))


def test_a_selection_that_is_not_text_is_named() -> None:
    with pytest.raises(ValueError, match=r"annotation gpuslice\.io/gpu-uuid"):
        selection({"gpuslice.io/gpu-uuid": 3})
