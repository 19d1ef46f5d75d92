"""Named points where a test makes a process die like a `kill -9` (`AML_FAILPOINT`), to reproduce the worst
moment of a crash on purpose rather than hope a kill lands there."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("aml_app.failpoints")

#: Every point a test can name (`tables/watermarks.py` reads `refresh-hang` itself); settings refuse
#: another name, which would do nothing where a test meant a crash.
NAMES = ("after-store-write", "enrichment-before-commit", "refresh-hang")


def failpoint(name: str) -> None:
    """Exit at once with 137 (what a shell reports for a kill -9) when AML_FAILPOINT names this point."""
    if os.environ.get("AML_FAILPOINT") == name:
        log.warning("failpoint %s: exiting now", name)
        os._exit(137)
