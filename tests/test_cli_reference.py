"""The command-line reference is the parsers' own, so it cannot fall behind them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _load_generator():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


clidoc = _load_generator()


def test_the_reference_page_is_rendered_from_the_parsers_and_the_readme_links_to_it() -> None:
    page = (ROOT / "docs" / "cli.md").read_text()
    assert "<!-- cli-reference -->" in page  # (replaced by render(site=True) at build: tests/test_docs.py)
    assert "](docs/cli.md)" in README.read_text()


def test_every_option_of_serve_and_the_trainer_is_documented_with_its_meaning() -> None:
    reference = clidoc.render()
    for option in ("--workers", "--cache-dir", "--metrics-port", "--local-ipc", "--memory-cache", "--servers",
                   "--compression", "--log-format"):
        rows = [line for line in reference.splitlines() if line.startswith(f"| `{option}")]
        assert rows and all(not row.endswith("|  |") for row in rows), option


def test_a_stale_reference_is_reported(tmp_path: Path) -> None:
    stale = tmp_path / "README.md"
    stale.write_text(f"intro\n{clidoc.BEGIN}\n| `--old-option` | | gone |\n{clidoc.END}\nrest\n")
    assert clidoc.main(["--check", str(stale)]) == 1
    assert clidoc.main([str(stale)]) == 0 and clidoc.main(["--check", str(stale)]) == 0
    text = stale.read_text()
    assert text.startswith("intro\n") and text.endswith("\nrest\n") and "--old-option" not in text
    with pytest.raises(ValueError, match="markers"):
        clidoc.update("no markers here")
