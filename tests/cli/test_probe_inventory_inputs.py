"""Probe 3: the fake GPU inventory (``--fake-gpus FILE``), the fake cluster
(``--fake-cluster``) and the mig-parted config of ``mig-apply``. Each bad file is one line
naming the file and the field, exit 2, never a traceback; a binary file is "not UTF-8 text" and
a YAML error is one readable line with its line and column."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice import kubectl_plugin
from gpuslice.cli import main

BINARY = b"\xb3\xff\xfe garbage\n\x00\x01"
BAD_YAML = "gpus:\n  - model: [A100-80GB\n"
MIGON = "gpus:\n- {model: A100-80GB, mig_enabled: true}\n"


def error_line(capsys: pytest.CaptureFixture[str], prog: str = "gpuslice") -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "\\n" not in err, err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    return err.strip()


@pytest.mark.parametrize(("text", "field", "got"), [
    ("gpus:\n- model: A100-80GB\n  faults: [abc]\n", "gpus[0].faults[0]", "'abc'"),
    ("gpus:\n- model: A100-80GB\n  minor: abc\n", "gpus[0].minor", "'abc'"),
    ("gpus:\n- model: A100-80GB\n  minor: -1\n", "gpus[0].minor", "-1"),
    ("gpus:\n- model: Foo\n  memory_mib: abc\n", "gpus[0].memory_mib", "'abc'"),
    ("gpus:\n- model: Foo\n  memory_mib: .nan\n", "gpus[0].memory_mib", "nan"),
    ("gpus:\n- model: Foo\n  memory_mib: .inf\n", "gpus[0].memory_mib", "inf"),
    ("gpus:\n- model: Foo\n  memory_mib: -5\n", "gpus[0].memory_mib", "-5"),
    ("gpus:\n- model: A100-80GB\n  memory_mib: abc\n", "gpus[0].memory_mib", "'abc'"),
    ("gpus:\n- model: A100-80GB\n  used_mib: .inf\n", "gpus[0].used_mib", "inf"),
    ("gpus:\n- {model: A100-80GB, uuid: a}\n- {model: A100-80GB, uuid: a}\n",
     "gpus[1].uuid", "'a'"),
    ("gpus:\n- {model: A100-80GB, uuid: [1]}\n", "gpus[0].uuid", "[1]"),
    ("gpus:\n- {model: A100-80GB, mig_enabled: maybe}\n", "gpus[0].mig_enabled", "'maybe'"),
    ("gpus:\n- {model: A100-80GB, mig: xx}\n", "gpus[0].mig", "'xx'"),
    ("- 1\n", "", "'list'"),
    ("just a string\n", "", "'str'"),
])
def test_a_bad_fake_gpu_inventory_names_the_file_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, field: str,
        got: str) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(text)
    assert main(["gpus", "--local", "--fake-gpus", str(inv)]) == 2
    line = error_line(capsys)
    assert f"{inv}: {field}" in line if field else f"{inv}: expected" in line, line
    assert line.endswith(f"got {got}"), line


def test_a_binary_or_broken_fake_gpu_inventory_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_bytes(BINARY)
    assert main(["gpus", "--local", "--fake-gpus", str(inv)]) == 2
    line = error_line(capsys)
    assert str(inv) in line and "not UTF-8 text" in line, line
    inv.write_text(BAD_YAML)
    assert main(["gpus", "--local", "--fake-gpus", str(inv)]) == 2
    line = error_line(capsys)
    assert str(inv) in line and "line 3 column 1" in line, line


FC_HUGE = ("nodes:\n- metadata:\n    name: n\n    annotations: {gpuslice.io/inventory: "
           "'[{\"uuid\":\"u\",\"index\":0,\"model\":\"A100-80GB\",\"memoryMiB\":1e400}]'}\n")


@pytest.mark.parametrize(("content", "reason"), [
    (BINARY, "not UTF-8 text"),
    (b"nodes:\n- metadata: {name: [a\n", "line 3 column 1"),
    (b"nodes:\n- metadata: {name: [a]}\n", "nodes[0].metadata.name: expected a name"),
    (b"pods:\n- metadata: {name: p, namespace: [a]}\n", "pods[0].metadata.namespace"),
    (FC_HUGE.encode(), "node n: inventory[0].memoryMiB"),
    (b"nodes:\n- metadata: {name: a}\n- metadata: {name: b}\n- metadata: {name: a}\n",
     "nodes[2].metadata.name: expected a name no other node has (nodes[0] has it too), "
     "got 'a'"),
    (b"nodes:\n- metadata: {name: a, labels: [gpu, big]}\n",
     "nodes[0].metadata.labels (node 'a'): expected a mapping (name: value), got "
     "['gpu', 'big']"),
    (b"nodes:\n- metadata: {name: a, labels: gpu}\n", "nodes[0].metadata.labels (node 'a')"),
    (b"pods:\n- metadata: {name: p, namespace: x}\n- metadata: {name: p, namespace: x}\n",
     "pods[1].metadata.name: expected a name no other pod of its namespace has"),
    (b"pods:\n- metadata: {name: p, namespace: x, annotations: [a]}\n",
     "pods[0].metadata.annotations (pod 'p')"),
])
def test_a_bad_fake_cluster_names_the_file_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes,
        reason: str) -> None:
    fc = tmp_path / "cluster.yaml"
    fc.write_bytes(content)
    assert kubectl_plugin.main(["status", "--fake-cluster", str(fc)]) == 2
    line = error_line(capsys, "kubectl-gpuslice")
    assert f"--fake-cluster {fc}" in line and reason in line, line
    assert main(["reconfig", "run", "--once", "--fake-cluster", str(fc)]) == 2
    line = error_line(capsys)
    assert f"--fake-cluster {fc}" in line and reason in line, line


def mig_config(entries: str, version: str = "v1") -> str:
    return f"version: {version}\nmig-configs:\n  c:\n{entries}"


@pytest.mark.parametrize(("text", "field", "expected"), [
    (mig_config("  - devices: all\n    mig-enabled: true\n    mig-devices: {1g.10gb: abc}\n"),
     "mig-configs.c[0].mig-devices[1g.10gb]", "a whole number"),
    (mig_config("  - devices: all\n    mig-enabled: true\n    mig-devices: {1g.10gb: 1.5}\n"),
     "mig-configs.c[0].mig-devices[1g.10gb]", "a whole number"),
    (mig_config("  - devices: abc\n    mig-enabled: true\n    mig-devices: {1g.10gb: 1}\n"),
     "mig-configs.c[0].devices", "all or a list of GPU indices"),
    (mig_config("  - devices: [-1]\n    mig-devices: {1g.10gb: 1}\n"),
     "mig-configs.c[0].devices", "all or a list of GPU indices"),
    (mig_config("  - abc\n"), "mig-configs.c[0]", "a mapping"),
    (mig_config("  - devices: all\n    mig-enabled: true\n    mig-devices: [1]\n"),
     "mig-configs.c[0].mig-devices", "a mapping of MIG profile to count"),
    (mig_config("  - devices: all\n    mig-enabled: maybe\n    mig-devices: {1g.10gb: 1}\n"),
     "mig-configs.c[0].mig-enabled", "true or false"),
    (mig_config("  - devices: all\n    mig-placements: 3g.40gb@0\n"),
     "mig-configs.c[0].mig-placements", "a list of placements"),
    (mig_config("  - devices: all\n    mig-placements: [zz]\n"),
     "mig-configs.c[0].mig-placements", "items like '3g.40gb@0'"),
    (mig_config("  - devices: [99]\n    mig-enabled: true\n    mig-devices: {1g.10gb: 1}\n"),
     "mig-configs.c[0].devices", "indices of this node's GPUs (0)"),
    (mig_config("  - devices: all\n    mig-devices: {9g.99gb: 1}\n"),
     "mig-configs.c[0].mig-devices", "one of 1g.10gb"),
    (mig_config("  - devices: all\n    mig-devices: {1g.10gb: 9}\n"),
     "mig-configs.c[0].mig-devices[1g.10gb]", "at most 7"),
    (mig_config("  - devices: all\n    mig-devices: {1g.10gb: 1}\n", "v2"),
     "version", "v1"),
    ("mig-configs:\n  c: []\n", "version is missing:", "v1"),  # said in words, no None
    ("version: v1\nmig-configs:\n  c: abc\n", "mig-configs.c", "a list of entries"),
    ("- 1\n", "", "a mig-parted config"),
])
def test_a_bad_mig_parted_config_names_the_file_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, field: str,
        expected: str) -> None:
    (tmp_path / "inv.yaml").write_text(MIGON)
    mp = tmp_path / "mp.yaml"
    mp.write_text(text)
    assert main(["mig-apply", str(mp), "--config", "c", "--dry-run", "--fake-gpus",
                 str(tmp_path / "inv.yaml")]) == 2
    line = error_line(capsys)
    sep = " " if field.endswith(":") else ": "
    assert f"{mp}: {field}{sep}expected {expected}" in line if field else \
        f"{mp}: expected {expected}" in line, line


@pytest.mark.parametrize(("content", "reason"), [
    (BINARY, "not UTF-8 text"),
    (b"version: v1\nmig-configs:\n  c:\n  abc\n", "line 5 column 1"),
])
def test_a_binary_or_broken_mig_parted_config_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes,
        reason: str) -> None:
    (tmp_path / "inv.yaml").write_text(MIGON)
    mp = tmp_path / "mp.yaml"
    mp.write_bytes(content)
    assert main(["mig-apply", str(mp), "--config", "c", "--dry-run", "--fake-gpus",
                 str(tmp_path / "inv.yaml")]) == 2
    line = error_line(capsys)
    assert f"{mp}: expected" in line and reason in line, line


def test_a_good_mig_parted_config_still_applies(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "inv.yaml").write_text(MIGON)
    mp = tmp_path / "mp.yaml"
    mp.write_text(mig_config("  - devices: [0]\n    mig-enabled: true\n"
                             "    mig-devices: {1g.10gb: 7}\n"
                             "  - devices: all\n    mig-enabled: false\n"))
    assert main(["mig-apply", str(mp), "--config", "c", "--dry-run", "--fake-gpus",
                 str(tmp_path / "inv.yaml")]) == 0
    assert capsys.readouterr().out.count("create 1g.10gb@") == 7
