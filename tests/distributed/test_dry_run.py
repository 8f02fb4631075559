"""The dry runner on 2 gloo ranks: real strategies measured and agreed, failures contained.

One spawn checks it all (a spawn costs 5-20 s here): every default-space strategy runs, all
ranks return the same result (per-step times and the throughput interval included), the
measured per-rank peak is within 15% of the cost model; while a candidate runs the user's model
holds no weights, and afterwards it has its own Parameters back, bit for bit; then a failure on
one rank only, a hang on one rank, a NaN loss on one rank, and the simulated memory limit each become a failed trial,
and the ranks are still in step afterwards (a plain run succeeds); the search's evaluator makes a
rank wait for a failed peer about 3 clean dry runs' time, not the whole timeout.
"""

import os
import re
import time

import pytest
import torch

from atorch.auto.opt_lib.base import Optimization, get_optimization, register, registered_names
from atorch.auto.step_timing import summarize
from atorch.testing import run_distributed, tiny_llama

# The per-rank peak the memory model predicts (activations counted tensor by tensor, the loss's
# and tensor parallel's gathered-logits buffers modelled) against the dry runner's measurement:
# within 2% on every strategy here when last measured (benchmarks/RESULTS.md); the bound is the issue's.
TOLERANCE = 0.15
TIMING = dict(profile_steps=3, max_profile_steps=8, target_relative_ci=0.03)
USER_MODEL_PROBES = []                # filled inside the ranks by t_probe_user_model
CANDIDATE_TIMEOUT_S = 6.0             # per-candidate budget in the failure cases
PEER_TEST_TIMEOUT_S = 150.0           # the search evaluator's candidate budget: a peer must not wait for it
GLOBAL_BATCH, SEQ = 8, 64


def _register_test_optimizations() -> None:
    """Failure injectors, registered only inside the spawned ranks (the test process's registry stays clean)."""
    registered_names()
    try:
        get_optimization("t_fail_on_rank1")
        return
    except ValueError:
        pass

    class FailOnRank1(Optimization):
        name = "t_fail_on_rank1"
        order = 95  # after sharding, before the DDP wrap: rank 0 goes on into DDP's collectives

        def apply(self, ctx, config):
            if torch.distributed.get_rank() == 1:
                raise RuntimeError("injected failure on rank 1")

    class HangOnRank0(Optimization):
        name = "t_hang_on_rank0"
        order = 95

        def apply(self, ctx, config):
            if torch.distributed.get_rank() == 0:
                time.sleep(10_000)

    class ProbeUserModel(Optimization):
        """Records whether the user's model (USER_MODEL_PROBES[0]) holds any weight while a candidate runs."""
        name = "t_probe_user_model"
        order = 95

        def apply(self, ctx, config):
            user_model = USER_MODEL_PROBES[0]
            USER_MODEL_PROBES.append(all(p.is_meta for p in user_model.parameters()) and ctx.model is not user_model)

    class NanLossOnRank1(Optimization):
        """The loss turns NaN on rank 1 only, from the candidate's 3rd step (a timed one)."""
        name = "t_nan_loss_on_rank1"
        order = 95

        def apply(self, ctx, config):
            calls = []

            def loss_func(batch, output):
                calls.append(1)
                bad = torch.distributed.get_rank() == 1 and len(calls) >= 3
                return output.loss * float("nan") if bad else output.loss

            ctx.loss_func = loss_func

    register(FailOnRank1)
    register(NanLossOnRank1)
    register(HangOnRank0)
    register(ProbeUserModel)

STRATEGIES = [
    ["parallel_mode"],
    ["parallel_mode", "amp_native"],
    ["parallel_mode", "checkpoint"],
    ["parallel_mode", "module_replace"],
    ["parallel_mode", "zero1"],
    ["parallel_mode", "zero2"],
    ["parallel_mode", "fsdp"],
    ["parallel_mode", "amp_native", "fsdp", "checkpoint"],
    [("parallel_mode", ([("tensor", 2), ("data", 1)], None)), "tensor_parallel"],
]


def _context():
    from atorch.auto.model_context import ModelContext
    from atorch.testing.parity import TokenDataset

    return ModelContext(model=tiny_llama(seed=0), optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3},
                        dataset=TokenDataset(n=64, seq_len=SEQ), model_input_format="unpack_dict",
                        dataloader_args={"batch_size": GLOBAL_BATCH})


def _dry_runs():
    import torch.distributed as dist

    from atorch import distributed as adist
    from atorch.auto.cost_model import estimate
    from atorch.auto.dry_runner import DryRunConfig, DryRunError, check_strategy_runs, dry_run, make_evaluator
    from atorch.auto.strategy import Strategy

    _register_test_optimizations()
    ctx = _context()
    params_before = list(ctx.model.parameters())
    out_model_bytes = sum(p.numel() * p.element_size() for p in params_before)
    weights_before = [p.detach().clone() for p in params_before]
    USER_MODEL_PROBES[:] = [ctx.model]
    rng_before = torch.random.get_rng_state()
    out = {"runs": [], "model_bytes": out_model_bytes}
    for s in STRATEGIES:
        strategy = Strategy(s)
        r = dry_run(ctx, strategy, DryRunConfig(warmup_steps=2, timeout_s=120, **TIMING))
        predicted = estimate(ctx.model, strategy, GLOBAL_BATCH, SEQ, dist.get_world_size(), "cpu")
        out["runs"].append((strategy.describe(), r, predicted.peak_memory_bytes))
    out["probe"] = dry_run(ctx, Strategy(["parallel_mode", "t_probe_user_model"]), DryRunConfig(**TIMING)).ok
    out["user_model_held_no_weights"] = USER_MODEL_PROBES[1:]
    # The user's model and RNG stream are untouched by the dry runs; no parallel groups remain.
    out["model_untouched"] = all(torch.equal(a, b) for a, b in zip(weights_before, ctx.model.parameters()))
    out["same_parameters"] = all(a is b for a, b in zip(params_before, ctx.model.parameters()))
    out["rng_untouched"] = torch.equal(rng_before, torch.random.get_rng_state())
    out["groups_left"] = adist.is_parallel_group_created()

    short = DryRunConfig(warmup_steps=1, profile_steps=1, timeout_s=CANDIDATE_TIMEOUT_S)
    start = time.monotonic()
    out["fail_one_rank"] = dry_run(ctx, Strategy(["parallel_mode", "t_fail_on_rank1"]), short)
    out["hang_one_rank"] = dry_run(ctx, Strategy(["parallel_mode", "t_hang_on_rank0"]), short)
    out["nan_one_rank"] = dry_run(ctx, Strategy(["parallel_mode", "t_nan_loss_on_rank1"]), short)
    out["oom"] = dry_run(ctx, Strategy(["parallel_mode"]),
                         DryRunConfig(warmup_steps=1, profile_steps=1, memory_limit_bytes=4_000_000))
    out["failure_seconds"] = time.monotonic() - start
    out["after_failures"] = dry_run(ctx, Strategy(["parallel_mode"]), short)    # still in step?
    # check_strategy_runs: invalid -> ValueError before any collective; failing -> DryRunError.
    try:
        check_strategy_runs(ctx, Strategy(["parallel_mode", "no_such_opt"]), short)
        out["invalid"] = "no error"
    except ValueError as e:
        out["invalid"] = str(e)
    try:
        check_strategy_runs(ctx, Strategy(["parallel_mode", "t_fail_on_rank1"]), short)
        out["failing"] = "no error"
    except DryRunError as e:
        out["failing"] = str(e)
    out["good"] = check_strategy_runs(ctx, Strategy(["parallel_mode"]), short).ok
    # The search's evaluator: after a clean dry run, a rank waits for a failed peer about 3 clean
    # dry runs' time (floor 2 s here), not the whole timeout_s (PEER_TEST_TIMEOUT_S).
    evaluate = make_evaluator(ctx, DryRunConfig(warmup_steps=1, profile_steps=1, timeout_s=PEER_TEST_TIMEOUT_S,
                                                peer_wait_floor_s=2.0))
    start = time.monotonic()
    out["evaluator_clean"] = evaluate(Strategy(["parallel_mode"])).ok
    out["clean_seconds"] = time.monotonic() - start
    start = time.monotonic()
    out["evaluator_fail"] = evaluate(Strategy(["parallel_mode", "t_fail_on_rank1"]))
    out["evaluator_fail_seconds"] = time.monotonic() - start
    out["evaluator_after"] = evaluate(Strategy(["parallel_mode"])).ok
    dist.barrier()
    return out


@pytest.mark.heavy
def test_dry_runs_on_two_ranks():
    results = run_distributed(_dry_runs, 2, timeout=600)
    rank0, rank1 = results
    # Every rank sees exactly the same results.
    for key in ("fail_one_rank", "hang_one_rank", "nan_one_rank", "oom", "after_failures"):
        assert rank0[key] == rank1[key], key
    for (name0, r0, _), (name1, r1, _) in zip(rank0["runs"], rank1["runs"]):
        assert name0 == name1 and r0 == r1, name0
    ratios = {}
    for name, r, predicted in rank0["runs"]:
        assert r.ok and r.throughput > 0 and r.step_time_s > 0, (name, r)
        # Timed until the interval is tight or the budget is spent; the interval holds the estimate.
        assert TIMING["profile_steps"] <= len(r.step_times_s) <= TIMING["max_profile_steps"], (name, r.step_times_s)
        if r.throughput_ci is None:
            # Unbounded (the half-width reached the mean: a burst of load on the shared machine),
            # and said so rather than hidden.
            pilot = TIMING["profile_steps"]
            assert summarize(r.step_times_s, pilot=pilot).throughput_interval(GLOBAL_BATCH) is None, (name, r)
        else:
            low, high = r.throughput_ci
            assert low <= r.throughput <= high, (name, r)
        precise = summarize(r.step_times_s).relative_half_width <= TIMING["target_relative_ci"]
        assert precise or len(r.step_times_s) > TIMING["profile_steps"], (name, r.step_times_s)
        measured = r.peak_memory_bytes
        ratios[name] = predicted / measured
    # The memory model (refitted on live-tensor measurements, issue 12 item 3) predicts the
    # candidate's own peak; candidates are built from the offloaded weights, not deep copies.
    print("predicted/measured peak:", ratios)
    assert all(abs(r - 1) <= TOLERANCE for r in ratios.values()), ratios
    assert rank0["model_untouched"] and rank0["rng_untouched"] and not rank0["groups_left"]
    assert rank0["same_parameters"] and rank1["same_parameters"]
    assert rank0["probe"] and rank0["user_model_held_no_weights"] == [True]
    assert rank1["user_model_held_no_weights"] == [True]

    fail = rank0["fail_one_rank"]
    assert fail.status == "exception" and "rank 1" in fail.error and "injected failure" in fail.error
    assert rank0["hang_one_rank"].status == "timeout"
    # A NaN loss on one rank is a failed trial for every rank, never a throughput (rank 1's NaN at step 3
    # reaches rank 0's weights through DDP's gradient average: rank 0's loss is NaN from step 4, and the
    # lowest failing rank is reported).
    nan = rank0["nan_one_rank"]
    assert nan.status == "exception" and nan.throughput == 0, nan
    assert re.search(r"rank [01]: NonFiniteLoss: non-finite loss \(nan\) at step [34] of", nan.error), nan
    assert rank0["oom"].status == "oom" and "simulated device memory limit" in rank0["oom"].error
    # Two candidates bounded by the timeout (plus teardown), not by the 30 min process-group default.
    assert rank0["failure_seconds"] < 4 * CANDIDATE_TIMEOUT_S + 60
    assert rank0["after_failures"].ok
    assert "unknown optimization 'no_such_opt'" in rank0["invalid"]
    assert "failed its dry run" in rank0["failing"] and "injected failure" in rank0["failing"]
    assert rank0["good"] and rank1["good"]
    for r in (rank0, rank1):
        fail = r["evaluator_fail"]
        assert r["evaluator_clean"] and r["evaluator_after"] and fail.status == "exception" and "rank 1" in fail.error
        # Waited about 3x the clean dry run (>= 2 s), far less than the 150 s timeout.
        assert r["evaluator_fail_seconds"] < min(PEER_TEST_TIMEOUT_S / 2, 3 * r["clean_seconds"] + 30), r
