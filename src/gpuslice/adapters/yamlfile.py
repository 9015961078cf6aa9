"""YAML input files read in one place: a file that cannot be read, is not UTF-8 text or is not
valid YAML is a one-line error naming it (the problem, with its line and column for YAML)."""

from __future__ import annotations

from pathlib import Path

from gpuslice.core.errors import ValidationError


def read_yaml(path: Path, field: str, expected: str) -> object:
    """The document of the YAML file ``path``. A file that cannot be read, is not UTF-8 text
    or is not valid YAML is a :class:`ValidationError` of ``field`` (which names the file) in
    one line: the problem, for YAML with its line and column."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationError(field, expected, f"not UTF-8 text (byte "
                              f"{exc.object[exc.start]:#04x} at offset {exc.start})") from None
    except OSError as exc:
        raise ValidationError(field, expected, exc.strerror or str(exc)) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValidationError(field, expected, yaml_problem(exc)) from None
    except (ValueError, RecursionError) as exc:  # an int of over 4300 digits, deep nesting
        raise ValidationError(field, expected, " ".join(str(exc).split())[:120]) from None


def yaml_problem(exc: Exception) -> str:
    """A PyYAML error in one line: the problem and where (its own text spans several lines
    and quotes the input)."""
    import yaml

    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        text = f"{exc.problem} at line {mark.line + 1} column {mark.column + 1}"
        if exc.context:
            text = f"{exc.context}: {text}"
        return " ".join(text.split())
    return " ".join(str(exc).split())
