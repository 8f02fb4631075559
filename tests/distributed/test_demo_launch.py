"""`make demo` as a user runs it: the automatic search through the launcher, then training, then again.

Every other distributed test forks its ranks from one interpreter, so they share Python's str hash
seed (`atorch.testing.spawn`): a set of strings iterates in the same order on every rank, and code
whose collectives follow such an order cannot be caught there. The launcher starts each rank in a
fresh interpreter; with PYTHONHASHSEED unset their seeds differ, as in a user's job. This runs the
demo script itself (a smaller search budget, 5 training steps) and checks what the issue asks it to
show: the measured intervals, the chosen strategy with its one-line reason, and that a second run on
the same setup is one confirming dry run of the remembered winner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

from atorch.distributed import find_free_port
from atorch.testing.spawn import QUIET_ENV

pytestmark = [pytest.mark.heavy, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "scripts" / "demo.py"
RUN_TIMEOUT_S = 300
# A smaller search than `make demo`'s (10 dry runs): enough for seeds, a surrogate pick and a re-measured pair.
SEARCH_ENV = {"BO_SG_MAX_IETR": "5", "MAX_PATIENCE": "5", "RANDOM_SAMPLE": "2",
              "ATORCH_DRYRUN_WARMUP_STEP": "1", "ATORCH_DRYRUN_MAX_STEPS": "12"}


def _run_demo(report_dir: Path) -> subprocess.CompletedProcess:
    env: Dict[str, str] = dict(os.environ, **QUIET_ENV, **SEARCH_ENV)
    env.pop("PYTHONHASHSEED", None)            # each rank's interpreter draws its own str hash seed
    env.pop("ATORCH_SEARCH_CACHE", None)       # the cache goes into the report directory, as in `make demo`
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [sys.executable, "-m", "atorch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(find_free_port()), str(DEMO), "--steps", "5", "--report_dir", str(report_dir)]
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert out.returncode == 0, \
        f"demo exited {out.returncode}\nstdout:\n{out.stdout[-4000:]}\nstderr:\n{out.stderr[-4000:]}"
    return out


def _line(stdout: str, prefix: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"expected one line starting {prefix!r} in:\n{stdout}"
    return lines[0][len(prefix):]


def test_the_demo_searches_trains_and_then_confirms_the_remembered_winner(tmp_path: Path):
    report = tmp_path / "report"
    first = _run_demo(report)
    assert "dry runs," in first.stdout and "1 confirming dry run" not in first.stdout
    # Every measured throughput with its interval: "name  value  [lo, hi]  +-x%  (n samples)".
    intervals = first.stdout.split("measured throughput (samples/s) with 95% confidence interval:")[1]
    assert "+-" in intervals.split("chosen strategy:")[0]
    chosen = _line(first.stdout, "chosen strategy: ")
    why = _line(first.stdout, "why: ")
    assert "samples/s" in why and "95% CI" in why, why
    assert "step    5  loss" in first.stdout
    saved = json.loads((report / "strategy.json").read_text())
    assert saved, "the chosen strategy was not saved"
    assert (report / "search_cache.json").is_file()

    second = _run_demo(report)
    assert "1 confirming dry run of the remembered winner" in second.stdout
    assert _line(second.stdout, "chosen strategy: ") == chosen
    assert "step    5  loss" in second.stdout
