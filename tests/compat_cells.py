"""Test cases parametrized from the compatibility matrix (:mod:`toma.compat`).

Each case of :func:`rows` is a row of tests/tiny_models.py's table whose family's cell has the
status asked for, marked ``compat(feature, family, status)``. ``python -m toma.tools.docs``
collects these marks and fails on a ``✔`` of ``docs/compatibility.md`` that no case covers; a
case that backs a ``✔`` must not skip (:func:`skip_or_fail`).
"""

from __future__ import annotations

import functools

import pytest

from tests.tiny_models import FAMILIES
from toma import compat


@functools.cache
def _matrix() -> dict[str, dict[str, compat.Cell]]:
    return compat.matrix()


def cell(family: str, feature: str) -> compat.Cell:
    """The matrix's cell of ``family`` and ``feature``."""
    return _matrix()[family][feature]


def rows(feature: str, status: str = compat.YES, *extra: object) -> list:
    """``pytest.param(row, *extra)`` for every row of the tiny table whose family has
    ``status`` for ``feature``, marked ``compat(feature, family, status)``."""
    out = []
    for name, row in FAMILIES.items():
        if cell(row.adapter, feature).status == status:
            ident = "-".join([name, *map(str, extra)])
            out.append(pytest.param(name, *extra, id=ident, marks=pytest.mark.compat(feature, row.adapter, status)))
    return out


# the compat marks of the cases a test session collected, by file (tests/conftest.py fills it)
COMPAT_MARKS = pytest.StashKey[dict]()


def families(feature: str, status: str = compat.YES) -> list:
    """``pytest.param(family)`` for every family whose cell of ``feature`` has ``status``,
    marked ``compat(feature, family, status)`` (for tests that take families, not rows)."""
    return [
        pytest.param(family, id=family, marks=pytest.mark.compat(feature, family, status))
        for family in compat.families_with(feature, status)
    ]


def cases(*features: str) -> list:
    """``pytest.param(row)`` for every row of the tiny table, marked with its family's cell of
    each of ``features`` (one test case checking several cells, whatever their status)."""
    out = []
    for name, row in FAMILIES.items():
        marks = [pytest.mark.compat(f, row.adapter, cell(row.adapter, f).status) for f in features]
        out.append(pytest.param(name, id=name, marks=marks))
    return out


def skip_or_fail(request: pytest.FixtureRequest, reason: str) -> None:
    """Skip with ``reason``, unless the case backs a ``✔`` cell: then the matrix is wrong, and
    the case fails."""
    mark = request.node.get_closest_marker("compat")
    if mark is not None and mark.args[2] == compat.YES:
        feature, family = mark.args[:2]
        pytest.fail(f"{reason}; but toma/compat.py says ✔ for {family} / {feature}")
    pytest.skip(reason)
