"""Every Triton launch the tests make, by signature (filled by tests/conftest.py's observer):
tests/core/test_kernel_compile.py, which runs last, compiles each one for real GPU targets.
A module of its own, not conftest's, because tests/comfyui has a conftest too and either
may be the module named ``conftest``.

Under pytest-xdist each worker records its own launches. Every worker leaves them in a file
when its session ends, in a folder the controller names, and the compile check (the last
test of the run, on whichever worker it lands) waits for the other workers' files.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

LAUNCHES: dict[str, dict] = {}

_DIR_KEY = "toma_launch_dir"


def launch_dir(config) -> Path:
    """(On xdist's controller) the folder the workers leave their launches in, one per run."""
    found = getattr(config, "_toma_launch_dir", None)
    if found is None:
        found = config._toma_launch_dir = Path(tempfile.mkdtemp(prefix="toma-launches-"))
    return found


def leave_launches(config) -> None:
    """(On an xdist worker, as its session ends) this worker's launches, in its own file;
    (on the controller, once the workers are done) the folder is removed."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or _DIR_KEY not in workerinput:
        if getattr(config, "_toma_launch_dir", None) is not None:
            shutil.rmtree(config._toma_launch_dir, ignore_errors=True)
        return
    folder = Path(workerinput[_DIR_KEY])
    partial = folder / f"{workerinput['workerid']}.json.part"
    partial.write_text(json.dumps(LAUNCHES))
    partial.rename(folder / f"{workerinput['workerid']}.json")  # whole, or not there at all


def all_launches(config, timeout: float) -> list[dict]:
    """Every launch of the run: this process's, and under xdist every other worker's, once
    each has finished (they finish before the last test, the compile check, can end)."""
    found = dict(LAUNCHES)
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or _DIR_KEY not in workerinput:
        return list(found.values())
    folder = Path(workerinput[_DIR_KEY])
    others = {f"gw{i}" for i in range(workerinput["workercount"])} - {workerinput["workerid"]}
    deadline = time.monotonic() + timeout
    while missing := sorted(w for w in others if not (folder / f"{w}.json").exists()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"xdist workers {missing} left no Triton launches in {folder} within {timeout:.0f} s")
        time.sleep(0.5)
    for worker in others:
        found.update(json.loads((folder / f"{worker}.json").read_text()))
    return list(found.values())
