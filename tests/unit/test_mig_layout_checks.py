"""Impossible MIG layouts are refused before anything is searched or changed (core.mig), and
the mig-parted executor refuses them before it touches a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.core import catalog, mig
from gpuslice.core.errors import ValidationError
from gpuslice.services.mig_executor import STATE_LABEL, MigExecutor

A100 = catalog.resolve("A100-80GB").mig
assert A100 is not None


@pytest.mark.parametrize(("text", "problem"), [
    ("4g.40gb@0,3g.40gb@0", "already used by 4g.40gb@0"),
    ("3g.40gb@0,3g.40gb@0", "already used by 3g.40gb@0"),
    ("3g.40gb@2", "not one of the allowed starts"),
    ("7g.80gb@0,1g.10gb@6", "already used by 7g.80gb@0"),
])
def test_parse_layout_with_check_refuses_layouts_no_gpu_holds(text: str, problem: str) -> None:
    assert mig.parse_layout(A100, text)  # unchecked: parsed as written (mig --layout checks)
    with pytest.raises(ValidationError) as exc:
        mig.parse_layout(A100, text, check=True)
    assert exc.value.field == "mig layout" and problem in str(exc.value)
    assert [str(p) for p in mig.parse_layout(A100, "4g.40gb@0,3g.40gb@4", check=True)] == \
        ["4g.40gb@0", "3g.40gb@4"]


@pytest.mark.parametrize("text", ["3g.40gb@0,3g.40gb@0", "4g.40gb@0,3g.40gb@0",
                                  "1g.10gb+me@0,1g.10gb+me@1"])
def test_layout_changes_refuses_a_desired_layout_that_conflicts_with_itself(text: str) -> None:
    current = mig.parse_layout(A100, "4g.40gb@0,3g.40gb@4")
    with pytest.raises(ValidationError, match="mig layout"):
        mig.layout_changes(current, mig.parse_layout(A100, text))
    assert [str(c) for c in mig.layout_changes(current, mig.parse_layout(A100, "7g.80gb@0"))] \
        == ["destroy 4g.40gb@0", "destroy 3g.40gb@4", "create 7g.80gb@0"]


def test_impossible_counts_fail_before_any_search(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = mig.is_valid_layout

    def counting(geometry, layout):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(geometry, layout)

    monkeypatch.setattr(mig, "is_valid_layout", counting)
    for counts in ({"1g.10gb": 8}, {"3g.40gb": 2, "1g.10gb": 1}, {"1g.10gb": 10**400}):
        with pytest.raises(ValidationError, match="fits one GPU"):
            mig.layout_for_counts(A100, counts)
    assert calls == []  # before: 8 x 1g.10gb backtracked through every order of 8 starts
    assert len(mig.layout_for_counts(A100, {"1g.10gb": 7})) == 7
    assert len(calls) <= 7 * 7  # each instance of a profile only after the one before it


def test_counts_search_finds_what_the_unpruned_search_finds() -> None:
    for counts, text in [({"2g.20gb": 3, "1g.10gb": 1}, "2g.20gb@0,2g.20gb@2,2g.20gb@4,1g.10gb@6"),
                         ({"1g.20gb": 4}, "1g.20gb@0,1g.20gb@2,1g.20gb@4,1g.20gb@6"),
                         ({"3g.40gb": 2}, "3g.40gb@0,3g.40gb@4")]:
        assert ",".join(str(p) for p in mig.layout_for_counts(A100, counts)) == text


INV = """
gpus:
  - model: A100-80GB
    mig: "4g.40gb@0,3g.40gb@4"
"""


@pytest.mark.parametrize("placements", [["3g.40gb@0", "3g.40gb@0"], ["4g.40gb@0", "3g.40gb@0"]])
def test_the_executor_refuses_an_impossible_layout_before_touching_the_gpu(
        tmp_path: Path, placements: list[str]) -> None:
    (tmp_path / "inv.yaml").write_text(INV)
    nvml = FakeNvml.from_yaml(tmp_path / "inv.yaml", node="n1")
    api = FakeApiServer()
    api.add_node({"metadata": {"name": "n1"}})
    uuid = nvml.devices()[0].uuid
    before = nvml.mig_layout(uuid)
    doc = {"mig-configs": {"bad": [{"devices": "all", "mig-enabled": True,
                                    "mig-placements": placements}]}}
    with pytest.raises(ValidationError) as exc:
        MigExecutor(nvml, api, "n1").apply(doc, "bad")
    assert exc.value.field == "mig-configs.bad[0].mig-placements"
    assert nvml.mig_layout(uuid) == before
    assert STATE_LABEL not in (api.list_nodes()[0]["metadata"].get("labels") or {})


@pytest.mark.parametrize("text", ["1g.10gb@" + "9" * 5000, "1g.10gb@1234", "9" * 5000 + "@0"])
def test_a_start_or_profile_id_of_thousands_of_digits_is_a_layout_error(text: str) -> None:
    """Python refuses to read an int of over 4300 digits (ValueError): such a layout written
    on a node (``gpuslice.io/mig-desired``) must be a layout error like any other."""
    with pytest.raises(ValidationError, match="mig"):
        mig.parse_layout(A100, text, check=True)
