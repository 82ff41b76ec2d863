"""Build-time steps of the documentation site (mkdocs ``hooks:``).

- ``<!-- cli-reference -->`` in a page becomes the command-line reference, rendered from the argument
  parsers by ``docs/cli_reference.py``, so the site cannot fall behind them.
- ``<!-- readme: TITLE -->`` becomes the body of the README's ``## TITLE`` section: the install
  steps, which the README's first screen keeps, have one source. Every other page holds its own text.
- ``<!-- include: PATH -->`` becomes the file at PATH (from the repository root), its headings one
  level down: the deploy folders' READMEs, which sit beside the files they describe.
- The API reference's loader (griffe) finds modules by their files, but ``fuelline`` exists only as
  a mapping in ``setup.cfg`` (``fuelline.server = server`` …). A tree of links under
  ``build/api-src/fuelline`` gives it the package as Python imports it.
- The images the pages show from outside ``docs/`` (benchmark plots, ``benchmarks/results/*.png``) are
  added to the site from where they live.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
API_SRC = ROOT / "build" / "api-src"
# The folders setup.cfg maps to fuelline.<name>; their own sub-packages follow on disk.
PACKAGES = ("protocol", "server", "client", "trainer")
CLI_MARKER = "<!-- cli-reference -->"
README_MARKER = re.compile(r"<!-- readme: (.+?) -->")
INCLUDE_MARKER = re.compile(r"<!-- include: (\S+?) -->")
IMAGE_LINK = re.compile(r"!\[[^]]*\]\(([\w./-]+\.(?:png|svg|jpg))\)")
# A link (not an image) to a repository file outside docs/: the site holds no copy of it.
REPO_LINK = re.compile(r"(?<!!)\[([^]]+)\]\((?!https?:|#|docs/|mailto:)([\w./-]+)\)")


def _cli_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuelline_docs_cli_reference", ROOT / "docs" / "cli_reference.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {ROOT / 'docs' / 'cli_reference.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_section(title: str, readme: Path = ROOT / "README.md") -> str:
    """The body of README's ``## title`` section, its links rewritten for the site.

    Raises:
        ValueError: the README has no such section (a renamed heading must not leave a page empty).
    """
    text = readme.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    if match is None:
        raise ValueError(f"{readme}: no section '## {title}' (named by a <!-- readme: {title} --> marker)")
    body = match.group(1).strip() + "\n"
    body = REPO_LINK.sub(lambda m: f"{m.group(1)} (`{m.group(2)}`)", body)
    body = body.replace("](docs/", "](")
    return body.replace("](#command-line-reference)", "](cli.md)")


def included(path: str) -> str:
    """The Markdown file at ``path`` (relative to the repository root), its headings one level down.

    Raises:
        ValueError: no such file.
    """
    source = ROOT / path
    if not source.is_file():
        raise ValueError(f"{source}: no such file (named by a <!-- include: {path} --> marker)")
    lines, fenced = [], False
    for line in source.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        lines.append("#" + line if line.startswith("#") and not fenced else line)
    return "\n".join(lines) + "\n"


def on_startup(command: str, dirty: bool) -> None:
    # Before any plugin's on_config: mkdocstrings reads its handler's paths there.
    package = API_SRC / "fuelline"
    package.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        link = package / name
        try:
            link.symlink_to(ROOT / name, target_is_directory=True)
        except FileExistsError:  # made by an earlier (or a concurrent) build
            pass


def on_files(files: Files, config: Any) -> Files:
    pages = [(ROOT / "README.md").read_text(), *(page.read_text() for page in sorted((ROOT / "docs").glob("*.md")))]
    for uri in sorted({uri for text in pages for uri in IMAGE_LINK.findall(text) if not uri.startswith("docs/")}):
        if files.get_file_from_path(uri) is None and (ROOT / uri).is_file():
            files.append(File.generated(config, uri, abs_src_path=str(ROOT / uri)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, _cli_reference().render(site=True))
    markdown = INCLUDE_MARKER.sub(lambda m: included(m.group(1)), markdown)
    return README_MARKER.sub(lambda m: readme_section(m.group(1)), markdown)
