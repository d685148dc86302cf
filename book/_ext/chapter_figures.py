"""Sphinx extension: number a chapter's figures "Fig. <chapter>.<n>" (Fig. 3.1, Fig. 3.2, ...).

The book's table of contents is not numbered (the chapters number their own sections), so Sphinx numbers
captioned figures with one counter across the whole book.  After Sphinx has assigned those numbers, this
extension renumbers the figures of each chapter page ``notebooks/NN_name`` from 1 under the chapter's
number ``NN`` (and those of any other page from 1), so captions and ``{numref}`` references read ``Fig. 3.1`` and never clash with the thesis's
own figure numbers, which the text always cites as "thesis Fig. ...".
"""

import re

_CHAPTER = re.compile(r"(?:^|/)notebooks/(\d+)_[^/]+$")


def number_by_chapter(app, env):
    """Renumber each page's figures from 1: ``(chapter, n)`` on a chapter page, ``(n,)`` elsewhere."""
    for docname, by_type in env.toc_fignumbers.items():
        match = _CHAPTER.search(docname)
        prefix = (int(match.group(1)),) if match else ()
        for numbers in by_type.values():
            for n, figure_id in enumerate(sorted(numbers, key=numbers.get), start=1):
                numbers[figure_id] = (*prefix, n)
    return []


def setup(app):
    # after Sphinx's own assignment (the toctree collector listens at the default priority, 500)
    app.connect("env-get-updated", number_by_chapter, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
