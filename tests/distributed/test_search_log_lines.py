"""Quiet by default (issue 18, item 10), measured on a real 2-rank search: rank 0 logs one line per
dry run, the other rank only warnings and errors.

Both ranks capture every record the "atorch" logger lets through (its level is what
`configure_logging` set for the rank) while `auto_accelerate` searches a small space (the
checkpoint dimension only: two candidates), then apply the winner. The counts are exact:
the search's trial table says how many dry runs there were. The candidates' optimizations
(checkpoint logs an INFO line when it applies) are built once per dry run and must stay silent.
"""

import logging

import pytest
import torch

from atorch.testing import run_distributed, tiny_llama

GLOBAL_BATCH, SEQ = 4, 16
# Everything the search could try but activation checkpointing (parallel_mode is always there).
EXCLUDED = ["fsdp", "zero1", "zero2", "tensor_parallel", "pipeline_parallel", "compile", "module_replace",
            "gradient_accumulation", "amp_native"]
SEARCH_ENV = {"BO_SG_MAX_IETR": "4", "MAX_PATIENCE": "4", "RANDOM_SAMPLE": "2", "ATORCH_DRYRUN_WARMUP_STEP": "1",
              "ATORCH_DRYRUN_PROFILE_STEP": "2", "ATORCH_DRYRUN_MAX_STEPS": "4", "ATORCH_DRYRUN_TIMEOUT": "60",
              "ATORCH_SEARCH_CACHE": "off"}
# What rank 0 logs once per search besides its dry runs: the space, the start, the trial table
# (one record), the choice.
SEARCH_FRAME = ("search space: ", "searching ", "strategy search trials:", "chosen strategy: ")


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.NOTSET)
        self.records = []

    def emit(self, record):
        self.records.append((record.levelno, record.name, record.getMessage().splitlines()[0]))


def _search_with_captured_logs(tmp_dir):
    import torch.distributed as dist

    from atorch.auto import auto_accelerate
    from atorch.testing.parity import TokenDataset

    capture = _Capture()
    logging.getLogger("atorch").addHandler(capture)
    try:
        status, result, strategy = auto_accelerate(
            tiny_llama(seed=0), optim_func=torch.optim.AdamW, dataset=TokenDataset(n=32, seq_len=SEQ),
            optim_args={"lr": 1e-3}, model_input_format="unpack_dict", dataloader_args={"batch_size": GLOBAL_BATCH},
            excluded=EXCLUDED, report_path=tmp_dir)
        search = result.args.get("search_result") if status else None
        out = {"status": status, "strategy": strategy.describe() if strategy is not None else None,
               "dry_runs": len(search.trials) if search is not None else None,
               "level": logging.getLogger("atorch").getEffectiveLevel()}
        del result
        dist.barrier()
    finally:
        logging.getLogger("atorch").removeHandler(capture)
    out["records"] = capture.records
    return out


@pytest.mark.heavy
def test_a_two_rank_search_logs_one_line_per_dry_run_on_rank_0_only(tmp_path):
    rank0, rank1 = run_distributed(_search_with_captured_logs, 2, str(tmp_path), env=SEARCH_ENV, timeout=600)
    assert rank0["status"] and rank1["status"] and rank0["strategy"] == rank1["strategy"]
    assert (rank0["level"], rank1["level"]) == (logging.INFO, logging.WARNING)

    # The other rank: warnings and errors only, and a clean search has none.
    assert rank1["records"] == [], rank1["records"]

    records = rank0["records"]
    shown = "\n".join(f"{logging.getLevelName(level)} {name}: {msg}" for level, name, msg in records)
    assert all(level == logging.INFO for level, _, _ in records), shown
    messages = [msg for _, _, msg in records]
    chosen = next(i for i, m in enumerate(messages) if m.startswith("chosen strategy: "))
    # After the choice the winner is applied once for training: its optimizations may say what
    # they did (once, whichever candidate won); the search is over.
    search, applied = messages[:chosen + 1], messages[chosen + 1:]
    assert not [m for m in applied if m.startswith("dry run ")], shown
    dry_run_lines = [m for m in search if m.startswith("dry run ")]
    assert 2 <= rank0["dry_runs"] == len(dry_run_lines), shown
    # Nothing else per dry run: what an optimization says while a candidate is built stays out.
    others = [m for m in search if not m.startswith("dry run ")]
    assert [next(p for p in SEARCH_FRAME if m.startswith(p)) for m in others if m.startswith(SEARCH_FRAME)] == \
        list(SEARCH_FRAME), shown
    assert len(others) == len(SEARCH_FRAME), shown
