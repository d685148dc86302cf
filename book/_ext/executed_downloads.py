"""Sphinx extension: the page's download button gives the chapter as executed for the book, outputs included.

sphinx-book-theme's download button links ``_sources/<page>.ipynb``, the notebook as committed (no outputs).
After an HTML build this replaces each of those files with the executed notebook from myst-nb's execution
cache, the notebook the page was rendered from, and makes figures that the page places through myst-nb's
``glue`` visible again as ordinary outputs (their MIME types carry glue's prefix, which Jupyter does not
show).  It also writes every chapter, executed, into ``_downloads/sphereml-chapters-executed.zip``.
"""

import zipfile
from pathlib import Path

GLUE_PREFIX = "application/papermill.record/"
ZIP_NAME = "sphereml-chapters-executed.zip"


def _unglue(notebook) -> None:
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            data = output.get("data")
            if data and any(key.startswith(GLUE_PREFIX) for key in data):
                output["data"] = {key.removeprefix(GLUE_PREFIX): value for key, value in data.items()}
                output.get("metadata", {}).pop("scrapbook", None)


def write_executed_notebooks(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    import nbformat
    from jupyter_cache import get_cache

    cache_dir = app.config.nb_execution_cache_path or Path(app.outdir).parent / ".jupyter_cache"
    if not Path(cache_dir).is_dir():
        return
    cache = get_cache(cache_dir)
    written = []
    for docname in sorted(app.env.found_docs):
        source = Path(app.srcdir) / f"{docname}.ipynb"
        target = Path(app.outdir) / "_sources" / f"{docname}.ipynb"
        if not (docname.startswith("notebooks/") and source.is_file() and target.is_file()):
            continue
        try:
            _, executed = cache.merge_match_into_notebook(nbformat.read(source, as_version=4))
        except KeyError:  # not executed through the cache in this build: keep the committed notebook
            continue
        _unglue(executed)
        nbformat.write(executed, target)
        written.append(target)
    if written:
        archive = Path(app.outdir) / "_downloads" / ZIP_NAME
        archive.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
            for path in written:
                zf.write(path, path.name)


def setup(app):
    app.connect("build-finished", write_executed_notebooks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
