"""Flags and environment the CLI's third independent probe broke, each given to the real entry
point: a bad value is one line naming it with exit code 2, never a traceback, a server started
on another port than asked, or output that vanishes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice.adapters.kube.client import _Unreachable
from gpuslice.cli.flagtypes import parse_hostport
from gpuslice.core.errors import Unavailable
from tests.cli.test_bad_input import run


@pytest.mark.parametrize("argv", [
    ["dra-allocator", "--interval", "nan"], ["dra-allocator", "--settle", "-1"],
    ["dra-allocator", "--max-backoff", "inf"], ["dra-driver", "--poll", "nan"],
    ["dra-driver", "--resync", "0"], ["dra-driver", "--quiet", "nan"],
    ["node-agent", "--quiet", "-1"], ["node-agent", "--stop-wait", "nan"],
    ["reconfig", "run", "--every", "nan"], ["router", "--slo-ms", "nan"],
], ids=" ".join)
def test_nan_infinite_and_negative_durations_are_refused_at_parse_time(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(argv, capsys)
    assert code == 2 and f"argument {argv[-2]}: expected a" in err, err


@pytest.mark.parametrize("text", ["127.0.0.1:70000", "h:-1", "h:x", "h:", "h:123456",
                                  "h:\u0664\u0664"])
def test_a_port_past_65535_is_refused_not_wrapped(text: str) -> None:
    """``extender --listen 127.0.0.1:70000`` served on port 4464 (70000 mod 65536): the port
    is checked for every listening option (extender, router, node agent metrics)."""
    with pytest.raises(Exception, match=r"--listen: expected HOST:PORT or PORT, the port from"):
        parse_hostport("--listen", text)
    assert parse_hostport("--listen", "[::1]:8080") == ("::1", 8080)
    assert parse_hostport("--listen", "9402") == ("0.0.0.0", 9402)


def test_the_extender_refuses_a_port_past_65535(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "key"
    key.write_text("k" * 32)
    code, err = run(["extender", "--key-file", str(key), "--listen", "127.0.0.1:70000"], capsys)
    assert code == 2 and "--listen" in err and "70000" in err


def test_node_agent_replicas_are_bounded_before_anything_is_built(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["node-agent", "--node", "n1", "--fake-gpus", "1", "--replicas",
                     "99999999999"], capsys)
    assert code == 2 and "--replicas: expected 1..1000" in err


@pytest.mark.parametrize("columns", ["abc", "0", "-5", "99999999999"])
def test_a_stray_columns_neither_breaks_nor_blanks_the_output(columns: str) -> None:
    """``COLUMNS=abc`` crashed every command (even ``--version``); ``COLUMNS=0`` wrote
    nothing at all, error messages included."""
    env = {"COLUMNS": columns, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "gpuslice.cli", "mig", "NOPE"], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "gpu model: expected a known model" in out.stderr
    assert "Traceback" not in out.stderr
    ver = subprocess.run([sys.executable, "-m", "gpuslice.cli", "--version"], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert ver.returncode == 0 and ver.stdout.strip(), ver.stderr


def test_an_api_server_that_does_not_answer_is_a_failure_not_bad_input() -> None:
    """Exit 1 (the command ran; what it needs is not there), not 2 (the input's fault)."""
    assert issubclass(_Unreachable, Unavailable)


@pytest.mark.parametrize(("raise_it", "said"), [
    (b"\xb3\xff".decode, "an input file is not UTF-8 text"),
    (lambda: float(10**400), "a number in the input is too large"),
], ids=["not-utf8", "huge-number"])
def test_a_binary_file_or_a_huge_number_is_bad_input_not_a_traceback(
        raise_it: Callable[[], object], said: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """main()'s last resort: a reader that met bytes that are not UTF-8, or a number past
    what a float holds, before any check of its own."""
    from gpuslice import cli

    def handler(*_: object) -> int:
        raise_it()
        return 0

    class Parser:
        def parse_args(self, _argv: object) -> argparse.Namespace:
            return argparse.Namespace(handler=handler)

    monkeypatch.setattr(cli, "_build_parser", Parser)
    code, err = run(["anything"], capsys)
    assert code == 2 and said in err and "Traceback" not in err


def test_a_cdi_root_that_is_a_file_is_refused_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key, root = tmp_path / "key", tmp_path / "cdi"
    key.write_text("k" * 32)
    root.write_text("not a folder")
    code, err = run(["node-agent", "--node", "n1", "--key-file", str(key), "--socket-dir",
                     str(tmp_path), "--fake-gpus", "1", "--cdi-root", str(root)], capsys)
    assert code == 2 and "--cdi-root: expected a folder" in err, err
