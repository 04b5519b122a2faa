"""docs/design.md matches the code: every file path it names exists, and every class or constant
its module table places in a folder is defined there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESIGN = (REPO / "docs" / "design.md").read_text()
PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*\.(?:py|md|sh|json|png|toml)\b")
ROOTS = [REPO, REPO / "forkjax", REPO / "forkjax" / "pallas_kernels"]
CHECKPOINT_FILES = {"config.json"}  # a user's model directory's, not this repository's


def _exists(path: str) -> bool:
    """A path as the text writes it: from the repository, from forkjax/ or its kernels' folder,
    or (a bare file name) anywhere in forkjax/ or scripts/."""
    if path in CHECKPOINT_FILES:
        return True
    if "/" not in path:
        return (REPO / path).exists() or any(REPO.glob(f"forkjax/**/{path}")) or any(REPO.glob(f"scripts/**/{path}"))
    return any((root / path).exists() for root in ROOTS)


def test_every_path_the_design_names_exists():
    missing = sorted({p for p in PATH.findall(DESIGN) if not _exists(p)})
    assert not missing, missing


def test_the_module_table_places_each_name_where_it_is_defined():
    rows = re.findall(r"^\| ((?:`forkjax/[^`]*`(?:, )?)+)[^|]*\| (.*) \|$", DESIGN, re.M)
    assert len(rows) >= 8, rows
    wrong = []
    for where, what in rows:
        folders = [REPO / w for w in re.findall(r"`(forkjax/[^`]*)`", where)]
        code = "".join(f.read_text() for d in folders for f in ([d] if d.is_file() else d.rglob("*.py")))
        for name in re.findall(r"`([A-Z][A-Za-z0-9_]*)`", what):
            if not re.search(rf"^\s*(?:class {name}\b|{name}\s*[:=])", code, re.M):
                wrong.append((where, name))
    assert not wrong, wrong
