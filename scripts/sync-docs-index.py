#!/usr/bin/env python3
"""Write the site's pages that mirror files outside docs/: docs/index.md, the front page, from
README.md, and docs/install.md, the install guide, from deploy/README.md (links made relative
to docs/).

README.md and deploy/README.md are the ones to edit; tests/cli/test_readme_commands.py checks
that both pages are what this script writes. Run it after changing either:
``python scripts/sync-docs-index.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTE = "<!-- written from README.md by scripts/sync-docs-index.py: edit README.md -->\n"
INSTALL_NOTE = ("<!-- written from deploy/README.md by scripts/sync-docs-index.py: edit "
                "deploy/README.md -->\n")


def index_from_readme(readme: str) -> str:
    text = readme.replace("](docs/", "](").replace("[docs/", "[")
    # the install guide is on the site as install.md
    text = text.replace("[deploy/README.md](deploy/README.md)", "[deploy/README.md](install.md)")
    return NOTE + text


def install_from_deploy_readme(guide: str) -> str:
    """deploy/README.md as docs/install.md: its links to ../docs/PAGE become PAGE."""
    return INSTALL_NOTE + guide.replace("](../docs/", "](")


def main() -> int:
    pages = {ROOT / "docs" / "index.md": index_from_readme((ROOT / "README.md").read_text()),
             ROOT / "docs" / "install.md": install_from_deploy_readme(
                 (ROOT / "deploy" / "README.md").read_text())}
    for out, text in pages.items():
        out.write_text(text)
        print(f"wrote {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
