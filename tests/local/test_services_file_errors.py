"""``gpuslice up FILE``: fields of the services file that used to end in a traceback are
refused with one line naming the field (exit 2), before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.cli import main

LAYOUTS = "layouts: {day: {a: {compute: 50}}}"


@pytest.mark.parametrize(("text", "field"), [
    ("services: [{name: a, command: \"echo 'unbalanced\"}]", "services[a].command"),
    ("services: [{name: a, command: x, priority: [high]}]", "services[a].priority"),
    ("services: [{name: a, command: x, priority: {high: 1}}]", "services[a].priority"),
    ("services: [{name: a, command: x, env: {A: [1]}}]", "services[a].env.A"),
    ("services: [{name: a, command: x, gpu: [0]}]", "services[a].gpu"),
    ("services: [{name: a, command: x, gpu: true}]", "services[a].gpu"),
    (f"services: [{{name: a, command: x}}]\n{LAYOUTS}\nwindows: 5", "windows"),
    (f"services: [{{name: a, command: x}}]\n{LAYOUTS}\nwindows: {{layout: day}}", "windows"),
    (f"services: [{{name: a, command: x}}]\n{LAYOUTS}\nwindows: [5]", "windows[0]"),
    (f"services: [{{name: a, command: x}}]\n{LAYOUTS}\nwindows: [{{layout: [day]}}]",
     "windows[0].layout"),
    (f"services: [{{name: a, command: x}}]\n{LAYOUTS}\ndefault: [day]", "default"),
    (f"services: [{{name: a, command: x}}]\n{LAYOUTS}\ndefault: {{day: 1}}", "default"),
])
def test_bad_services_file_fields_are_one_line_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, field: str) -> None:
    f = tmp_path / "s.yaml"
    f.write_text(text + "\n")
    assert main(["up", str(f), "--state-dir", str(tmp_path / "st"),
                 "--fake-gpus", str(tmp_path / "nosuch.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert f"s.yaml: {field}: expected" in err, err
    assert not (tmp_path / "st").exists()  # refused before anything started
