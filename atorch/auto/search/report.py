"""Reporting a search: the trial table, a PNG of throughput per trial, and the winner in one line.

For people who would rather look than read: the plot shows every trial's throughput with its 95%
interval (failed trials at 0, marked by status) and the running best; the table has one row per
dry run (a re-measured strategy has several), with the interval's bounds.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Dict, Optional

from atorch.auto.search.feasibility import format_bytes, outlived
from atorch.auto.step_timing import MIN_SAMPLES_FOR_INTERVAL

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from atorch.auto.search.search import SearchResult

logger = logging.getLogger(__name__)

_STATUS_MARKERS = {"ok": ("o", "tab:blue"), "oom": ("x", "tab:red"), "timeout": ("s", "tab:orange"),
                   "exception": ("v", "tab:purple"), "failed": ("v", "tab:gray")}


def trials_table(result: "SearchResult") -> str:
    """The trial table as aligned text (memory in MB, throughput in samples/s)."""
    import pandas as pd

    if result.trials.empty:
        return "(no trial was run)"
    df = result.trials.copy()
    for col in ("predicted_memory", "measured_memory"):
        df[col] = pd.to_numeric(df[col], errors="coerce") / 1e6
    df = df.rename(columns={"predicted_memory": "pred_mem_MB", "measured_memory": "mem_MB",
                            "predicted_throughput": "pred_throughput", "planner_seconds": "planner_s"})
    df["reason"] = df["reason"].fillna("").astype(str).map(lambda r: r if len(r) <= 60 else r[:57] + "...")
    with pd.option_context("display.max_rows", None, "display.max_columns", None, "display.width", 250,
                           "display.float_format", "{:.4g}".format):
        return df.to_string(index=False)


def explain(result: "SearchResult", limit_source: str = "") -> str:
    """Why the winner won, in one line, e.g.
    "A: 1.12x B (95% CI 1.08-1.16) (...)" or "A and B within noise (1.01x, CI 0.97-1.05); chose A: 30% less memory"
    after a re-measurement, else (an evaluator that reports no noise) "parallel_mode(data=2)+amp_native+fsdp:
    1.9x plain data-parallel; 1 candidate not run for memory: zero1 predicted 31.0 GB > 24.0 GB limit (...)".
    `limit_source`: where the memory limit came from (e.g. "ATORCH_DEVICE_MEMORY_LIMIT=100000"), said
    next to the limit when candidates were not run for it; "" when the caller does not know."""
    trials = result.trials
    parts = []
    if result.best is None:
        failed = trials["status"].value_counts().to_dict() if not trials.empty else {}
        parts.append("no strategy ran" + (f" ({_counts(failed)})" if failed else ""))
        errors = _common_errors(trials["reason"]) if not trials.empty else ""
        if errors:
            parts.append(errors)
    elif result.comparison is not None and result.comparison.lo is not None:
        # Re-measured: the winner against the runner-up with the interval of their ratio.
        parts.append(f"{result.comparison.line()} ({result.best_throughput:.4g} samples/s)")
    else:
        name = result.best.describe()
        ok = trials[trials["status"] == "ok"]
        baseline = ok[ok["strategy"].map(_is_plain_data_parallel)]
        if not baseline.empty and baseline.iloc[0]["strategy"] != name:
            ratio = result.best_throughput / float(baseline.iloc[0]["throughput"])
            # Two decimals, as `Comparison.line`: ".2g" printed 1.02x and 1.049x as "1x".
            parts.append(f"{name}: {ratio:.2f}x plain data-parallel ({result.best_throughput:.4g} samples/s)")
        elif len(ok) > 1:
            runner_up = ok[ok["strategy"] != name].sort_values("throughput", ascending=False).iloc[0]
            ratio = result.best_throughput / float(runner_up["throughput"])
            what = "plain data-parallel was fastest" if not baseline.empty else f"{name}"
            parts.append(f"{what}: {ratio:.2f}x the runner-up {runner_up['strategy']} "
                         f"({result.best_throughput:.4g} samples/s)")
        else:
            parts.append(f"{name}: the only strategy that ran ({result.best_throughput:.4g} samples/s)")
    if result.best is not None and result.too_few_steps and (result.comparison is None or result.comparison.lo is None):
        # Without it the line read "A: 1.23x the runner-up B" from one timed step of each (ATORCH_DRYRUN_MAX_STEPS=1).
        parts.append("no interval: dry runs timed too few steps to measure their noise (a ratio from one or two "
                     f"steps is not a measured difference; at least {MIN_SAMPLES_FOR_INTERVAL} timed steps give an "
                     "interval: ATORCH_DRYRUN_MAX_STEPS, ATORCH_DRYRUN_PROFILE_STEP)")
    if not result.pruned.empty:
        parts.append(_pruned_clause(result.pruned, limit_source))
    failed = trials[trials["status"] != "ok"] if not trials.empty else trials
    if result.best is not None and not failed.empty:
        parts.append(f"{len(failed)} trial(s) failed ({_counts(failed['status'].value_counts().to_dict())})")
        dropped = _failed_after_running(trials, result.best.describe())
        if dropped:
            parts.append(dropped)
    runs = len(trials)
    distinct = int(trials["strategy"].nunique()) if runs else 0
    parts.append(f"{distinct}/{result.num_candidates} candidates run"
                 + (f" ({runs} dry runs with re-measurements)" if runs != distinct else "")
                 + (f", stopped: {result.stop_reason}" if result.stop_reason else ""))
    return "; ".join(parts)


def _pruned_clause(pruned: "pd.DataFrame", limit_source: str) -> str:
    """The candidates not run for memory, by the leanest of them, e.g. "360 candidates not run for memory,
    the leanest: A predicted 2.4 MB > 100.0 KB limit (P(fit) 0.000 < 0.05) (the limit:
    ATORCH_DEVICE_MEMORY_LIMIT=100000)". The leanest one's need is the limit that would let something
    run; the table's first row (plain data parallelism, the largest) says nothing about that, so without
    any predicted memory (no predictor) the line names it as an example, not as the leanest."""
    import numpy as np
    import pandas as pd

    column = pruned["predicted_memory"] if "predicted_memory" in pruned else pd.Series([None] * len(pruned))
    predicted = pd.to_numeric(column, errors="coerce").to_numpy(dtype=float)
    known = bool(np.isfinite(predicted).any())
    at = int(np.nanargmin(np.where(np.isfinite(predicted), predicted, np.nan))) if known else 0
    leanest = pruned.iloc[at]
    reason = str(leanest.get("reason", "") or "")
    if known and "predicted" not in reason:        # e.g. "needs at least the memory of B, which ran out of memory"
        reason = f"(predicted {format_bytes(predicted[at])}) {reason}"
    count = len(pruned)
    head = f"{count} candidates not run for memory, {'the leanest' if known else 'for example'}" if count > 1 \
        else "1 candidate not run for memory"
    source = f" (the limit: {limit_source})" if limit_source else ""
    return f"{head}: {leanest.get('strategy', '?')} {reason}".rstrip() + source


def _failed_after_running(trials: "pd.DataFrame", best: str = "") -> str:
    """What became of candidates that both ran and failed ("" when none did): the fastest of them that is
    not eligible (out of memory, more failures than runs, or a failed last run: `feasibility.outlived`), else the
    fastest row of the table vanishes from the verdict unexplained; and the winner `best` when it failed a run
    it then outlived (a failure that did not repeat), which the user should know before a long job."""
    ok = trials[trials["status"] == "ok"]
    failed = trials[trials["status"] != "ok"]
    both = ok[ok["strategy"].isin(set(failed["strategy"]))].sort_values("throughput", ascending=False)
    declared, dropped = "", ""
    for name, group in both.groupby("strategy", sort=False):      # fastest first
        fails = failed[failed["strategy"] == name]
        if name == best:
            kinds = "/".join(sorted(set(fails["status"])))
            declared = (f"{name} failed {len(fails)} of its {len(group) + len(fails)} dry runs ({kinds}) and ran "
                        "in the others: declared, as a failure that did not repeat")
        elif not dropped and not outlived(list(fails["status"]), len(group),
                                          trials[trials["strategy"] == name].iloc[-1]["status"] == "ok"):
            dropped = (f"{name} measured {float(group.iloc[0]['throughput']):.4g} samples/s but failed when run "
                       f"again ({fails.iloc[0]['status']}), so it is not eligible")
    return "; ".join(part for part in (declared, dropped) if part)


def _common_errors(reasons: "pd.Series", shown: int = 2, width: int = 300) -> str:
    """The most frequent failure messages with their counts, e.g. 'errors: 3x "exception: rank 0:
    TypeError: ..."' ("" when there is none): when nothing ran, what went wrong belongs in the one
    line the user reads (a model or loss that raises under every strategy shows the same message
    on every trial)."""
    reasons = reasons.fillna("").astype(str)
    counts = reasons[reasons != ""].value_counts()
    if counts.empty:
        return ""
    items = [f'{n}x "{r if len(r) <= width else r[:width - 3] + "..."}"' for r, n in counts.head(shown).items()]
    more = len(counts) - shown
    return "errors: " + ", ".join(items) + (f" (+{more} other messages in the trial table)" if more > 0 else "")


def _counts(counts: Dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))


def _is_plain_data_parallel(label: str) -> bool:
    # Strategy.describe() of a strategy with only a data-parallel parallel_mode (and the plain DDP
    # that resolve_strategy adds to it).
    parts = label.split("+")
    return parts[0].startswith("parallel_mode") and "tensor" not in parts[0] and "pipeline" not in parts[0] \
        and parts[1:] in ([], ["ddp"])


def plot_trials(result: "SearchResult", path: str) -> str:
    """Write a PNG of throughput per trial with the running best; returns `path`."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    trials = result.trials
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        if not trials.empty:
            x = trials["trial"].tolist()
            y = [float(v) for v in trials["throughput"]]
            for status, (marker, color) in _STATUS_MARKERS.items():
                sel = [i for i, s in enumerate(trials["status"]) if s == status]
                if sel:
                    ax.scatter([x[i] for i in sel], [y[i] for i in sel], marker=marker, color=color,
                               label=status, zorder=3)
            if "throughput_lo" in trials and trials["throughput_lo"].notna().any():
                lo = [float(v) for v in trials["throughput_lo"]]
                hi = [float(v) for v in trials["throughput_hi"]]
                # Only intervals around their point (NaN compares False): a table from elsewhere
                # (a cache, a user's evaluator) must not break the plot.
                keep = [i for i in range(len(x)) if lo[i] <= y[i] <= hi[i]]
                ax.errorbar([x[i] for i in keep], [y[i] for i in keep],
                            yerr=[[y[i] - lo[i] for i in keep], [hi[i] - y[i] for i in keep]],
                            fmt="none", ecolor="tab:blue", alpha=0.6, capsize=2, label="95% CI", zorder=2)
            best, running = 0.0, []
            for v in y:
                best = max(best, v)
                running.append(best)
            ax.step(x, running, where="post", color="tab:green", label="best so far")
            if "predicted_throughput" in trials and trials["predicted_throughput"].notna().any():
                ax.scatter(x, trials["predicted_throughput"].tolist(), marker="_", s=120, color="gray",
                           label="predicted (cost model)", zorder=2)
        ax.set_xlabel("trial")
        ax.set_ylabel("throughput (samples/s)")
        title = result.best.describe() if result.best is not None else "no strategy ran"
        ax.set_title(f"strategy search: best {title}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


def write_report(result: "SearchResult", directory: str, log: Optional[logging.Logger] = None) -> Dict[str, str]:
    """Log the table and the reason; write trials.csv, search.png and best_strategy.json to `directory`."""
    os.makedirs(directory, exist_ok=True)
    paths = {"table": os.path.join(directory, "trials.csv"), "plot": os.path.join(directory, "search.png")}
    result.trials.to_csv(paths["table"], index=False)
    if not result.pruned.empty:
        paths["pruned"] = os.path.join(directory, "pruned.csv")
        result.pruned.to_csv(paths["pruned"], index=False)
    plot_trials(result, paths["plot"])
    if result.best is not None:
        paths["strategy"] = os.path.join(directory, "best_strategy.json")
        result.best.save(paths["strategy"])
    (log or logger).info("strategy search trials:\n%s\n%s\nplot: %s", trials_table(result), result.reason,
                         paths["plot"])
    return paths
