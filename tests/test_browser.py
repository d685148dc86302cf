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
# the smoke build by default; $SPHEREML_SITE checks another (the cpu book: _build/html)
SITE = Path(os.environ.get("SPHEREML_SITE", REPO / "_build" / "smoke" / "_build" / "html")).resolve()
CHROMIUM, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(os.environ.get("SPHEREML_BROWSER") != "1", reason="set SPHEREML_BROWSER=1 after the book build"),
]

PAGE_REPORT = """
const done = arguments[arguments.length - 1];
const report = () => {
  const art = document.querySelector('.bd-article') || document.body || document.documentElement;
  const right = art.getBoundingClientRect().right + 1;
  const raw = (art.innerText.match(/\\\\\\(|\\\\\\[|\\$\\$|\\\\begin\\{/g) || []).length;
  // boxes that must not overflow themselves; code, outputs and display maths scroll inside their own box
  const boxes = art.querySelectorAll('table, div.math, .cell_output:not(:has(pre)), .claim-card');
  const scrolls = e => ['auto', 'scroll'].includes(getComputedStyle(e).overflowX);
  const wide = [...boxes].filter(e => e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1 && !scrolls(e))
                         .map(e => e.tagName + '.' + e.className + ' ' + e.scrollWidth + '>' + e.clientWidth);
  // anything that reaches past the column and is not inside a box that scrolls or clips it
  // (a .wide-table reaches into the page's empty right margin by design: _static/sphereml.css)
  const clipped = e => { if (e.closest('.wide-table')) return true;
    for (let a = e.parentElement; a && a !== art; a = a.parentElement) {
      if (['auto', 'scroll', 'hidden'].includes(getComputedStyle(a).overflowX)) return true; } return false; };
  const outside = [...art.querySelectorAll('table, pre, div.math, mjx-container, figure, img, .claim-card, p')]
    .filter(e => e.getBoundingClientRect().right > right && !clipped(e))
    .map(e => e.tagName + ' ' + Math.round(e.getBoundingClientRect().right) + '>' + Math.round(right));
  // Markdown that reached the page as text: a pipe table's rule line outside any code
  const rawTables = [...art.querySelectorAll('p, li, td, .cell_output pre')]
    .filter(e => /\\|\\s*:?-{3,}:?\\s*\\|/.test(e.textContent)).map(e => e.textContent.slice(0, 60));
  // Python dict reprs in outputs ({'key': value}): records and key-value dumps instead of prose or tables
  const dicts = [...art.querySelectorAll('.cell_output')]
    .filter(e => /\\{'[^'\\n]{1,60}': /.test(e.textContent)).map(e => e.textContent.trim().slice(0, 60));
  // every figure of a chapter carries its number ("Fig. 3.1"); no image outside a numbered figure
  const captions = [...art.querySelectorAll('figure')]
    .filter(f => !/^Fig\\. \\d+\\.\\d+/.test((f.querySelector('.caption-number') || {}).textContent || ''))
    .map(f => (f.textContent || '').trim().slice(0, 60));
  const loose = [...art.querySelectorAll('.cell_output img')].filter(i => !i.closest('figure')).length;
  // an equation number must be seen at once: inside the column and beside its equation's visible box
  const artBox = art.getBoundingClientRect();
  const numbers = [...art.querySelectorAll('div.math .eqno')].filter(n => {
    const r = n.getBoundingClientRect(), m = n.closest('div.math').querySelector('mjx-container');
    const box = m ? m.getBoundingClientRect() : {left: 0, right: 0};
    return r.width === 0 || r.right > artBox.right + 1 || r.left < artBox.left - 1
      || (m && r.left < box.right - 1 && r.right > box.left + 1); }).map(n => n.textContent.trim().slice(0, 12));
  const broken = [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src);
  done({page_scroll: document.documentElement.scrollWidth > document.documentElement.clientWidth,
        raw_tex: raw, wide: wide, outside: outside, raw_tables: rawTables, dicts: dicts,
        captions: captions, loose_images: loose, broken_images: broken, hidden_numbers: numbers,
        header_bar: (h => h ? h.getBoundingClientRect().height : 0)(document.querySelector('header.bd-header')),
        launch_buttons: !!document.querySelector('.dropdown-launch-buttons'),
        formulas: art.querySelectorAll('mjx-container').length, has_math: !!art.querySelector('.math')});
};
if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
  MathJax.startup.promise.then(report, report);
} else { report(); }
"""
WIDTHS = {"desktop": (1280, 900), "phone": (390, 844)}  # CSS pixels; the phone emulated (Chrome's windows are wider)


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
def driver(tmp_path_factory):
    if not (SITE / "index.html").is_file():
        pytest.fail("no smoke build: run `make book-smoke` first")
    if not (CHROMIUM.is_file() and DRIVER.is_file()):
        pytest.fail("needs Debian's chromium and chromium-driver (`.ci/run` installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tmp_path_factory.mktemp("chromium-profile")  # a first visit every run, as a new reader's
    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1280,900",
                # the network off even on a machine that has one: every host name fails to resolve
                "--host-resolver-rules=MAP * ~NOTFOUND",
                f"--user-data-dir={profile}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for errors
    options.binary_location = str(CHROMIUM)
    browser = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
    browser.set_script_timeout(60)
    yield browser
    browser.quit()


def _emulate(driver, width: str) -> None:
    """A desktop window, or a phone's viewport (390 CSS pixels, mobile) through the DevTools protocol."""
    w, h = WIDTHS[width]
    if width == "phone":
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": w, "height": h, "deviceScaleFactor": 1, "mobile": True})
    else:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        driver.set_window_size(w, h)


def _page_problems(name: str, report: dict, width: str) -> list[str]:
    problems = []
    if report["has_math"] and report["formulas"] == 0:
        problems.append(f"{name}: MathJax typeset nothing")
    if report["raw_tex"]:
        problems.append(f"{name}: {report['raw_tex']} raw TeX fragments")
    if report["page_scroll"]:
        problems.append(f"{name}: the page scrolls sideways at {width} width")
    problems += [f"{name} ({width}): overflowing {w}" for w in report["wide"]]
    problems += [f"{name} ({width}): wider than the column {w}" for w in report["outside"]]
    problems += [f"{name}: a Markdown table shown as text: {t!r}" for t in report["raw_tables"]]
    problems += [f"{name}: a Python dict in an output: {t!r}" for t in report["dicts"]]
    if name.startswith("notebooks/"):  # a chapter's figures are numbered by the book; reference pages caption their own
        problems += [f"{name}: a figure without its chapter number: {t!r}" for t in report["captions"]]
        if report["loose_images"]:
            problems.append(f"{name}: {report['loose_images']} output images outside a numbered figure")
    problems += [f"{name}: image not loaded {src}" for src in report["broken_images"]]
    problems += [f"{name} ({width}): equation number hidden or over its equation {n}" for n in report["hidden_numbers"]]
    if report["launch_buttons"] and not name.startswith("notebooks/"):
        problems.append(f"{name}: Binder / Colab buttons on a page that is not a chapter")
    if report["header_bar"]:
        problems.append(f"{name}: the theme's empty header bar is shown ({report['header_bar']:.0f} px)")
    return problems


def test_every_page_renders_within_the_column(driver):
    """At a desktop's and a phone's width: formulas typeset, nothing wider than the column, equation numbers in
    view beside their equations, no Markdown as text, no dict dumps, numbered figures, no errors on the console."""
    shots = REPO / "_build" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    problems, formulas = [], 0
    pages = _pages()
    assert len(pages) >= 12, f"only {len(pages)} pages built"
    for width, size in WIDTHS.items():
        _emulate(driver, width)
        for page in pages:
            if 'http-equiv="refresh"' in page.read_text(encoding="utf-8").lower():
                continue  # a redirect (index.html -> the preface) has no content; the page it names is checked
            driver.get(page.as_uri())
            report = driver.execute_async_script(PAGE_REPORT)
            driver.save_screenshot(str(shots / f"{page.stem}-{width}.png"))
            name = page.relative_to(SITE).as_posix()
            formulas += report["formulas"]
            problems += [p for p in _page_problems(name, report, width) if p not in problems]
            problems += [f"{name}: console error {entry['message'][:160]}" for entry in driver.get_log("browser")
                         if entry["level"] == "SEVERE"]
    print(f"{len(pages)} pages checked at {len(WIDTHS)} widths, {formulas} formulas typeset")
    assert not problems, "\n".join(problems)


def test_the_page_checks_catch_what_they_look_for(driver, tmp_path):
    """The checks above on a page made to fail each of them: they are not vacuous."""
    page = tmp_path / "bad.html"
    page.write_text("""<html><body><article class="bd-article" style="width:300px">
<p>| a | b |<br>|---|---|</p>
<div class="cell_output"><pre>{'id': 'x', 'paper': {'drop': 0.15}}</pre></div>
<figure><img src="data:image/gif;base64,R0lGODlhAQABAAAAACw="><figcaption>Figure 1. a caption</figcaption></figure>
<div class="cell_output"><img src="data:image/gif;base64,R0lGODlhAQABAAAAACw="></div>
<p style="width:600px">a paragraph wider than the column</p>
<div class="math"><span class="eqno" style="position:relative; left:400px">(1.1)</span></div>
<script>console.error("boom")</script>
</article></body></html>""")
    _emulate(driver, "desktop")
    driver.get(page.as_uri())
    problems = _page_problems("notebooks/bad.html", driver.execute_async_script(PAGE_REPORT), "desktop")
    console = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert console, "a console error went unseen"
    for what in ("a Markdown table shown as text", "a Python dict in an output", "without its chapter number",
                 "outside a numbered figure", "wider than the column", "equation number hidden"):
        assert any(what in p for p in problems), f"{what!r} not caught: {problems}"


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


def test_the_download_button_gives_each_chapter_executed():
    """The page's download button links _sources/notebooks/NAME.ipynb: the notebook as executed for the page,
    figures visible (no glue-only outputs); the archive on the reproducing page holds every chapter."""
    import json
    import zipfile

    if not (SITE / "index.html").is_file():
        pytest.fail("no smoke build: run `make book-smoke` first")
    chapters = sorted((SITE / "_sources" / "notebooks").glob("*.ipynb"))
    assert len(chapters) >= 9
    for path in chapters:
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        outputs = [o for c in cells for o in c.get("outputs", [])]
        assert outputs, f"{path.name}: no outputs"
        hidden = [k for o in outputs for k in o.get("data", {}) if k.startswith("application/papermill.record/")]
        assert not hidden, f"{path.name}: glued outputs Jupyter would not show: {hidden[:3]}"
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name}: no figure"
    with zipfile.ZipFile(SITE / "_downloads" / "sphereml-chapters-executed.zip") as archive:
        assert sorted(archive.namelist()) == [p.name for p in chapters]
