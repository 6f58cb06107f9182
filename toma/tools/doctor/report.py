"""The doctor's results: one line per check as it finishes, the verdict, and the JSON report."""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

# statuses: "pass" and "fail" are checks; "fallback" a kernel that took the torch path
# (toma still works, slower); "skip" a check that cannot run here, "n/a" a feature a
# backend does not offer, "info" a measurement
STATUSES = ("pass", "fail", "fallback", "skip", "n/a", "info")
MARKS = {"pass": "ok", "fail": "FAIL", "fallback": "fallback", "skip": "skip", "n/a": "n/a", "info": "info"}


@dataclass
class Result:
    """One check: where it belongs, what it found, and its numbers."""

    section: str
    name: str
    status: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "section": self.section,
            "name": self.name,
            "status": self.status,
            "detail": self.detail,
            "seconds": round(self.seconds, 4),
            "data": self.data,
        }


class Outcome(Exception):
    """Raised inside a check to end it with a status other than pass (``skip``, ``fallback``...)."""

    def __init__(self, status: str, detail: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.data = status, detail, data or {}


class Report:
    """Collects results and prints each as it comes."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.results: list[Result] = []
        self.info: dict[str, Any] = {}
        self.notes: list[str] = []  # what the verdict line should mention besides failures
        self.section = ""

    def say(self, line: str = "") -> None:
        """Print a line now (progress)."""
        print(line, file=self.out, flush=True)

    def heading(self, section: str, title: str) -> None:
        """Start a section."""
        self.section = section
        self.say()
        self.say(f"[{section}] {title}")

    def add(self, result: Result, echo: bool = True) -> Result:
        """Record ``result`` and print it (unless ``echo`` is False: the caller sums such up)."""
        self.results.append(result)
        if not echo:
            return result
        took = f"  ({result.seconds:.1f} s)" if result.seconds >= 0.05 else ""
        self.say(f"  {MARKS[result.status]:<8} {result.name}: {result.detail}{took}")
        return result

    def check(self, name: str, fn: Callable[[], tuple[str, dict[str, Any]] | str]) -> Result:
        """Run ``fn`` as check ``name`` of the current section: it returns the pass detail (and
        data), raises :class:`Outcome` for another status, and any other exception fails the
        check with the error (the run goes on). Warnings it raises are kept with its result."""
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got = fn()
                detail, data = got if isinstance(got, tuple) else (got, {})
                status = "pass"
            except Outcome as outcome:
                status, detail, data = outcome.status, outcome.detail, outcome.data
            except KeyboardInterrupt:
                raise
            except Exception as err:  # a crash is a failed check, with what crashed
                status = "fail"
                detail = f"error: {type(err).__name__}: {first_line(str(err))}"
                data = {"traceback": traceback.format_exc(limit=6)}
        said = sorted({first_line(str(w.message)) for w in caught if not _noise(w)})
        if said:
            data = {**data, "warnings": said}
        return self.add(Result(self.section, name, status, detail, data, time.perf_counter() - start))

    def count(self, status: str) -> int:
        """How many results have ``status``."""
        return sum(r.status == status for r in self.results)

    def verdict(self) -> tuple[int, str]:
        """``(exit code, verdict line)``: 1 and the first failure when a check failed, else 0."""
        failed = [r for r in self.results if r.status == "fail"]
        if failed:
            first = failed[0]
            more = f" (and {len(failed) - 1} more failed check(s))" if len(failed) > 1 else ""
            return 1, f"toma doctor: FAILED — {first.section} / {first.name}: {first.detail}{more}"
        passed = self.count("pass")
        notes = "; ".join(dict.fromkeys(self.notes))
        return 0, f"toma doctor: OK — {passed} checks passed" + (f"; {notes}" if notes else "")

    def write_json(self, path: Any) -> None:
        """Write :meth:`as_dict` to ``path`` (JSON has no inf or NaN: those become null)."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(_plain(self.as_dict()), indent=2) + "\n")

    def as_dict(self) -> dict[str, Any]:
        """The full report."""
        code, line = self.verdict()
        counts = {s: self.count(s) for s in STATUSES}
        return {
            **self.info,
            "results": [r.as_dict() for r in self.results],
            "counts": counts,
            "verdict": {"ok": code == 0, "exit_code": code, "line": line},
        }


def _plain(obj: Any) -> Any:
    """``obj`` with non-finite floats as None and tuples as lists, for JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def first_line(text: str) -> str:
    """The first non-empty line of ``text`` (errors from compilers run long)."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return text.strip()


def _noise(w: warnings.WarningMessage) -> bool:
    # torch's note that eager flex attention is unfused (diffusers' flex backend calls it
    # uncompiled): true, and said where the backend is timed, not a finding of its own
    return "flex_attention" in str(w.message) and "compile" in str(w.message)
