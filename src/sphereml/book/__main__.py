"""``python -m sphereml.book``: the papermill runner's command line (:mod:`sphereml.book.runner`)."""

import sys

from .runner import main

sys.exit(main())
