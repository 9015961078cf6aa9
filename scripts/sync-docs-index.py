#!/usr/bin/env python3
"""Write docs/index.md, the site's front page, from README.md (links made relative to docs/).

README.md is the one to edit; tests/cli/test_readme_commands.py checks that docs/index.md is
what this script writes. Run it after changing README.md: ``python scripts/sync-docs-index.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTE = "<!-- written from README.md by scripts/sync-docs-index.py: edit README.md -->\n"


def index_from_readme(readme: str) -> str:
    text = readme.replace("](docs/", "](").replace("[docs/", "[")
    # outside docs/ there is no page to link to: name the file instead
    text = text.replace("[deploy/README.md](deploy/README.md)", "`deploy/README.md`")
    return NOTE + text


def main() -> int:
    out = ROOT / "docs" / "index.md"
    out.write_text(index_from_readme((ROOT / "README.md").read_text()))
    print(f"wrote {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
