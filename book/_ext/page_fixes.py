"""Sphinx extension: pages that load without errors on the console.

* Each script once per page: sphinx-thebe registers its configuration script each time Sphinx reads
  sources, so a page gets ``const THEBE_JS_URL = ...`` twice and the browser reports a SyntaxError.  Repeated
  scripts (same file, or same inline body and attributes) are dropped from a page's context.
* A first visit: the theme reads the colour mode from the browser's storage, finds none, and logs "Got
  invalid theme mode" as an error before falling back to ``auto``.  A one-line script gives it ``auto``
  first.
"""


def _key(script) -> tuple:
    """File and attributes (an inline script's body is one); an inline script's file is None or ""."""
    attributes = getattr(script, "attributes", {}) or {}
    return getattr(script, "filename", str(script)) or "", tuple(sorted((k, str(v)) for k, v in attributes.items()))


def drop_repeated_scripts(app, pagename, templatename, context, doctree):
    seen, kept = set(), []
    for script in context.get("script_files", []):
        key = _key(script)
        if key not in seen:
            seen.add(key)
            kept.append(script)
    # in place: the list is the builder's, to which handlers after this one (MathJax's) still add
    context["script_files"][:] = kept


FIRST_VISIT_MODE = 'if (!document.documentElement.dataset.mode) { document.documentElement.dataset.mode = "auto"; }'


def setup(app):
    app.add_js_file(None, body=FIRST_VISIT_MODE, priority=100)
    # first: a theme's handler that returns a template name ends the event for the handlers after it
    app.connect("html-page-context", drop_repeated_scripts, priority=1)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
