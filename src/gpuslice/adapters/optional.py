"""Optional dependencies, imported only by the commands that use them, with an error that names
the extra to install when they are missing (the container image leaves the plotting and
planning libraries out: its components never import them).

| extra      | brings       | used by                                              |
|------------|--------------|------------------------------------------------------|
| ``plot``   | matplotlib   | figures of ``simulate``, ``demo``, ``profile``, ``bench`` |
| ``planner``| scipy        | ``plan``, ``replan``, ``demo`` (``core.planner``)      |
| ``kube``   | kubernetes   | every component that talks to an API server           |
| ``gpu``    | nvidia-ml-py | NVML on a GPU node                                    |
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from gpuslice.core.errors import MissingDependency


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display). Matplotlib needs a writable
    configuration and cache directory: when ``MPLCONFIGDIR`` is unset and the default one
    (``~/.config/matplotlib``) cannot be written (a read-only root filesystem, a user without a
    home), it goes under the temporary directory instead of failing or warning."""
    if "MPLCONFIGDIR" not in os.environ:
        home = Path(os.path.expanduser("~"))
        default = home / ".config" / "matplotlib"
        if not _writable(default):
            os.environ["MPLCONFIGDIR"] = str(Path(tempfile.gettempdir()) /
                                             f"gpuslice-matplotlib-{os.getuid()}")
    try:
        import matplotlib
    except ImportError:
        raise MissingDependency("matplotlib", "plot", "drawing figures") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _writable(path: Path) -> bool:
    """``path`` exists and is writable, or its nearest existing parent is (so it can be
    created)."""
    p = path
    while not p.exists():
        if p.parent == p:
            return False
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK)
