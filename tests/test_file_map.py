"""docs/architecture.md names every source file, so a newcomer can find any
part from one page (and a new module cannot be added silently)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_architecture_page_lists_every_source_file() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for path in sorted(ROOT.glob("packages/*/src/*/**/*.py")):
        if path.name == "__init__.py" and path.parent.name != "paged_server":
            continue
        rel = path.relative_to(path.parents[len(path.relative_to(ROOT).parts) - 4]).as_posix()
        if f"`{rel}`" not in page:
            missing.append(rel)
    assert not missing, f"docs/architecture.md does not name: {missing}"
