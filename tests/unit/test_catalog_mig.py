from __future__ import annotations

import pytest

from gpuslice.core import catalog, mig
from gpuslice.core.errors import ValidationError

REQUIRED = ["T4", "P100", "V100M16", "V100M32", "A10", "A30", "L4", "L40S", "A100-40GB",
            "A100-80GB", "H100-SXM", "H100-PCIE", "H200"]


@pytest.mark.parametrize("name", REQUIRED)
def test_catalogue_has_the_required_models_with_figures(name: str) -> None:
    m = catalog.lookup(name)
    assert m is not None
    assert m.memory_mib > 0 and m.sms and m.fp16_tflops
    assert not m.opaque


@pytest.mark.parametrize(
    ("name", "mig_capable", "slices"),
    [("A100-80GB", True, 8), ("H100-SXM", True, 8), ("H200", True, 8), ("A30", True, 4),
     ("T4", False, 0), ("L40S", False, 0)],
)
def test_mig_capability(name: str, mig_capable: bool, slices: int) -> None:
    m = catalog.resolve(name)
    assert m.mig_capable is mig_capable
    if m.mig:
        assert m.mig.memory_slices == slices


def test_aliases_and_case_insensitive_lookup() -> None:
    assert catalog.lookup("nvidia h100 80gb hbm3") is catalog.lookup("H100-SXM")
    assert catalog.lookup("a100-sxm4-80gb") is catalog.lookup("A100-80GB")
    # names exactly as NVML reports them on common nodes
    for nvml_name, model in [("Tesla T4", "T4"), ("Tesla V100-SXM2-16GB", "V100M16"),
                             ("Tesla V100-PCIE-32GB", "V100M32"),
                             ("NVIDIA A100 80GB PCIe", "A100-80GB"), ("NVIDIA H200", "H200"),
                             ("NVIDIA H100 PCIe", "H100-PCIE")]:
        found = catalog.lookup(nvml_name)
        assert found is not None and found.name == model, nvml_name


def test_unknown_model_is_opaque_with_given_memory() -> None:
    g2 = catalog.resolve("G2", memory_mib=32768)
    assert g2.opaque and g2.memory_mib == 32768 and g2.mig is None


def test_unknown_model_without_memory_is_an_error_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="gpu model"):
        catalog.resolve("G9")


def test_h100_profile_table_matches_nvml_capture() -> None:
    geo = catalog.resolve("H100-SXM").mig
    assert geo is not None
    p = geo.profile("3g.40gb")
    assert (p.profile_id, p.compute_slices, p.memory_slices, p.memory_mib, p.sms,
            p.max_instances, p.starts) == (9, 3, 4, 40448, 60, 2, (0, 4))
    assert geo.profile(15).starts == (0, 2, 4, 6)


A100 = catalog.resolve("A100-80GB").mig
assert A100 is not None


@pytest.mark.parametrize(
    ("layout", "valid", "problem"),
    [
        ("7g.80gb@0", True, None),
        ("4g.40gb@0,3g.40gb@4", True, None),
        ("3g.40gb@0,2g.20gb@4,1g.10gb@6", True, None),
        ("1g.10gb@0,1g.10gb@1,1g.10gb@2,1g.10gb@3,1g.10gb@4,1g.10gb@5,1g.10gb@6", True, None),
        ("3g.40gb@0,3g.40gb@4", True, None),
        ("3g.40gb@2", False, "not one of the allowed starts"),
        ("4g.40gb@0,3g.40gb@0", False, "already used"),
        ("2g.20gb@0,2g.20gb@2,2g.20gb@4,1g.20gb@6,1g.10gb@6", False, "already used"),
        ("1g.20gb@0,1g.20gb@2,1g.20gb@4,1g.20gb@6,1g.10gb@1", False, "already used"),
    ],
)
def test_layout_validity(layout: str, valid: bool, problem: str | None) -> None:
    placements = mig.parse_layout(A100, layout)
    problems = mig.layout_problems(A100, placements)
    assert mig.is_valid_layout(A100, placements) is valid
    if problem:
        assert any(problem in p for p in problems), problems


def test_too_many_media_instances_is_invalid() -> None:
    lay = mig.parse_layout(A100, "1g.10gb+me@0,1g.10gb+me@1")
    assert any("at most 1" in p for p in mig.layout_problems(A100, lay))


@pytest.mark.parametrize(
    ("used", "fits", "not_fits"),
    [
        ("", {"7g.80gb", "4g.40gb", "3g.40gb", "2g.20gb", "1g.20gb", "1g.10gb"}, set()),
        ("4g.40gb@0", {"3g.40gb", "2g.20gb", "1g.20gb", "1g.10gb"}, {"7g.80gb", "4g.40gb"}),
        ("3g.40gb@0,3g.40gb@4", set(), {"1g.10gb", "2g.20gb"}),
        ("3g.40gb@4", {"3g.40gb", "4g.40gb", "2g.20gb"}, {"7g.80gb"}),
    ],
)
def test_fitting_profiles_on_partly_used_gpu(used: str, fits: set[str], not_fits: set[str]) -> None:
    names = {p.name for p in mig.fitting_profiles(A100, mig.parse_layout(A100, used),
                                                  include_media=False)}
    assert fits <= names
    assert not (not_fits & names)


def test_maximal_layouts_are_valid_unique_and_maximal() -> None:
    layouts = mig.maximal_layouts(A100)
    assert len(layouts) == len(set(layouts))
    assert (mig.MigPlacement(0, A100.profile("7g.80gb")),) in layouts
    for lay in layouts:
        assert mig.is_valid_layout(A100, lay)
        assert mig.fitting_placements(A100, lay, include_media=False) == []


def test_a30_maximal_layouts() -> None:
    geo = catalog.resolve("A30").mig
    assert geo is not None
    shown = {tuple(str(p) for p in lay) for lay in mig.maximal_layouts(geo)}
    assert ("4g.24gb@0",) in shown
    assert ("2g.12gb@0", "2g.12gb@2") in shown
    assert ("1g.6gb@0", "1g.6gb@1", "1g.6gb@2", "1g.6gb@3") in shown


def test_bad_layout_text_names_the_field() -> None:
    with pytest.raises(ValidationError, match="mig layout"):
        mig.parse_layout(A100, "3g.40gb")
    with pytest.raises(ValidationError, match="mig profile"):
        mig.parse_layout(A100, "9g.99gb@0")
