"""A pytest plugin that writes the ``compat`` marks of the collected tests to a JSON file.

``python -m toma.tools.docs`` runs ``pytest --collect-only -p toma.tools.compat_collect`` on the
test files of :data:`toma.compat.FEATURES` with ``TOMA_COMPAT_MARKS`` naming the file: one
``[feature, family, status, test id]`` per marked case. Nothing runs; collecting takes seconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def marks_of(items) -> list[list]:  # noqa: ANN001  (pytest's Items)
    """``[feature, family, status, test id]`` of every ``compat`` mark of ``items``."""
    return [[*mark.args, item.nodeid] for item in items for mark in item.iter_markers("compat")]


def pytest_collection_finish(session) -> None:  # noqa: ANN001  (pytest's Session)
    """Write every collected case's ``compat`` marks to ``$TOMA_COMPAT_MARKS``."""
    out = os.environ.get("TOMA_COMPAT_MARKS")
    if not out:
        return
    Path(out).write_text(json.dumps(marks_of(session.items)), encoding="utf-8")
