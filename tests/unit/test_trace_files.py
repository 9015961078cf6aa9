from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.adapters.traces.alibaba import InputError, read_nodes, read_pods
from gpuslice.cli import main

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,131072,2,T4\nn1,64000,262144,8,G2\n"
PODS = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
        "p0,4000,8192,1,500,\np1,8000,16384,1,1000,T4\np2,2000,4096,0,0,\n")


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_good_files_load(tmp_path: Path) -> None:
    nodes = read_nodes(write(tmp_path, "n.csv", NODES))
    assert [n.name for n in nodes] == ["n0", "n1"]
    assert nodes[0].gpus[0].memory_mib == 15360  # T4 from the catalogue
    assert nodes[1].model == "G2" and nodes[1].gpus[0].memory_mib == 0  # opaque model
    pods = read_pods(write(tmp_path, "p.csv", PODS), frozenset({"T4", "G2"}))
    assert len(pods) == 3
    assert pods.specs[int(pods.spec_id[1])] == frozenset({"T4"})


BAD_PODS = [
    ("missing column", "name,cpu_milli,memory_mib,num_gpu\np0,1,1,1\n", 1, "gpu_milli",
     "missing column"),
    ("negative request", PODS.replace("p0,4000", "p0,-4000"), 2, "cpu_milli", ">= 0"),
    ("not a number", PODS.replace("p1,8000", "p1,lots"), 3, "cpu_milli", "integer"),
    ("milli over a GPU", PODS.replace("1,500,", "1,1500,"), 2, "gpu_milli", "<= 1000"),
    ("share of many GPUs", PODS.replace("1,500,", "2,500,"), 2, "gpu_milli", "1000"),
    ("unknown model in a constraint", PODS.replace("1000,T4", "1000,T4|H900"), 3, "gpu_spec",
     "unknown GPU model 'H900'"),
    ("short row", PODS + "p3,1\n", 5, "memory_mib", "expected an integer"),
]


@pytest.mark.parametrize(("name", "text", "row", "field", "msg"), BAD_PODS,
                         ids=[b[0] for b in BAD_PODS])
def test_bad_pod_files_name_file_row_and_field(tmp_path: Path, name: str, text: str, row: int,
                                               field: str, msg: str) -> None:
    path = write(tmp_path, "pods.csv", text)
    with pytest.raises(InputError) as exc:
        read_pods(path, frozenset({"T4", "G2"}))
    err = exc.value
    assert (err.row, err.field) == (row, field)
    assert str(path) in str(err) and msg in str(err)
    assert "\n" not in str(err)


@pytest.mark.parametrize(
    ("text", "msg"),
    [("", "file is empty"), ("sn,cpu_milli,memory_mib,gpu,model\n", "no rows"),
     (NODES + "n0,1,1,1,T4\n", "appears twice"), (NODES + "n9,1,1,2,\n", "no GPU model")],
)
def test_bad_node_files(tmp_path: Path, text: str, msg: str) -> None:
    with pytest.raises(InputError, match=msg):
        read_nodes(write(tmp_path, "nodes.csv", text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="file not found"):
        read_nodes(tmp_path / "nope.csv")


@pytest.mark.parametrize(
    ("pods", "expect"),
    [(PODS.replace("1000,T4", "1000,T9"), "row 3, field 'gpu_spec'"),
     ("", "file is empty"),
     (PODS.replace("p2,2000", "p2,-1"), "row 4, field 'cpu_milli'")],
)
def test_cli_reports_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           pods: str, expect: str) -> None:
    code = main(["simulate", "--trace", str(write(tmp_path, "p.csv", pods)), "--nodes",
                 str(write(tmp_path, "n.csv", NODES)), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2
    assert expect in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "expect"),
    [(["--policy", "nope"], "policy"), (["--seeds", "9-1"], "--seeds"),
     (["--tune", "0"], "--tune"), (["--nodes", "x.csv"], "--trace")],
)
def test_cli_rejects_bad_options(capsys: pytest.CaptureFixture[str], args: list[str],
                                 expect: str) -> None:
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err
