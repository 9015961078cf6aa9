"""Measured use read for the planner (``planning/usage.py``): the node agents' /metrics in a
file, several agents and scrapes concatenated; the PromQL asked of a Prometheus server."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.core.errors import ValidationError
from gpuslice.planning.usage import check_window, queries, read_usage
from tests.planner.usage_helpers import PodUse, agent_metrics


def test_each_service_gets_its_busiest_pods_fractions_from_the_agents_metrics(
        tmp_path: Path) -> None:
    one = agent_metrics("n1", [PodUse("classify", "c-0", 13000, 12.0, 428, 40192),
                               PodUse("detect", "d-0", 5000, None, 285, 19968)])
    two = agent_metrics("n2", [PodUse("classify", "c-1", 8000, 30.0, 428, 40192)])
    path = tmp_path / "metrics.txt"
    path.write_text(one + two)
    got = read_usage(str(path))
    c, d = got["classify"], got["detect"]
    assert c.memory == pytest.approx(13000 / 40192)  # c-0's memory, c-1's SMs
    assert c.sm == pytest.approx(0.30 / 0.428)
    assert d.memory == pytest.approx(5000 / 19968) and d.sm is None  # no SM samples
    # a later scrape of the same pod: its highest use against its share
    later = agent_metrics("n1", [PodUse("classify", "c-0", 20000, 5.0, 428, 40192),
                                 PodUse("detect", "d-0", 4000, None, 285, 19968)])
    path.write_text(one + two + later)
    assert read_usage(str(path))["classify"].memory == pytest.approx(20000 / 40192)
    assert read_usage(str(path))["detect"].memory == pytest.approx(5000 / 19968)


def test_a_pod_with_no_service_label_is_not_counted(tmp_path: Path) -> None:
    text = agent_metrics("n1", [PodUse("", "x-0", 30000, 50.0, 428, 40192),
                                PodUse("classify", "c-0", 4000, 10.0, 428, 40192)])
    path = tmp_path / "m.txt"
    path.write_text(text)
    assert set(read_usage(str(path))) == {"classify"}


@pytest.mark.parametrize(("text", "says"), [
    ("services:\n  - {name: a, model: m}\n", "expected a Prometheus text exposition"),
    ("# HELP up x\n# TYPE up gauge\nup 1.0\n", "labelled with a service"),
    ("", "labelled with a service"),
])
def test_a_file_that_is_not_the_agents_metrics_is_refused(tmp_path: Path, text: str,
                                                          says: str) -> None:
    path = tmp_path / "m.txt"
    path.write_text(text)
    with pytest.raises(ValidationError, match=says) as e:
        read_usage(str(path))
    assert e.value.field == "--usage-from" and str(path) in str(e.value)
    with pytest.raises(ValidationError, match="no such file"):
        read_usage(str(tmp_path / "absent.txt"))
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValidationError, match="not UTF-8"):
        read_usage(str(tmp_path / "bin"))


def test_the_queries_take_each_pods_ratio_then_the_peak_then_the_busiest_pod() -> None:
    mem, sm = queries("6h")
    assert mem == ('max by (service) (max_over_time((gpuslice_pod_gpu_memory_used_bytes'
                   '{service!=""} / gpuslice_pod_gpu_memory_cap_bytes{service!=""})[6h:1m]))')
    assert "gpuslice_pod_gpu_sm_utilization_ratio" in sm and "sm_share_ratio" in sm
    assert check_window("1h30m") == "1h30m"
    for bad in ("1 day", "", "6", "-1h"):
        with pytest.raises(ValidationError, match="--usage-window"):
            check_window(bad)


def test_the_metric_names_are_the_ones_the_node_agent_exports() -> None:
    from gpuslice.planning import usage

    text = agent_metrics("n1", [PodUse("a", "a-0", 1, 1.0, 100, 1000)])
    for name in (usage.USED, usage.CAP, usage.BUSY, usage.SHARE):
        assert f"\n{name}{{" in text
