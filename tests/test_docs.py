"""The documentation site builds with warnings as errors, and its generated pages say what the code says."""

from __future__ import annotations

import argparse
import html
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 60
# The widest code line a page shows without a scrollbar (the theme's content column).
CODE_COLUMNS = 88
HEADING = re.compile(r'<h\d id="(fuelline\.[\w.]+)" class="doc doc-heading"')
ROW = re.compile(r'<tr class="doc-section-item">(.*?)</tr>', re.S)
CELL = re.compile(r"<td>(.*?)</td>", re.S)
PRE = re.compile(r"<pre[^>]*>(.*?)</pre>", re.S)


def _hooks():
    spec = importlib.util.spec_from_file_location("fuelline_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def _plain(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", fragment)).split())


def _documented(path: str) -> object:
    """The object at a dotted path the API page names (a module, or something in one)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def _parameter_rows(page: str) -> list[tuple[str, list[str]]]:
    """(the documented object's path, [name, type, description, default]) per row of every
    parameters table (the only tables of four columns) on an API page."""
    marks = list(HEADING.finditer(page))
    rows = []
    for mark, after in zip(marks, [*marks[1:], None]):
        section = page[mark.end():after.start() if after else len(page)]
        for row in ROW.findall(section):
            cells = [_plain(cell) for cell in CELL.findall(row)]
            if len(cells) == 4:
                rows.append((mark.group(1), cells))
    return rows


def test_the_site_builds_strict_with_every_page_of_the_nav(site: Path) -> None:
    for page in ("index", "concepts", "glossary", "serving", "training-loop", "trainer", "operations", "sizing",
                 "deploy", "security", "guarantees", "benchmarks", "cli", "api"):
        path = site / "index.html" if page == "index" else site / page / "index.html"
        assert path.is_file(), page


def test_the_cli_page_holds_every_subcommand_and_option_of_the_parsers(site: Path) -> None:
    from fuelline.server.cli.main import build_parser
    from fuelline.trainer.cli import build_parser as build_trainer_parser

    text = _text(site / "cli" / "index.html")
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sub.choices
    for name, parser in sub.choices.items():
        assert f"fuelline {name}" in text, name
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:
                continue  # (not for people: what a supervisor passes to the processes it starts)
            for option in action.option_strings:
                assert option in text, f"fuelline {name} {option}"
    for action in build_trainer_parser()._actions:
        for option in action.option_strings:
            assert option in text, f"trainer {option}"


def test_the_api_page_documents_the_public_api_from_its_docstrings(site: Path) -> None:
    text = _text(site / "api" / "index.html")
    for name in ("ServerDataStream", "get_epoch_iterator", "state_dict", "ServerDataset", "start_server",
                 "BatchSource", "SourceOptions", "FingerprintMismatch", "ServerUnavailable", "OneBitState",
                 "OneBitAdam", "OneBitSGD"):
        assert name in text, name
    from fuelline.client.stream import ServerDataStream

    first_line = ServerDataStream.__doc__.strip().splitlines()[0].replace("`", "")
    assert " ".join(first_line.split()) in " ".join(text.split())


def test_the_start_page_shows_the_readme_install_in_its_current_words(site: Path) -> None:
    section = _hooks().readme_section("Install")
    first = next(line for line in section.splitlines() if line and not line.startswith(("```", "!", "|")))
    words = re.sub(r"[`*]|\[([^]]*)\]\([^)]*\)", r"\1", first).split()
    assert " ".join(words[:6]) in " ".join(_text(site / "index.html").split())


def test_every_page_but_the_start_holds_its_own_text_and_the_readme_is_a_first_screen_and_links() -> None:
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        markers = re.findall(r"<!-- readme: (.+?) -->", text)
        assert markers == (["Install"] if page.name == "index.md" else []), page.name
        if page.name not in ("cli.md", "api.md", "deploy.md"):  # (generated from the code, or included)
            prose = [line for line in text.splitlines() if line and not line.startswith(("#", "<!--", ":::"))]
            assert len(prose) >= 5, f"{page.name} is a stub"
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 120, "the README grew pages of its own: they belong in docs/"
    for page in ("trainer.md", "training-loop.md", "benchmarks.md", "operations.md", "cli.md"):
        assert f"](docs/{page})" in readme, page


def test_the_benchmark_plots_the_pages_show_are_on_the_site(site: Path) -> None:
    shown = re.findall(r"!\[[^]]*\]\((benchmarks/results/[\w.-]+\.png)\)", (ROOT / "docs" / "benchmarks.md").read_text())
    assert shown, "the benchmarks page shows no plot"
    for uri in shown:
        assert (site / uri).is_file(), uri


def test_a_missing_readme_section_is_an_error_naming_it(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Kept\n\nwords\n")
    hooks = _hooks()
    assert hooks.readme_section("Kept", readme) == "words\n"
    readme.write_text("## Kept\n\n[an example](examples/dataloader.py), [a page](docs/api.md), [up](#kept)\n")
    assert hooks.readme_section("Kept", readme) == "an example (`examples/dataloader.py`), [a page](api.md), [up](#kept)\n"
    with pytest.raises(ValueError, match="## Gone"):
        hooks.readme_section("Gone", readme)


def test_the_deploy_page_shows_each_deploy_readme(site: Path) -> None:
    text = " ".join(_text(site / "deploy" / "index.html").split())
    for folder in ("systemd", "container", "kubernetes"):
        title = (ROOT / "deploy" / folder / "README.md").read_text().splitlines()[0].lstrip("# ")
        assert title in text, folder


def test_an_include_demotes_headings_outside_code_and_names_a_missing_file(tmp_path: Path) -> None:
    hooks = _hooks()
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Part\n\n```\n# a shell comment\n```\n")
    assert hooks.included(str(page)) == "## Title\n\n### Part\n\n```\n# a shell comment\n```\n"
    with pytest.raises(ValueError, match="gone.md"):
        hooks.included(str(tmp_path / "gone.md"))


def test_the_install_says_how_to_get_torch_s_cpu_build(site: Path) -> None:
    line = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert line in (ROOT / "README.md").read_text()
    assert line in _text(site / "index.html")


def test_no_parameter_with_a_default_reads_required_on_the_api_page(site: Path) -> None:
    rows = _parameter_rows((site / "api" / "index.html").read_text())
    assert len(rows) > 40, "no parameter tables found: has the page's markup changed?"
    for path, (names, _, _, default) in rows:
        if default != "required":
            continue
        parameters = inspect.signature(_documented(path)).parameters
        for name in names.split(", "):
            parameter = parameters.get(name.lstrip("*"))
            assert parameter is not None, f"{path}: {names!r} reads required and is not one parameter"
            assert parameter.default is inspect.Parameter.empty, f"{path}: {name} has a default and reads required"
            assert parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD), path
    shown = {names: default for path, (names, _, _, default) in rows
             if path == "fuelline.client.stream.ServerDataStream"}
    assert (shown["host"], shown["port"], shown["hwm"]) == ("'localhost'", "5557", "10")
    assert shown["rank"] == shown["world_size"] == "None"  # (then torchrun's RANK / WORLD_SIZE)


def test_no_page_shows_an_escaped_pipe_and_the_cli_page_shows_choices(site: Path) -> None:
    escaped = [str(page.relative_to(site)) for page in site.rglob("*.html") if "\\|" in page.read_text()]
    assert not escaped, f"a literal \\| on {escaped}"
    assert "--normalize zscore|none" in _text(site / "cli" / "index.html")


@pytest.mark.parametrize("page", ["index.html", "training-loop/index.html"])
def test_code_lines_of_the_start_and_training_loop_pages_fit_without_a_scrollbar(site: Path, page: str) -> None:
    blocks = [html.unescape(re.sub(r"<[^>]+>", "", block)) for block in PRE.findall((site / page).read_text())]
    assert blocks, page
    long = [line for block in blocks for line in block.splitlines() if len(line) > CODE_COLUMNS]
    assert not long, f"{page}: code lines over {CODE_COLUMNS} characters: {long}"
