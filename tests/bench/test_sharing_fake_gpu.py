"""``bench sharing --fake-timer MODEL@GPU`` (issue 54): the slices are sized from the named
GPU's memory and the GPU's model is recorded; a fake timer that names no known model or GPU is
one line listing the known ones, before any folder is made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice.cli import main
from gpuslice.core.errors import ValidationError
from gpuslice.core.speedmodel import parse_fake_timer
from tests.cli.test_bad_input import run

QUICK = ["--workload", "tiny", "--warmup-s", "0", "--window-s", "0.3", "--parts", "throughput"]


def test_a_t4_gets_slices_of_a_t4s_memory(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b"
    main(["bench", "sharing", "--fake-timer", "resnet50@T4", "--out", str(out), *QUICK])
    text = capsys.readouterr().out
    doc = json.loads((out / "sharing.json").read_text())
    assert doc["gpu_name"] == "T4" and doc["gpu_memory_mib"] == 15360
    assert doc["throughput"]["gpuslice"]["mem_cap_mib"] == 15360 // 7
    assert "[14, 14" not in text and "slices 14% threads" in " ".join(text.split())


@pytest.mark.parametrize(("spec", "says"), [
    ("nonsense", "MODEL one of bert-base, embedder, mobilenet-v3, resnet50"),
    ("resnet50@Z9", "GPU a catalogue model (P100, T4,"),
])
def test_a_bad_fake_timer_leaves_no_folder(spec: str, says: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench-out"
    code, err = run(["bench", "sharing", "--fake-timer", spec, "--out", str(out)], capsys)
    assert code == 2 and not out.exists()
    assert err.startswith("gpuslice: error: --fake-timer: expected MODEL@GPU with ") and says \
        in err and "['" not in err, err


def test_parse_fake_timer_names_the_catalogue_gpu() -> None:
    assert parse_fake_timer("resnet50@h100") == ("resnet50", "H100-SXM")
    assert parse_fake_timer("bert-base") == ("bert-base", "H100-SXM")
    with pytest.raises(ValidationError, match="--fake-timer"):
        parse_fake_timer("resnet50@H999")
    assert parse_fake_timer("resnet50@") == ("resnet50", "H100-SXM")
