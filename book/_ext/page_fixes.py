"""Sphinx extension: each script once per page.

sphinx-thebe registers its configuration script each time Sphinx reads sources, so an incremental or
multi-pass build puts ``const THEBE_JS_URL = ...`` on a page twice, and the browser reports a SyntaxError
on every page.  This drops repeated scripts (same file, or same inline body and attributes) from a page's
context before it is written.
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


def setup(app):
    # first: a theme's handler that returns a template name ends the event for the handlers after it
    app.connect("html-page-context", drop_repeated_scripts, priority=1)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
