"""The built book as a reader sees it: every page of the smoke build opened in headless Chromium at 1280 px.

Runs after the book is built (`.ci/run` sets SPHEREML_BROWSER=1 and runs this file once `make book-smoke` has
finished); skipped otherwise.  Per page: MathJax (shipped with the book, so no network is needed) has typeset
every formula and no raw TeX is left; nothing is wider than the page or overflows its box (code, outputs,
tables, equations); every image has loaded; every internal link points at a file that exists and every
anchor at an id on that page.  A screenshot of each page goes to _build/screenshots/.
"""

import os
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

REPO = Path(__file__).resolve().parents[1]
SITE = REPO / "_build" / "smoke" / "_build" / "html"
CHROMIUM, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(os.environ.get("SPHEREML_BROWSER") != "1", reason="set SPHEREML_BROWSER=1 after the book build"),
]

PAGE_REPORT = """
const done = arguments[arguments.length - 1];
const report = () => {
  const art = document.querySelector('.bd-article') || document.body || document.documentElement;
  const raw = (art.innerText.match(/\\\\\\(|\\\\\\[|\\$\\$|\\\\begin\\{/g) || []).length;
  const boxes = art.querySelectorAll('pre, table, div.math, mjx-container[display="true"], .cell_output');
  const wide = [...boxes].filter(e => e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1)
                         .map(e => e.tagName + ' ' + e.scrollWidth + '>' + e.clientWidth);
  const broken = [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src);
  done({page_scroll: document.documentElement.scrollWidth > document.documentElement.clientWidth,
        raw_tex: raw, wide: wide, broken_images: broken,
        formulas: art.querySelectorAll('mjx-container').length, has_math: !!art.querySelector('.math')});
};
if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
  MathJax.startup.promise.then(report, report);
} else { report(); }
"""


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])


def _parse(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _pages() -> list[Path]:
    return sorted(list(SITE.glob("notebooks/*.html")) + list(SITE.glob("book/*.html")) + [SITE / "index.html"])


@pytest.fixture(scope="module")
def driver():
    if not (SITE / "index.html").is_file():
        pytest.fail("no smoke build: run `make book-smoke` first")
    if not (CHROMIUM.is_file() and DRIVER.is_file()):
        pytest.fail("needs Debian's chromium and chromium-driver (`.ci/run` installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1280,900",
                # the network off even on a machine that has one: every host name fails to resolve
                "--host-resolver-rules=MAP * ~NOTFOUND",
                f"--user-data-dir={REPO / '_build' / 'chromium-profile'}"):
        options.add_argument(arg)
    options.binary_location = str(CHROMIUM)
    browser = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
    browser.set_script_timeout(60)
    yield browser
    browser.quit()


def test_every_page_renders_within_the_column(driver):
    shots = REPO / "_build" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    problems, formulas = [], 0
    pages = _pages()
    assert len(pages) >= 12, f"only {len(pages)} pages built"
    for page in pages:
        if 'http-equiv="refresh"' in page.read_text(encoding="utf-8").lower():
            continue  # a redirect (index.html -> the preface) has no content; the page it names is checked
        driver.get(page.as_uri())
        report = driver.execute_async_script(PAGE_REPORT)
        driver.save_screenshot(str(shots / f"{page.stem}.png"))
        name = page.relative_to(SITE).as_posix()
        formulas += report["formulas"]
        if report["has_math"] and report["formulas"] == 0:
            problems.append(f"{name}: MathJax typeset nothing")
        for key in ("raw_tex",):
            if report[key]:
                problems.append(f"{name}: {report[key]} raw TeX fragments")
        if report["page_scroll"]:
            problems.append(f"{name}: the page scrolls sideways at 1280 px")
        problems += [f"{name}: overflowing {w}" for w in report["wide"]]
        problems += [f"{name}: image not loaded {src}" for src in report["broken_images"]]
    print(f"{len(pages)} pages checked, {formulas} formulas typeset")
    assert not problems, "\n".join(problems)


def test_every_internal_link_and_anchor_resolves():
    if not (SITE / "index.html").is_file():
        pytest.fail("no smoke build: run `make book-smoke` first")
    ids: dict[Path, set] = {}
    problems, checked = [], 0
    for page in _pages():
        for href in _parse(page).hrefs:
            parts = urlsplit(href)
            if parts.scheme or href.startswith("mailto:") or not (parts.path or parts.fragment):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            checked += 1
            if not target.is_file():
                problems.append(f"{page.relative_to(SITE)}: {href} (no file)")
                continue
            if parts.fragment and target.suffix == ".html":
                if target not in ids:
                    ids[target] = _parse(target).ids
                if unquote(parts.fragment) not in ids[target]:
                    problems.append(f"{page.relative_to(SITE)}: {href} (no anchor)")
    print(f"{checked} internal links checked")
    assert checked > 100 and not problems, "\n".join(problems[:40])


def test_citations_resolve_to_the_bibliography():
    bibliography = (SITE / "book" / "bibliography.html")
    assert bibliography.is_file()
    entries = _parse(bibliography).ids
    cited = set()
    for page in _pages():
        cited |= {m for m in re.findall(r'href="[^"]*bibliography\.html#([^"]+)"', page.read_text(encoding="utf-8"))}
    assert cited, "no citation links found"
    assert cited <= entries, f"citations without an entry: {sorted(cited - entries)}"
