"""The documentation (issue 42): the README is a landing page under 200 lines that reaches every page of the site in
one click, and `docs/` builds as a MkDocs site with --strict: no broken link or anchor, no page missing from the nav
and none outside it."""

import os
import re
import subprocess
import sys

import pytest
import yaml
from markdown.extensions.toc import slugify

from tests.helpers import BASE_DIR

DOCS = BASE_DIR / "docs"
README = BASE_DIR / "README.md"


class _ConfigLoader(yaml.SafeLoader):
    """mkdocs.yml's own tags (`!relative`, `!ENV`) read as plain values: only the nav is wanted here."""


_ConfigLoader.add_multi_constructor("!", lambda loader, suffix, node: loader.construct_scalar(node))


def _nav_pages() -> list[str]:
    """Every page the nav of mkdocs.yml lists, relative to docs/."""
    config = yaml.load((BASE_DIR / "mkdocs.yml").read_text(), Loader=_ConfigLoader)
    assert config["docs_dir"] == "docs"
    pages: list[str] = []

    def walk(entry) -> None:
        if isinstance(entry, str):
            pages.append(entry)
        elif isinstance(entry, list):
            for item in entry:
                walk(item)
        elif isinstance(entry, dict):
            for value in entry.values():
                walk(value)

    walk(config["nav"])
    return pages


def _anchors(page) -> set[str]:
    """The ids the toc extension gives a Markdown page's headings (outside code blocks)."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6} (.+)", line)):
            anchors.add(slugify(heading.group(1).strip(), "-"))
    return anchors


def test_the_site_builds_with_no_warning(tmp_path):
    """`mkdocs build --strict` fails on any warning: a broken link or anchor, a page not in the nav, a nav entry with
    no page, a README section the site includes that is gone."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    # The getting-started page includes the README's suite time and walk-through rather than a copy of them.
    page = (site / "getting-started" / "index.html").read_text()
    assert "The suite has" in page and "var/demo.json" in page


def test_the_nav_lists_every_page_and_only_pages_that_exist():
    pages = _nav_pages()
    assert len(pages) == len(set(pages)), f"listed twice: {sorted(p for p in pages if pages.count(p) > 1)}"
    missing = [page for page in pages if not (DOCS / page).is_file()]
    assert not missing, f"in mkdocs.yml's nav but not in docs/: {missing}"
    on_disk = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    unlisted = sorted(on_disk - set(pages))
    assert not unlisted, f"in docs/ but not in mkdocs.yml's nav: {unlisted}"


def test_the_readme_is_a_landing_page_one_click_from_every_page():
    text = README.read_text()
    lines = text.count("\n") + (not text.endswith("\n"))
    assert lines < 200, f"README.md has {lines} lines: move detail into docs/"
    links = re.findall(r"\]\((docs/[^)\s]+)\)", text)
    for link in links:
        path, _, anchor = link.partition("#")
        target = BASE_DIR / path
        assert target.is_file(), f"README.md links to {link}, which does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target), f"README.md links to {link}: {path} has no heading #{anchor}"
    linked = {link.partition("#")[0].removeprefix("docs/") for link in links}
    unreachable = [page for page in _nav_pages() if page not in linked]
    assert not unreachable, f"pages of the site the README does not link to: {unreachable}"


@pytest.mark.parametrize("section", ["suite-time", "try-it"])
def test_the_readme_keeps_what_the_site_includes_from_it(section):
    """docs/getting-started.md includes these README sections; each is marked once, start before end."""
    text = README.read_text()
    start, end = f"<!-- --8<-- [start:{section}] -->", f"<!-- --8<-- [end:{section}] -->"
    assert text.count(start) == 1 and text.count(end) == 1, f"README.md must mark the section {section} once"
    assert text.index(start) < text.index(end)
    assert f'--8<-- "README.md:{section}"' in (DOCS / "getting-started.md").read_text()
