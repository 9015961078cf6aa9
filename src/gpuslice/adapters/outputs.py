"""Output files of the commands that work long before they write (simulate, bench, profile, plan
--export, --write-json): the paths checked before the work, the files written all or none."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gpuslice.core.errors import ValidationError


def check_out_dir(out: Path, names: Sequence[str], field: str = "--out",
                  expected: str = "a folder that can be created and written") -> Path:
    """Before the work: ``out`` is a folder (made if need be) a file can be written in, and
    none of ``names`` in it is taken by something other than a file."""
    if out.exists() and not out.is_dir():
        raise ValidationError(field, expected, f"{out}: not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ValidationError(field, expected, f"{out}: {exc.strerror or exc}") from None
    for name in names:
        if (out / name).exists() and not (out / name).is_file():
            raise ValidationError(field, f"a folder where {name} can be written",
                                  f"{out / name}: not a file")
    return out


FILE_EXPECTED = "a file that can be written (in a folder that exists or can be created)"


def check_out_file(path: Path, field: str = "--out", *, devices_ok: bool = False,
                   folder_expected: str = "a folder that can be created and written") -> Path:
    """Before the work: ``path`` can be written, as a new or existing file whose folder exists
    or can be made (``folder_expected`` says what of the folder when it cannot); with
    ``devices_ok`` also an existing path that is not a regular file (a device or a pipe such
    as ``/dev/stdout``, written in place), never a folder."""
    expected = FILE_EXPECTED
    if path.is_dir():
        raise ValidationError(field, expected, f"{path}: a folder")
    if not devices_ok and path.exists() and not path.is_file():
        raise ValidationError(field, expected, f"{path}: not a file")
    check_out_dir(path.parent, (), field, folder_expected)
    if path.exists() and not os.access(path, os.W_OK):
        raise ValidationError(field, expected, f"{path}: not writable")
    return path


def write_files(writers: Mapping[Path, Callable[[Path], object]], field: str = "--out",
                ) -> list[Path]:
    """Each writer writes its file at a temporary path beside it (with the same suffix, for
    matplotlib); once all were written each is renamed over its target. On a failure the
    temporaries are removed and the error is one line naming the path (a
    :class:`ValidationError` of ``field``)."""
    tmps: dict[Path, Path] = {}
    try:
        for path, write in writers.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists() and not path.is_file():
                raise ValidationError(field, "a file that can be written", f"{path}: not a file")
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
            tmps[path] = tmp
            write(tmp)
        for path, tmp in tmps.items():
            os.replace(tmp, path)
    except OSError as exc:
        where = exc.filename if exc.filename is not None else next(iter(writers), "")
        raise ValidationError(field, "a file that can be written",
                              f"{where}: {exc.strerror or exc}") from None
    finally:
        for tmp in tmps.values():
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    return list(writers)
