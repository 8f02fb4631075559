"""Bad inputs on 2 gloo ranks: every rank raises the same exception, naming the field, and nobody waits.

One spawn runs the whole catalogue: each case runs on both ranks, and each rank reports the
exception type and message it got (or its status) and the seconds it took. Cases where only one
rank fails (a local file error inside a checkpoint save or load, an optimizer factory failing on
one rank) check the error agreement: the other rank must raise the same exception, not wait in
a barrier. Also here: MASTER_PORT already in use, a rank stalling inside a collective, and (a spawn of
their own) sampler settings and train_step options that differ between ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

from atorch.distributed import find_free_port
from atorch.testing import run_distributed
from atorch.testing.spawn import QUIET_ENV

pytestmark = pytest.mark.distributed

BOUND_S = 60.0   # generous: each case takes well under a second when nobody waits


def _accelerate(**overrides: Any):
    from atorch.auto import auto_accelerate
    from atorch.testing import tiny_llama
    from atorch.testing.parity import TokenDataset

    kwargs = dict(optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": 1e-3},
                  model_input_format="unpack_dict", dataloader_args={"batch_size": 4},
                  load_strategy=["parallel_mode"])
    kwargs.update(overrides)
    return auto_accelerate(kwargs.pop("model", None) or tiny_llama(seed=0), **kwargs)


def _scaled_loss(batch: Any, output: Any) -> torch.Tensor:
    return output.loss * 10


def _on_rank(rank: int, exc: BaseException) -> Callable:
    """An optimizer factory that raises `exc` on `rank` only."""
    def factory(params, lr):
        import torch.distributed as dist

        if dist.get_rank() == rank:
            raise exc
        return torch.optim.SGD(params, lr=lr)
    return factory


def _returns_none_on(rank: Any) -> Callable:
    """An optimizer factory that returns None on `rank` (None: on every rank) instead of an optimizer."""
    def factory(params, lr):
        import torch.distributed as dist

        return None if rank is None or dist.get_rank() == rank else torch.optim.SGD(params, lr=lr)
    return factory


def _trained(root: str):
    status, result, _ = _accelerate()
    assert status
    return result


def _patched(module: Any, name: str, rank: int, exc: BaseException, fn: Callable[[], Any]) -> Any:
    """Run fn with `module.name` raising `exc` on `rank` only."""
    import torch.distributed as dist

    original = getattr(module, name)

    def boom(*args, **kwargs):
        raise exc

    if dist.get_rank() == rank:
        setattr(module, name, boom)
    try:
        return fn()
    finally:
        setattr(module, name, original)


PIPELINE_2 = [("parallel_mode", ([("pipeline", 2)], None)), ("pipeline_parallel", {"chunks": 2})]
TENSOR_2 = [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"]


def _step_with_labels(value: int, load_strategy: Any) -> float:
    """One train_step on the loader's first batch with its last two labels set to `value` on every rank."""
    from atorch.auto import train_step

    status, result, _ = _accelerate(load_strategy=load_strategy)
    assert status
    batch = next(iter(result.dataloader))
    labels = batch["labels"].clone()
    labels[:, -2:] = value
    return float(train_step(result, {**batch, "labels": labels}))


def _cases(root: str) -> List[Tuple[str, Callable[[], Any]]]:
    from atorch.checkpoint import load_checkpoint, save_checkpoint
    from atorch.checkpoint import manifest as mf
    from atorch.checkpoint import layout_handlers, save_load
    from atorch.testing import tiny_llama
    from atorch.testing.parity import TokenDataset

    result = _trained(root)
    good = save_checkpoint(result, os.path.join(root, "good"), step=1)
    with open(os.path.join(root, "a_file"), "w") as f:
        f.write("x")

    def loss_per_token(batch, output):
        return output.logits.sum(-1)

    def non_scalar_loss():
        status, res, _ = _accelerate(loss_func=loss_per_token)
        batch = res.prepare_input(next(iter(res.dataloader)))
        return res.loss_func(batch, res.model(**batch))

    def ddp_unused_parameter():
        from atorch.auto import train_step

        model = tiny_llama(seed=0)
        model.model.unused = torch.nn.Linear(2, 2)     # registered, never called by forward
        status, res, _ = _accelerate(model=model)
        batches = iter(res.dataloader)
        for _ in range(2):    # DDP notices at the forward after the first backward
            train_step(res, next(batches))

    return [
        # torch's advice names DDP's constructor argument, which atorch passes: the error says where it is here
        ("ddp_unused_parameter", ddp_unused_parameter),
        ("batch_not_divisible_by_data", lambda: _accelerate(dataloader_args={"batch_size": 3})),
        ("batch_zero", lambda: _accelerate(dataloader_args={"batch_size": 0})),
        ("chunks_not_dividing_batch", lambda: _accelerate(
            load_strategy=[("parallel_mode", ([("pipeline", 2)], None)), ("pipeline_parallel", {"chunks": 3})])),
        ("optim_args_unknown_key", lambda: _accelerate(optim_args={"lr": 1e-3, "momentum": 0.9})),
        ("dataset_shorter_than_batch", lambda: _accelerate(dataset=TokenDataset(n=2))),
        ("model_not_module", lambda: _accelerate(model="tiny_llama")),
        ("save_strategy_missing_dir", lambda: _accelerate(
            save_strategy_to_file=os.path.join(root, "missing", "strategy.json"))),
        ("strategy_file_missing", lambda: _accelerate(load_strategy=os.path.join(root, "missing.json"))),
        ("loss_not_scalar", non_scalar_loss),
        ("apply_value_error_on_rank_0", lambda: _accelerate(
            optim_func=_on_rank(0, ValueError("optim_func: lr schedule table is empty")))),
        ("apply_runtime_error_on_rank_1", lambda: _accelerate(
            optim_func=_on_rank(1, RuntimeError("out of memory (simulated)")))),
        ("save_under_a_file", lambda: save_checkpoint(result, os.path.join(root, "a_file", "step_2"), step=2)),
        ("save_fails_on_rank_1_only", lambda: _patched(
            mf, "record_files", 1, PermissionError("[Errno 13] Permission denied: 'dcp/__1_0.distcp'"),
            lambda: save_checkpoint(result, os.path.join(root, "step_3"), step=3))),
        ("commit_fails_on_rank_0_only", lambda: _patched(
            mf, "commit", 0, OSError("[Errno 28] No space left on device"),
            lambda: save_checkpoint(result, os.path.join(root, "step_4"), step=4))),
        ("load_fails_on_rank_1_only", lambda: _patched(
            save_load, "set_rng_state", 1, KeyError("torch_cpu"), lambda: load_checkpoint(result, good))),
        ("load_missing_dir", lambda: load_checkpoint(result, os.path.join(root, "nothing"))),
        # torch's optimizer-state loader raising on one rank (IndexError, ZeRO-1 with a parameter group empty
        # there) left the other rank waiting at the next vote
        ("load_optimizer_fails_on_rank_0_only", lambda: _patched(
            layout_handlers.TorchHandler, "load_optim_state", 0, IndexError("list index out of range"),
            lambda: load_checkpoint(result, good))),
        # found by the bad-input sweep (status=True, or silently accepted, before)
        ("optim_func_returns_none", lambda: _accelerate(optim_func=_returns_none_on(None))),
        ("optim_func_returns_none_on_rank_1", lambda: _accelerate(optim_func=_returns_none_on(1))),
        ("parallel_mode_dim_typo", lambda: _accelerate(load_strategy=[("parallel_mode", ([("dta", 2)], None))])),
        ("excluded_unknown_name", lambda: _accelerate(load_strategy=None, excluded=["fsdpx"])),
        ("dataset_of_ints", lambda: _accelerate(dataset=list(range(16)))),
        # what only one rank gets wrong, or what differs between ranks (the backend's error named neither)
        ("dataset_short_on_rank_1", lambda: _accelerate(dataset=TokenDataset(n=2 if _rank() == 1 else 16))),
        ("strategies_differ", lambda: _accelerate(
            load_strategy=["amp_native", "fsdp"] if _rank() == 0 else ["fsdp"])),
        ("batch_sizes_differ", lambda: _accelerate(dataloader_args={"batch_size": 4 if _rank() == 0 else 8})),
        # No collective differs: the replicas silently drifted apart (weights 0.3 apart after 3 steps).
        ("learning_rates_differ", lambda: _accelerate(optim_args={"lr": 1e-3 if _rank() == 0 else 1e-1})),
        ("optimizers_differ", lambda: _accelerate(optim_func=torch.optim.AdamW if _rank() == 0 else torch.optim.SGD,
                                                  optim_args={"lr": 1e-3})),
        ("loss_func_on_rank_0_only", lambda: _accelerate(loss_func=_scaled_loss if _rank() == 0 else None)),
        # stages and slices are cut from each rank's own model: models built without a common seed
        # trained on silently (a stage's data replicas never agreed); found by the combination sweep
        ("pipeline_models_differ", lambda: _accelerate(model=tiny_llama(seed=_rank()), load_strategy=PIPELINE_2)),
        ("tensor_models_differ", lambda: _accelerate(model=tiny_llama(seed=_rank()), load_strategy=[
            ("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"])),
        # FSDP2 keeps each rank's own shard of its own model: built without a common seed, the sharded model was
        # stitched from both ranks' weights (status True)
        ("fsdp_models_differ", lambda: _accelerate(model=tiny_llama(seed=_rank()), load_strategy=["fsdp"])),
        ("zero2_models_differ", lambda: _accelerate(model=tiny_llama(seed=_rank()), load_strategy=["zero2"])),
        # models of different shapes: accepted, then a hang in the first reduce-scatter (fsdp), or gloo aborting
        # the process on a size mismatch (the broadcast of sync_module_states, zero2, tensor_parallel)
        ("fsdp_layers_differ", lambda: _accelerate(model=tiny_llama(num_hidden_layers=2 + _rank()),
                                                   load_strategy=["fsdp"])),
        ("fsdp_sync_layers_differ", lambda: _accelerate(model=tiny_llama(num_hidden_layers=2 + _rank()),
                                                        load_strategy=[("fsdp", {"sync_module_states": True})])),
        ("zero2_widths_differ", lambda: _accelerate(model=tiny_llama(intermediate_size=128 + 64 * _rank()),
                                                    load_strategy=["zero2"])),
        ("deepspeed_layers_differ", lambda: _accelerate(model=tiny_llama(num_hidden_layers=2 + _rank()),
                                                        load_strategy=[("zero2", {"use_ds_zero": True})])),
        ("tensor_layers_differ", lambda: _accelerate(model=tiny_llama(num_hidden_layers=2 + _rank()), load_strategy=[
            ("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"])),
        # the epoch's last batch with drop_last=False: 9 rows on the one data rank, 1 in the last batch
        ("pipeline_last_batch_does_not_split", lambda: _accelerate(
            dataset=TokenDataset(n=9), dataloader_args={"batch_size": 4, "drop_last": False},
            load_strategy=PIPELINE_2)),
        ("pipeline_last_batch_does_not_split_with_accumulation", lambda: _accelerate(
            dataset=TokenDataset(n=10), dataloader_args={"batch_size": 4, "drop_last": False},
            load_strategy=[("gradient_accumulation", 2), *PIPELINE_2])),
        # labels neither -100 nor in the vocabulary: the native pipeline's last stage raised IndexError while the
        # first waited in recv until the collective timeout; tensor_parallel's vocabulary-parallel loss scored such
        # a target silently wrong (its logit taken as 0)
        ("pipeline_labels_minus_one", lambda: _step_with_labels(-1, PIPELINE_2)),
        ("tensor_labels_past_the_vocabulary", lambda: _step_with_labels(5000, TENSOR_2)),
        # what the layout check missed: gloo aborted the process (SIGABRT) inside DDP's or FSDP's first collective
        ("ddp_model_bf16_on_rank_1", lambda: _accelerate(
            model=tiny_llama(seed=0).to(torch.bfloat16) if _rank() == 1 else tiny_llama(seed=0))),
        ("fsdp_mlp_frozen_on_rank_1", lambda: _accelerate(model=_frozen_mlp_on_rank_1(), load_strategy=["fsdp"])),
    ]


def _frozen_mlp_on_rank_1() -> torch.nn.Module:
    from atorch.testing import tiny_llama

    model = tiny_llama(seed=0)
    for name, p in model.named_parameters():
        if "mlp" in name and _rank() == 1:
            p.requires_grad_(False)
    return model


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


# name -> (exception type name or "status=False", text the message must contain)
EXPECTED: Dict[str, Tuple[str, str]] = {
    "ddp_unused_parameter": ("RuntimeError", "DistributedDataParallel: 2 parameters took no part in the last step's "
                                             "loss (model.unused.weight, model.unused.bias), so their gradients "
                                             "were never reduced. Make every parameter take part in the loss, freeze "
                                             "the unused ones (requires_grad=False) before auto_accelerate, or add "
                                             "('ddp', {'find_unused_parameters': True}) to the strategy"),
    "batch_not_divisible_by_data": ("BatchLayoutError", "batch_size']=3"),
    "batch_zero": ("ValueError", "batch_size']=0"),
    "chunks_not_dividing_batch": ("BatchLayoutError", "chunks=3"),
    "optim_args_unknown_key": ("ValueError", "'momentum'"),
    "dataset_shorter_than_batch": ("ValueError", "dataset has 2 samples"),
    "model_not_module": ("TypeError", "model must be a torch.nn.Module"),
    "save_strategy_missing_dir": ("ValueError", "save_strategy_to_file"),
    "strategy_file_missing": ("ValueError", "missing.json"),
    "loss_not_scalar": ("UserValueError", "loss_per_token returned a loss of shape (2, 16)"),
    "apply_value_error_on_rank_0": ("ValueError",
                                    "calling optim_func failed on rank [0]: optim_func: lr schedule table"),
    "apply_runtime_error_on_rank_1": ("status=False", ""),
    "save_under_a_file": ("ValueError", "a_file"),
    "save_fails_on_rank_1_only": ("PermissionError", "failed on rank [1]: [Errno 13] Permission denied"),
    "commit_fails_on_rank_0_only": ("OSError", "committing failed on rank [0]: [Errno 28] No space left"),
    "load_fails_on_rank_1_only": ("KeyError", "failed on rank [1]"),
    "load_optimizer_fails_on_rank_0_only": ("IndexError", "loading the model and optimizer state failed on rank [0]"),
    "load_missing_dir": ("CheckpointError", "no such checkpoint"),
    "optim_func_returns_none": ("TypeError", "returned NoneType None; it must return a torch.optim.Optimizer"),
    "optim_func_returns_none_on_rank_1": ("TypeError", "failed on rank [1]: optim_func="),
    "parallel_mode_dim_typo": ("ValueError", "dim 'dta' has size 2 but no optimization of the strategy splits"),
    "excluded_unknown_name": ("ValueError", "excluded=['fsdpx']: unknown optimization 'fsdpx'"),
    "dataset_of_ints": ("TypeError", "dataset[0] is int 0"),
    "dataset_short_on_rank_1": ("ValueError", "checking the arguments failed on rank [1]: dataset has 2 samples"),
    "strategies_differ": ("ValueError", "given different load_strategy, so they would run different collectives; "
                                        "give every rank the same. load_strategy: amp_native(bfloat16)+fsdp on rank "
                                        "[0]; fsdp on rank [1]"),
    "batch_sizes_differ": ("ValueError", "dataloader_args['batch_size']: 4 on rank [0]; 8 on rank [1]"),
    "learning_rates_differ": ("ValueError", "given different optim_args, so they would train their copies of the "
                                            "model differently (each rank's optimizer steps its own replica or "
                                            "shard); give every rank the same. optim_args: {'lr': 0.001} on rank "
                                            "[0]; {'lr': 0.1} on rank [1]"),
    "optimizers_differ": ("ValueError", "optim_func: torch.optim.adamw.AdamW on rank [0]; torch.optim.sgd.SGD on "
                                        "rank [1]"),
    "loss_func_on_rank_0_only": ("ValueError", f"loss_func: {__name__}._scaled_loss on rank [0]; None on rank [1]"),
    "pipeline_models_differ": ("ValueError", "pipeline_parallel: the model's weights differ across ranks: "
                                             "model.embed_tokens.weight and "),
    "tensor_models_differ": ("ValueError", "tensor_parallel: the model's weights differ across ranks: "
                                           "model.embed_tokens.weight and "),
    "fsdp_models_differ": ("ValueError", "fsdp: the model's weights differ across ranks: model.embed_tokens.weight "
                                         "and 15 more (checksums on ranks [0, 1]: "),
    "zero2_models_differ": ("ValueError", "or pass sync_module_states=True to broadcast data-rank 0's weights first"),
    "fsdp_layers_differ": ("ValueError", "fsdp: the model differs across ranks: parameter counts on ranks [0, 1]: "
                                         "21, 30; entry #19 (name, shape, dtype): model.norm.weight (64,) "
                                         "float32 on rank [0]; model.layers.2.self_attn.q_proj.weight (64, 64) "
                                         "float32 on rank [1]; build the same model"),
    "fsdp_sync_layers_differ": ("ValueError", "fsdp: the model differs across ranks: parameter counts on "
                                              "ranks [0, 1]: 21, 30"),
    "zero2_widths_differ": ("ValueError", "zero2: the model differs across ranks: entry #5 (name, shape, dtype): "
                                          "model.layers.0.mlp.gate_proj.weight (128, 64) float32 on rank [0]; "
                                          "model.layers.0.mlp.gate_proj.weight (192, 64) float32 on rank [1]"),
    "deepspeed_layers_differ": ("ValueError", "zero2: the model differs across ranks: parameter counts on "
                                              "ranks [0, 1]: 21, 30"),
    "tensor_layers_differ": ("ValueError", "tensor_parallel: the model differs across ranks: parameter counts"),
    "pipeline_labels_minus_one": ("UserValueError", "train_step: checking the first batch failed on ranks [0, 1]: "
                                                    "train_step: batch['labels'] holds -1, outside the vocabulary of "
                                                    "1024 (ignored positions must be -100)"),
    "tensor_labels_past_the_vocabulary": ("UserValueError", "failed on ranks [0, 1]: train_step: batch['labels'] "
                                                            "holds 5000, outside the vocabulary of 1024"),
    "ddp_model_bf16_on_rank_1": ("ValueError", "ddp: the model differs across ranks: entry #0 (name, shape, dtype): "
                                               "model.embed_tokens.weight (1024, 64) float32 on rank [0]; "
                                               "model.embed_tokens.weight (1024, 64) bfloat16 on rank [1]; build the "
                                               "same model"),
    "fsdp_mlp_frozen_on_rank_1": ("ValueError", "fsdp: the model differs across ranks: entry #5 (name, shape, dtype): "
                                                "model.layers.0.mlp.gate_proj.weight (128, 64) float32 on rank [0]; "
                                                "model.layers.0.mlp.gate_proj.weight (128, 64) float32 "
                                                "requires_grad=False on rank [1]"),
    "pipeline_last_batch_does_not_split": ("ValueError", "with dataloader_args['drop_last']=False the last batch of "
                                                         "each epoch has 1 rows per data-parallel rank (9 samples"),
    "pipeline_last_batch_does_not_split_with_accumulation": (
        "ValueError", "has 2 rows per data-parallel rank (10 samples in global batches of 4), which does not split "
                      "into chunks=2 x gradient_accumulation steps=2 micro-batches"),
}


def _run_catalogue(root: str) -> Dict[str, Dict[str, Any]]:
    from atorch import distributed as adist

    out: Dict[str, Dict[str, Any]] = {}
    for name, call in _cases(root):
        start = time.monotonic()
        try:
            value = call()
            kind, message = ("status=False", "") if isinstance(value, tuple) and value[0] is False else ("ok", "")
        except Exception as e:  # noqa: BLE001 - recorded and compared across ranks by the test
            kind, message = type(e).__name__, str(e)
        out[name] = {"kind": kind, "message": message, "seconds": time.monotonic() - start,
                     "groups": adist.is_parallel_group_created()}
        if adist.is_parallel_group_created():
            adist.destroy_parallel_group()
    return out


@pytest.mark.heavy
def test_every_rank_raises_the_same_error_naming_the_field(tmp_path):
    results = run_distributed(_run_catalogue, 2, str(tmp_path), timeout=600)
    assert set(results[0]) == set(EXPECTED)
    for name, (kind, text) in EXPECTED.items():
        got = [r[name] for r in results]
        for rank, g in enumerate(got):
            assert g["kind"] == kind, f"{name} rank {rank}: {g}"
            assert text in g["message"], f"{name} rank {rank}: {g['message']}"
            assert g["seconds"] < BOUND_S, f"{name} rank {rank} took {g['seconds']:.1f} s"
        assert got[0]["message"] == got[1]["message"], f"{name}: ranks differ: {got}"
    # A strategy file into a missing directory is refused before anything is applied.
    assert not any(r["save_strategy_missing_dir"]["groups"] for r in results)
    assert not any(r[name]["groups"] for r in results for name in ("parallel_mode_dim_typo", "dataset_of_ints"))
    # A save that failed anywhere published nothing; `latest` still names the good checkpoint.
    for failed in ("step_2", "step_3", "step_4"):
        assert not os.path.exists(tmp_path / failed)
    assert (tmp_path / "latest").read_text().strip() == "good"


def _plain_rank_env(rank: int, port: int, **extra: str) -> Dict[str, str]:
    env = dict(os.environ, **QUIET_ENV, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_PORT=str(port))
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    env.update(extra)
    return env


def test_master_port_in_use_fails_every_rank_naming_the_address():
    """Another job's store holds MASTER_PORT: rank 0 cannot listen, rank 1 reaches the wrong store; both fail."""
    import torch.distributed as dist

    port = find_free_port()
    other_job = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    code = "import atorch; atorch.init_distributed('gloo')"
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", code], env=_plain_rank_env(r, port, ATORCH_INIT_TIMEOUT="10"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    elapsed = time.monotonic() - start
    del other_job
    where = f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}"
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode != 0, err
        assert "DistributedInitError" in err and where in err, err
    assert "already in use" in outs[0][1]
    assert "only 1 of WORLD_SIZE=2 ranks joined" in outs[1][1] and "ATORCH_INIT_TIMEOUT" in outs[1][1]
    assert elapsed < BOUND_S, f"took {elapsed:.0f} s"


STALL_SCRIPT = textwrap.dedent("""
    import time, torch, torch.distributed as dist, atorch
    atorch.init_distributed("gloo")
    t = torch.ones(8)
    dist.all_reduce(t)                      # both ranks arrive
    if dist.get_rank() == 1:
        time.sleep(600)                     # rank 1 stalls before the next collective
    dist.all_reduce(t)                      # rank 0 waits here for ATORCH_COLLECTIVE_TIMEOUT
""")


@pytest.mark.heavy
def test_a_stalled_rank_ends_the_job_naming_the_collective_and_the_missing_rank(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(STALL_SCRIPT)
    env = dict(os.environ, **QUIET_ENV, ATORCH_COLLECTIVE_TIMEOUT="10")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "atorch.distributed.run", "--nproc_per_node", "2", str(script)],
                         capture_output=True, text=True, timeout=300, env=env)
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    log = out.stdout + out.stderr
    assert "CollectiveTimeoutError: rank 0: collective gloo:all_reduce (sequence number 2" in log, log[-3000:]
    assert "ATORCH_COLLECTIVE_TIMEOUT=10 s; rank(s) [1] did not arrive" in log, log[-3000:]
    assert elapsed < 240, f"took {elapsed:.0f} s"   # 10 s timeout + roll call + launcher teardown, under load


# -- what decides a rank's samples and a step's collectives, given differently on each rank ---------------------
# Before, these ran on silently (shuffle seeds: overlapping samples) or hung until the collective timeout
# (drop_last: a step only one rank runs; train_step options under FSDP).

class _OwnSampler(torch.utils.data.DistributedSampler):
    """A sampler class of the user's (distributed_sampler_cls)."""


def _epoch(**step_options: Any) -> List[float]:
    from atorch.auto import train_step

    status, result, _ = _accelerate(load_strategy=step_options.pop("load_strategy", ["parallel_mode"]))
    assert status
    return [float(train_step(result, batch, **step_options)) for batch in result.dataloader]


def _per_rank_cases() -> List[Tuple[str, Callable[[], Any]]]:
    from atorch.testing.parity import TokenDataset

    rank = _rank()
    return [
        ("seeds_differ", lambda: _accelerate(dataloader_args={"batch_size": 4, "shuffle": True, "seed": rank})),
        ("shuffle_on_rank_0_only", lambda: _accelerate(dataloader_args={"batch_size": 4, "shuffle": rank == 0})),
        ("drop_last_differs", lambda: _accelerate(dataset=TokenDataset(n=18),
                                                  dataloader_args={"batch_size": 4, "drop_last": rank == 0})),
        ("sampler_cls_on_rank_1_only", lambda: _accelerate(distributed_sampler_cls=_OwnSampler if rank else None)),
        ("accumulation_differs_ddp", lambda: _epoch(gradient_accumulation_steps=2 if rank == 0 else 1)),
        ("clipping_on_rank_0_only_fsdp", lambda: _epoch(max_grad_norm=1.0 if rank == 0 else None,
                                                        load_strategy=["parallel_mode", "fsdp"])),
        # what may differ: how a rank loads its samples, and a seed that nothing reads (no shuffling)
        ("loading_differs", lambda: _accelerate(dataloader_args={"batch_size": 4, "seed": rank,
                                                                 "pin_memory": rank == 0})[0]),
    ]


_SAMPLER = "sampler (dataloader_args shuffle/seed/drop_last, distributed_sampler_cls): "
_DEFAULT = "torch.utils.data.distributed.DistributedSampler"
PER_RANK_EXPECTED: Dict[str, str] = {
    "seeds_differ": f"{_SAMPLER}{_DEFAULT}(shuffle=True, seed=0, drop_last=True) on rank [0]; "
                    f"{_DEFAULT}(shuffle=True, seed=1, drop_last=True) on rank [1] (these decide which samples",
    "shuffle_on_rank_0_only": f"{_SAMPLER}{_DEFAULT}(shuffle=True, seed=0, drop_last=True) on rank [0]; "
                              f"{_DEFAULT}(shuffle=False, drop_last=True) on rank [1]",
    "drop_last_differs": f"{_SAMPLER}{_DEFAULT}(shuffle=False, drop_last=True) on rank [0]; "
                         f"{_DEFAULT}(shuffle=False, drop_last=False) on rank [1]",
    "sampler_cls_on_rank_1_only": f"{_SAMPLER}{_DEFAULT}(shuffle=False, drop_last=True) on rank [0]; "
                                  "test_bad_inputs_distributed._OwnSampler(shuffle=False, seed=0, drop_last=True) on "
                                  "rank [1]",
    "accumulation_differs_ddp": "train_step: the ranks were given different gradient_accumulation_steps, so they "
                                "would run different collectives; give every rank the same. "
                                "gradient_accumulation_steps: 2 on rank [0]; 1 on rank [1]",
    "clipping_on_rank_0_only_fsdp": "max_grad_norm: 1.0 on rank [0]; None on rank [1]",
}


def _run_per_rank_cases() -> Dict[str, Dict[str, Any]]:
    from atorch import distributed as adist

    out: Dict[str, Dict[str, Any]] = {}
    for name, call in _per_rank_cases():
        start = time.monotonic()
        try:
            kind, message = "returned", repr(call())[:200]
        except Exception as e:  # noqa: BLE001 - recorded and compared across ranks by the test
            kind, message = type(e).__name__, str(e)
        out[name] = {"kind": kind, "message": message, "seconds": time.monotonic() - start}
        if adist.is_parallel_group_created():
            adist.destroy_parallel_group()
    return out


def test_sampler_settings_and_step_options_given_differently_per_rank_raise_the_same_error_everywhere():
    results = run_distributed(_run_per_rank_cases, 2, timeout=120)
    assert set(results[0]) == set(PER_RANK_EXPECTED) | {"loading_differs"}
    for name, text in PER_RANK_EXPECTED.items():
        got = [r[name] for r in results]
        for rank, g in enumerate(got):
            assert g["kind"] == "ValueError", f"{name} rank {rank}: {g}"
            assert text in g["message"], f"{name} rank {rank}: {g['message']}"
            assert g["seconds"] < BOUND_S, f"{name} rank {rank} took {g['seconds']:.1f} s"
        assert got[0]["message"] == got[1]["message"], f"{name}: ranks differ: {got}"
    assert [(r["loading_differs"]["kind"], r["loading_differs"]["message"]) for r in results] == \
        [("returned", "True")] * 2


def _load_with_a_stale_optimizer_on_rank_1(root: str) -> Dict[str, Any]:
    """Both ranks save a replicated tiny Llama with its optimizer; then rank 1 loads with an optimizer built over
    another model's parameters (the model rebuilt after the optimizer was created), rank 0 with its own."""
    from atorch.checkpoint import load_checkpoint, save_checkpoint
    from atorch.testing import tiny_llama

    model = tiny_llama(seed=0)
    ckpt = save_checkpoint(model, os.path.join(root, "step_1"), optimizer=torch.optim.AdamW(model.parameters()))
    target = tiny_llama(seed=1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    optimizer = torch.optim.AdamW((tiny_llama(seed=1) if _rank() == 1 else target).parameters())
    start = time.monotonic()
    try:
        load_checkpoint(target, ckpt, optimizer=optimizer)
        kind, message = "ok", ""
    except Exception as e:  # noqa: BLE001 - compared across ranks by the test
        kind, message = type(e).__name__, str(e)
    return {"kind": kind, "message": message, "seconds": time.monotonic() - start,
            "unchanged": all(torch.equal(v, before[k]) for k, v in target.state_dict().items())}


def test_an_optimizer_over_another_model_on_one_rank_is_refused_on_every_rank_before_loading(tmp_path):
    """torch's state-dict code raised a bare `KeyError: 0` on that rank only, inside the load's collectives."""
    results = run_distributed(_load_with_a_stale_optimizer_on_rank_1, 2, str(tmp_path), timeout=120)
    for rank, r in enumerate(results):
        assert r["kind"] == "ValueError", f"rank {rank}: {r}"
        assert "load_checkpoint: checking the arguments failed on rank [1]: load_checkpoint: the optimizer holds " \
               "21 parameter(s) that are not the model's" in r["message"], r["message"]
        assert "build the optimizer from the model you load into" in r["message"]
        assert r["seconds"] < BOUND_S and r["unchanged"], r
    assert results[0]["message"] == results[1]["message"]
