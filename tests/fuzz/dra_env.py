"""A DRA driver on a fake node (tests/dra/conftest.py's: an H100 shared, an H100 in MIG mode, a
T4 whole) served over its unix sockets, for one fuzz module."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gpuslice.core import dra
from tests.dra.conftest import Node, make_node
from tests.dra.kubelet import DraClient


@contextlib.contextmanager
def dra_node() -> Iterator[tuple[Node, DraClient]]:
    root = Path(tempfile.mkdtemp(prefix="draf", dir="/tmp"))  # unix socket paths: short
    node = make_node(root, [{"model": "H100-SXM"}, {"model": "H100-SXM", "mig_enabled": True},
                            {"model": "T4"}], {"0": dra.SHARE, "1": dra.MIG},
                     claim_read_timeout_s=5.0)
    try:
        yield node, node.serve()
    finally:
        node.stop()
        node.driver.stop_mps()
        shutil.rmtree(root, ignore_errors=True)


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}
