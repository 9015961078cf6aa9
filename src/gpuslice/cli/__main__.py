"""``python -m gpuslice.cli``: the same as the ``gpuslice`` command."""

import sys

from gpuslice.cli import main

sys.exit(main())
