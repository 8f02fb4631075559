"""A catalogue of user mistakes that one process can check: each raises the documented exception type,
with a message naming the argument (flag, environment variable, file) at fault, at once.

The distributed half (every rank raises the same, nobody waits) is tests/distributed/test_bad_inputs.py.
Each case is a callable that must raise; the time bound is generous (these are pure checks that take
milliseconds; seconds would mean a network wait or a model being built).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path
from typing import Callable, List, NamedTuple, Type

import pytest
import torch
from torch import nn

from atorch.auto.arguments import check_loss, check_optimizer, validate_arguments, validate_batch_layout
from atorch.auto.compat import drop_atorch_only_names, translate_atorch_kwargs
from atorch.auto.dry_runner import DryRunConfig
from atorch.auto.opt_lib.base import ValidationContext
from atorch.auto.model_context import ModelContext, call_model
from atorch.auto.opt_lib.resolve import plan, resolve_strategy
from atorch.auto.result import AutoAccelerateResult
from atorch.auto.search.auto_search import SearchSettings
from atorch.auto.search.space import SearchSpace
from atorch.auto.strategy import Strategy
from atorch.auto.train_step import clip_grad_norm_, train_step
from atorch.checkpoint import CheckpointError, load_checkpoint, merge_checkpoint, save_checkpoint
from atorch.data import DatasetForCausalLM
from atorch.data.preprocess import DatasetPreprocessor
from atorch.distributed import process_group as ddist
from atorch.distributed import launch as old_launcher
from atorch.distributed import run as launcher
from atorch.distributed import timeouts
from atorch.testing import tiny_gpt2, tiny_llama
from atorch.testing.assets import load_tokenizer
from atorch.testing.parity import TokenDataset
from atorch.tensor_parallel.layers import TensorParallelModule
from atorch.utils.manual_tp_utils import TPInfo
from atorch.utils.trackers import MetricsLogger
from atorch.utils.tp_checks import check_tp_suffixes

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 10.0   # generous: every case is a pure check


class Case(NamedTuple):
    name: str
    call: Callable[[Path], object]
    exc: Type[BaseException]
    names: str          # what the message must contain (the field at fault)


_LLAMA = tiny_llama()
_GPT2 = tiny_gpt2()
_RESULT = AutoAccelerateResult(model=nn.Linear(2, 2), optim=None, dataloader=None, loss_func=check_loss,
                               prepare_input=lambda batch, device: batch)


def _args(**overrides):
    """validate_arguments with a valid baseline and `overrides` applied."""
    kwargs = dict(model=_LLAMA, optim_func=torch.optim.AdamW, dataset=TokenDataset(), optim_args={"lr": 1e-3},
                  dataloader_args={"batch_size": 4})
    kwargs.update(overrides)
    return lambda tmp: validate_arguments(**kwargs)


def _frozen(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class _Iterable(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([])


def _launch(*argv: str) -> Callable[[Path], object]:
    def call(tmp: Path) -> None:
        args = list(argv)
        launcher.translate_args(args)
        launcher.check_environment(args)
    return call


def _env(monkeypatch_env: dict, fn: Callable[[], object]) -> Callable[[Path], object]:
    def call(tmp: Path) -> object:
        saved = {k: os.environ.get(k) for k in monkeypatch_env}
        os.environ.update(monkeypatch_env)
        try:
            return fn()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return call


def _strategy_file(text: bytes) -> Callable[[Path], object]:
    def call(tmp: Path) -> object:
        path = tmp / "strategy.bin"
        path.write_bytes(text)
        return Strategy.from_any(str(path))
    return call


def _save_under_file(tmp: Path) -> None:
    (tmp / "a_file").write_text("x")
    save_checkpoint(nn.Linear(2, 2), str(tmp / "a_file" / "step_1"))


def _save_onto_file(tmp: Path) -> None:
    (tmp / "step_1").write_text("x")
    save_checkpoint(nn.Linear(2, 2), str(tmp / "step_1"))


def _save_onto_user_files(tmp: Path) -> None:
    (tmp / "out" / "sub").mkdir(parents=True)
    (tmp / "out" / "notes.txt").write_text("precious")
    try:
        save_checkpoint(nn.Linear(2, 2), str(tmp / "out"))
    finally:   # the check must have kept them (the commit used to replace the whole directory)
        assert (tmp / "out" / "notes.txt").read_text() == "precious"


def _gpt2_c_proj(tmp: Path) -> None:
    check_tp_suffixes(_GPT2, TPInfo().shard_col("c_fc").shard_row("c_proj"))


def _two_roles(tmp: Path) -> None:
    check_tp_suffixes(_GPT2, TPInfo().shard_col("mlp.c_fc").shard_row("h.0.mlp.c_fc"))


def _example_args(**overrides) -> Callable[[Path], object]:
    def call(tmp: Path) -> None:
        sys.path.insert(0, str(REPO / "examples" / "llama2"))
        import example_utils as eu

        args = eu.common_parser("x").parse_args([])
        for k, v in overrides.items():
            setattr(args, k, v)
        eu.validate_common_args(args)
    return call


def _no_optimizer(params, lr):
    return None


def _resolve(items) -> Callable[[Path], object]:
    return lambda tmp: resolve_strategy(Strategy(items), ValidationContext(4, model=_LLAMA,
                                                                           model_config=_LLAMA.config))


def _a_file(tmp: Path) -> str:
    path = tmp / "a_file"
    path.write_text("x")
    return str(path)


def _corpus(tmp: Path) -> str:
    """A tiny preprocessed corpus under tmp; returns its prefix."""
    prefix = tmp / "corpus"
    DatasetPreprocessor(load_tokenizer()).preprocess([f"document {i} " * 8 for i in range(20)], str(prefix),
                                                    progress_enabled=False)
    return str(prefix)


def _truncated_index(tmp: Path, size: int) -> object:
    prefix = _corpus(tmp)
    os.truncate(prefix + ".idx", size)
    return DatasetForCausalLM(prefix, 16)


CASES: List[Case] = [
    # auto_accelerate's arguments (atorch.auto.arguments.validate_arguments)
    Case("model_not_module", _args(model="llama"), TypeError, "model must be a torch.nn.Module"),
    Case("optim_func_not_callable", _args(optim_func="adamw"), TypeError, "optim_func"),
    Case("optim_args_unknown_key", _args(optim_args={"lr": 1e-3, "beta": 0.9}), ValueError, "'beta'"),
    Case("optim_args_without_optim_func", _args(optim_func=None), ValueError, "optim_args"),
    Case("loss_func_not_callable", _args(loss_func=1.0), TypeError, "loss_func"),
    Case("prepare_input_not_callable", _args(prepare_input="cuda"), TypeError, "prepare_input"),
    Case("loss_func_of_one_argument", _args(loss_func=lambda output: output.loss), TypeError,
         "cannot be called as loss_func(batch, model_output)"),
    Case("prepare_input_of_one_argument", _args(prepare_input=lambda batch: batch), TypeError,
         "cannot be called as prepare_input(batch, device)"),
    Case("optim_args_lr_a_string", _args(optim_args={"lr": "1e-3"}), TypeError,
         "optim_args['lr']='1e-3' is a string"),
    Case("optim_param_func_not_callable", _args(optim_param_func=[]), TypeError, "optim_param_func"),
    Case("batch_size_zero", _args(dataloader_args={"batch_size": 0}), ValueError, "batch_size']=0"),
    Case("batch_size_negative", _args(dataloader_args={"batch_size": -8}), ValueError, "batch_size']=-8"),
    Case("batch_size_float", _args(dataloader_args={"batch_size": 8.0}), TypeError, "batch_size']=8.0"),
    Case("dataloader_args_not_dict", _args(dataloader_args=[("batch_size", 4)]), TypeError, "dataloader_args"),
    Case("dataloader_args_unknown_key", _args(dataloader_args={"batch_size": 4, "num_worker": 2}), ValueError,
         "'num_worker'"),
    Case("dataloader_args_sampler", _args(dataloader_args={"batch_size": 4, "sampler": None}), ValueError,
         "'sampler'"),
    Case("dataset_shorter_than_batch", _args(dataset=TokenDataset(n=3)), ValueError, "dataset has 3 samples"),
    Case("dataset_empty", _args(dataset=TokenDataset(n=0)), ValueError, "dataset has 0 samples"),
    Case("dataset_iterable", _args(dataset=_Iterable()), TypeError, "map-style dataset"),
    Case("sequence_longer_than_llama_positions", _args(dataset=TokenDataset(seq_len=300)), ValueError,
         "max_position_embeddings=256"),
    Case("sequence_longer_than_gpt2_positions", _args(model=_GPT2, dataset=TokenDataset(seq_len=257)), ValueError,
         "n_positions=256"),
    Case("save_strategy_missing_dir", lambda tmp: validate_arguments(
        model=_LLAMA, save_strategy_to_file=str(tmp / "no" / "s.json")), ValueError, "save_strategy_to_file"),
    Case("save_strategy_is_dir", lambda tmp: validate_arguments(model=_LLAMA, save_strategy_to_file=str(tmp)),
         ValueError, "save_strategy_to_file"),
    Case("report_path_missing_dir", lambda tmp: validate_arguments(
        model=_LLAMA, report_path=str(tmp / "no" / "r.csv")), ValueError, "report_path"),
    Case("lr_scheduler_args_unknown_key", _args(lr_scheduler_cls=torch.optim.lr_scheduler.StepLR,
                                                lr_scheduler_args={"step_size": 1, "gama": 0.5}),
         ValueError, "'gama'"),
    Case("lr_scheduler_cls_not_callable", _args(lr_scheduler_cls="cosine"), TypeError, "lr_scheduler_cls"),
    Case("lr_scheduler_without_optimizer", _args(optim_func=None, optim_args=None,
                                                 lr_scheduler_cls=torch.optim.lr_scheduler.StepLR,
                                                 lr_scheduler_args={"step_size": 1}), ValueError,
         "lr_scheduler_cls"),
    Case("lr_scheduler_args_without_cls", _args(lr_scheduler_args={"step_size": 1}), ValueError,
         "lr_scheduler_args={'step_size': 1} were given without lr_scheduler_cls"),
    # train_step's first call raised torch's bare "step() missing 1 required positional argument: 'metrics'"
    Case("lr_scheduler_on_a_metric", _args(lr_scheduler_cls=torch.optim.lr_scheduler.ReduceLROnPlateau),
         ValueError, r"lr_scheduler_cls=ReduceLROnPlateau steps on a metric"),
    # /proc: os.access says writable to root, yet no file can be created there
    Case("save_strategy_into_proc", _args(save_strategy_to_file="/proc/strategy.json"), ValueError,
         "save_strategy_to_file='/proc/strategy.json'"),
    Case("optim_param_func_foreign_parameter", _args(optim_param_func=lambda m: [nn.Parameter(torch.ones(2))]),
         ValueError, "returned 1 tensor(s) that are not parameters of the model (the first: Parameter of shape (2,))"),
    Case("excluded_a_string", _args(excluded="fsdp"), TypeError, "excluded"),
    Case("model_without_parameters", _args(model=nn.ReLU(), dataset=None), ValueError, "no parameters"),
    # once the strategy is known
    Case("batch_not_divisible_by_data", lambda tmp: validate_batch_layout({"batch_size": 6}, {"data": 4}),
         ValueError, "batch_size']=6"),
    Case("chunks_not_dividing_batch", lambda tmp: validate_batch_layout(
        {"batch_size": 8}, {"data": 2, "pipeline": 2}, pipeline_chunks=3), ValueError, "chunks=3"),
    Case("unknown_optimization", lambda tmp: resolve_strategy(Strategy(["fdsp"]), ValidationContext(1)),
         ValueError, "'fdsp'"),
    Case("strategy_file_missing", lambda tmp: Strategy.from_any(str(tmp / "missing.json")), ValueError,
         "missing.json"),
    Case("strategy_file_not_json", _strategy_file(b"parallel_mode, fsdp"), ValueError, "JSON"),
    Case("strategy_file_a_pickle", _strategy_file(pickle.dumps({"evil": print})), ValueError, "strategy.bin"),
    Case("strategy_json_item_key_typo", lambda tmp: Strategy.from_json(
        '{"format": "atorch.strategy/1", "items": [{"name": "amp_native", "cfg": {"dtype": "fp16"}}]}'),
        ValueError, "unknown key(s) 'cfg' (did you mean 'config'?)"),
    Case("strategy_of_a_string", lambda tmp: Strategy("fsdp"), TypeError, "Strategy(['fsdp'])"),
    Case("parallel_size_a_string", lambda tmp: resolve_strategy(
        Strategy([("parallel_mode", ([("data", "1")], None))]), ValidationContext(1)), ValueError,
        "the size of 'data' is '1' (str)"),
    Case("ddp_bucket_nan", lambda tmp: resolve_strategy(Strategy([("ddp", {"bucket_cap_mb": float("nan")})]),
                                                        ValidationContext(2)), ValueError, "bucket_cap_mb=nan"),
    Case("finetune_strategy_not_a_bool", lambda tmp: translate_atorch_kwargs(load_strategy=["fsdp"],
                                                                             finetune_strategy="no"),
         TypeError, "finetune_strategy='no'"),
    Case("every_parameter_frozen", lambda tmp: ModelContext(model=_frozen(nn.Linear(2, 2))).optim_params(),
         ValueError, "Linear has no trainable parameter (all 2 parameter tensors have requires_grad=False"),
    # the loss and tensor parallelism
    Case("loss_not_scalar", lambda tmp: check_loss(torch.ones(4, 16), lambda b, o: None), ValueError,
         "shape (4, 16)"),
    Case("loss_not_tensor", lambda tmp: check_loss(0.5, None), TypeError, "loss_func=None"),
    Case("tp_suffix_ambiguous_c_proj", _gpt2_c_proj, ValueError, "'transformer.h.0.attn.c_proj'"),
    Case("tp_module_two_roles", _two_roles, ValueError, "'h.0.mlp.c_fc'"),
    # the launcher (atorch.distributed.run): usage errors naming the flag
    Case("launcher_nproc_zero", _launch("--nproc_per_node", "0", "job.py"), ValueError, "--nproc_per_node='0'"),
    Case("launcher_nproc_word", _launch("--nproc_per_node", "two", "job.py"), ValueError, "--nproc_per_node='two'"),
    Case("launcher_nnodes_zero", _launch("--nnodes", "0", "job.py"), ValueError, "--nnodes='0'"),
    Case("launcher_node_rank_outside", _launch("--nnodes", "2", "--node_rank", "2", "job.py"), ValueError,
         "--node_rank='2'"),
    Case("launcher_port_range", _launch("--master_port", "70000", "job.py"), ValueError, "--master_port=70000"),
    Case("launcher_max_restarts_negative", _launch("--max_restarts", "-1", "job.py"), ValueError,
         "--max_restarts=-1"),
    Case("launcher_script_without_py", _launch("--nproc_per_node", "2", "train"), ValueError,
         "no training script in ['--nproc_per_node', '2', 'train']: give the script (a file ending in .py"),
    Case("launcher_missing_script", _launch("--nproc_per_node", "2", "no_such_job.py"), ValueError,
         "'no_such_job.py'"),
    Case("atorch_launcher_world_size_env", _env({"WORLD_SIZE": "two"}, lambda: old_launcher.to_run_args(
        old_launcher.parse_args(["job.py"]))), ValueError, "WORLD_SIZE='two' (read because --nnodes was not given)"),
    Case("launcher_bad_collective_timeout", _env({"ATORCH_COLLECTIVE_TIMEOUT": "ten"},
                                                 lambda: timeouts.collective_timeout()),
         ValueError, "ATORCH_COLLECTIVE_TIMEOUT='ten'"),
    Case("launcher_bad_init_timeout", _env({"ATORCH_INIT_TIMEOUT": "-5"}, lambda: timeouts.init_timeout()),
         ValueError, "ATORCH_INIT_TIMEOUT='-5'"),
    # the environment init_distributed reads
    Case("env_rank_not_below_world", _env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "1234"},
                                          ddist._rendezvous_env), ValueError, "RANK=2"),
    Case("env_master_port_not_int", _env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "http"},
                                         ddist._rendezvous_env), ValueError, "MASTER_PORT='http'"),
    Case("env_world_size_zero", _env({"RANK": "0", "WORLD_SIZE": "0", "MASTER_PORT": "1234"},
                                     ddist._rendezvous_env), ValueError, "WORLD_SIZE='0'"),
    Case("init_unknown_backend", lambda tmp: ddist.init_distributed("mpi"), ValueError, "backend='mpi'"),
    # checkpoints
    Case("save_under_a_file", _save_under_file, ValueError, "a_file"),
    Case("save_onto_a_file", _save_onto_file, ValueError, "is an existing file"),
    Case("save_onto_a_directory_of_other_files", _save_onto_user_files, ValueError,
         "is an existing directory that is not a checkpoint (it holds ['notes.txt', 'sub'])"),
    Case("save_keep_last_zero", lambda tmp: save_checkpoint(nn.Linear(2, 2), str(tmp / "c"), keep_last=0),
         ValueError, "keep_last=0"),
    Case("load_missing_dir", lambda tmp: load_checkpoint(nn.Linear(2, 2), str(tmp / "nothing")), CheckpointError,
         "no such checkpoint"),
    # found by the bad-input sweep: silently accepted, or obscure, before
    Case("optim_func_returns_none", lambda tmp: check_optimizer(None, _no_optimizer), TypeError,
         "optim_func=_no_optimizer returned NoneType None"),
    Case("optim_func_returns_module", lambda tmp: check_optimizer(nn.Linear(1, 1), _no_optimizer), TypeError,
         "must return a torch.optim.Optimizer"),
    Case("dataset_of_ints_for_unpack_dict", _args(dataset=list(range(16)), model_input_format="unpack_dict"),
         TypeError, "dataset[0] is int 0"),
    Case("dataset_of_dicts_for_unpack_sequence", _args(model_input_format="unpack_sequence"), TypeError,
         "model_input_format='unpack_sequence'"),
    Case("dataloader_shuffle_a_string", _args(dataloader_args={"batch_size": 4, "shuffle": "yes"}), TypeError,
         "dataloader_args['shuffle']='yes'"),
    Case("dataloader_seed_a_string", _args(dataloader_args={"batch_size": 4, "seed": "abc"}), TypeError,
         "dataloader_args['seed']='abc'"),
    Case("dataloader_collate_fn_not_callable", _args(dataloader_args={"batch_size": 4, "collate_fn": "pad"}),
         TypeError, "dataloader_args['collate_fn']='pad' must be callable"),
    Case("dataloader_num_workers_negative", _args(dataloader_args={"batch_size": 4, "num_workers": -1}), ValueError,
         "dataloader_args['num_workers']=-1"),
    Case("excluded_unknown_name", lambda tmp: SearchSpace.default_for(_LLAMA, 2).restricted(excluded=["fsdpx"]),
         ValueError, "excluded=['fsdpx']: unknown optimization 'fsdpx'"),
    Case("included_unknown_name", lambda tmp: SearchSpace.default_for(_LLAMA, 2).restricted(included=["ckpt"]),
         ValueError, "included=['ckpt']: unknown optimization 'ckpt'"),
    Case("parallel_mode_dim_typo", _resolve([("parallel_mode", ([("data", 2), ("dta", 2)], None))]), ValueError,
         "dim 'dta' has size 2 but no optimization of the strategy splits over it"),
    Case("tensor_dim_without_tensor_parallel", _resolve([("parallel_mode", ([("tensor", 2), ("data", 2)], None)),
                                                         "fsdp"]), ValueError,
         "its 2 ranks would repeat the same work: add deepspeed_3d_parallel or tensor_parallel"),
    Case("pipeline_dim_without_pipeline_parallel", _resolve([("parallel_mode", ([("data", 2), ("pipeline", 2)],
                                                                                None))]), ValueError,
         "dim 'pipeline' has size 2"),
    Case("fsdp_wrap_cls_unknown", _resolve([("fsdp", {"wrap_cls": ["LlamaBlock"]})]), ValueError,
         "fsdp: wrap_cls: class 'LlamaBlock' is not in the model"),
    Case("zero2_wrap_cls_unknown", _resolve([("zero2", {"wrap_cls": ["LlamaBlock"]})]), ValueError,
         "zero2: wrap_cls: class 'LlamaBlock'"),
    Case("module_replace_flag_a_string", _resolve([("module_replace", {"attention": "no"})]), ValueError,
         "module_replace: attention='no' must be True or False"),
    Case("tensor_parallel_flag_a_string", _resolve([("parallel_mode", ([("tensor", 2), ("data", 2)], None)),
                                                    ("tensor_parallel", {"per_block_init": "no"})]), ValueError,
         "tensor_parallel: per_block_init='no' must be True or False"),
    Case("pipeline_parallel_flag_a_string", _resolve([("parallel_mode", ([("data", 2), ("pipeline", 2)], None)),
                                                      ("pipeline_parallel", {"tie_first": "no"})]), ValueError,
         "pipeline_parallel: tie_first='no' must be True or False"),
    Case("strategy_file_a_directory", lambda tmp: Strategy.from_any(str(tmp)), ValueError, "is a directory"),
    Case("strategy_file_empty", _strategy_file(b"\n"), ValueError, "strategy.bin' is empty"),
    Case("strategy_file_a_json_list", _strategy_file(b'["parallel_mode", "fsdp"]'), ValueError,
         "is a JSON list; a strategy file is an object"),
    Case("strategy_file_without_items", _strategy_file(b'{"format": "atorch.strategy/1"}'), ValueError,
         "'items' must be a list"),
    Case("strategy_file_items_of_strings", _strategy_file(b'{"format": "atorch.strategy/1", "items": ["fsdp"]}'),
         ValueError, "items[0]='fsdp' must be an object with a string 'name'"),
    Case("strategy_file_unknown_class", _strategy_file(
        b'{"format": "atorch.strategy/1", "items": [{"name": "fsdp", "config": {"wrap_cls": '
        b'[{"__class__": "transformers:NoSuchLayer"}]}}]}'), ValueError,
         "items[0].config.wrap_cls[0]: class 'transformers:NoSuchLayer' cannot be imported"),
    Case("strategy_file_class_not_a_class", _strategy_file(
        b'{"format": "atorch.strategy/1", "items": [{"name": "fsdp", "config": {"wrap_cls": '
        b'[{"__class__": "os:system"}]}}]}'), ValueError, "'os:system' is a builtin_function_or_method, not a class"),
    Case("env_float_nan", _env({"ATORCH_DRYRUN_TIMEOUT": "nan"}, DryRunConfig.from_env), ValueError,
         "ATORCH_DRYRUN_TIMEOUT='nan' must be a finite number"),
    Case("env_timeout_inf", _env({"ATORCH_COLLECTIVE_TIMEOUT": "inf"}, lambda: timeouts.collective_timeout()),
         ValueError, "ATORCH_COLLECTIVE_TIMEOUT='inf'"),
    Case("env_search_time_limit_negative", _env({"ATORCH_SEARCH_TIME_LIMIT": "-5"}, SearchSettings.from_env),
         ValueError, "ATORCH_SEARCH_TIME_LIMIT=-5.0"),
    Case("env_random_sample_negative", _env({"RANDOM_SAMPLE": "-1"}, SearchSettings.from_env), ValueError,
         "RANDOM_SAMPLE=-1 must be >= 0 (spread-out candidates tried first)"),
    Case("env_device_memory_limit_negative", _env({"ATORCH_DEVICE_MEMORY_LIMIT": "-1"}, SearchSettings.from_env),
         ValueError, "ATORCH_DEVICE_MEMORY_LIMIT=-1"),
    Case("env_device_memory_limit_word", _env({"ATORCH_DEVICE_MEMORY_LIMIT": "abc"}, SearchSettings.from_env),
         ValueError, "ATORCH_DEVICE_MEMORY_LIMIT='abc'"),
    Case("env_search_cache_a_directory", lambda tmp: _env({"ATORCH_SEARCH_CACHE": str(tmp)},
                                                          SearchSettings.from_env)(tmp), ValueError,
         "ATORCH_SEARCH_CACHE="),
    Case("env_search_cache_under_a_file", lambda tmp: _env({"ATORCH_SEARCH_CACHE": _a_file(tmp) + "/cache.json"},
                                                           SearchSettings.from_env)(tmp), ValueError,
         "is a file, so a file cannot be created under it"),
    Case("env_search_report_dir_a_file", lambda tmp: _env({"ATORCH_SEARCH_REPORT_DIR": _a_file(tmp)},
                                                          SearchSettings.from_env)(tmp), ValueError,
         "ATORCH_SEARCH_REPORT_DIR="),
    Case("env_scratch_dir_a_file", lambda tmp: _env({"ATORCH_DRYRUN_SCRATCH_DIR": _a_file(tmp)},
                                                    DryRunConfig.from_env)(tmp), ValueError,
         "ATORCH_DRYRUN_SCRATCH_DIR="),
    Case("save_keep_last_a_string", lambda tmp: save_checkpoint(nn.Linear(2, 2), str(tmp / "c"), keep_last="3"),
         ValueError, "keep_last='3'"),
    Case("save_optimizer_not_an_optimizer", lambda tmp: save_checkpoint(nn.Linear(2, 2), str(tmp / "c"),
                                                                        optimizer="adam"), TypeError,
         "optimizer='adam' must be the torch.optim.Optimizer"),
    Case("load_path_none", lambda tmp: load_checkpoint(nn.Linear(2, 2), None), TypeError, "path=None"),
    Case("merge_dtype_a_string", lambda tmp: merge_checkpoint(str(tmp / "ckpt"), str(tmp / "hf"), dtype="bf16"),
         TypeError, "dtype='bf16' must be a floating torch.dtype"),
    Case("merge_dtype_integer", lambda tmp: merge_checkpoint(str(tmp / "ckpt"), str(tmp / "hf"), dtype=torch.int8),
         TypeError, "dtype=torch.int8"),
    Case("merge_model_class_a_string", lambda tmp: merge_checkpoint(str(tmp / "ckpt"), str(tmp / "hf"),
                                                                    model_class="LlamaForCausalLM"), TypeError,
         "model_class='LlamaForCausalLM' must be a class"),
    Case("merge_out_dir_a_file", lambda tmp: merge_checkpoint(str(tmp / "ckpt"), _a_file(tmp)), ValueError,
         "is an existing file"),
    # the training loop and tools
    Case("train_step_without_a_result", lambda tmp: train_step(None, {"input_ids": torch.zeros(2, 4)}), TypeError,
         "train_step: result must be the AutoAccelerateResult"),
    Case("clip_grad_norm_negative", lambda tmp: clip_grad_norm_(_RESULT, -1.0), ValueError,
         "clip_grad_norm_: max_norm=-1.0 must be a number > 0"),
    Case("batch_not_a_dict_for_unpack_dict", lambda tmp: call_model(_LLAMA, None, "unpack_dict"), TypeError,
         "model(**batch), but the batch is a NoneType"),
    Case("batch_a_dict_for_unpack_sequence", lambda tmp: call_model(_LLAMA, {"input_ids": 1}, "unpack_sequence"),
         TypeError, "model(*batch), but the batch is a dict"),
    Case("plan_world_size_a_string", lambda tmp: plan(Strategy(["fsdp"]), world_size="2"), ValueError,
         "plan: world_size='2' must be an int >= 1"),
    Case("metrics_log_dir_a_file", lambda tmp: MetricsLogger(_a_file(tmp), enabled=True), ValueError,
         "log_dir=", ),
    # the data pipeline
    Case("index_truncated_inside_header", lambda tmp: _truncated_index(tmp, 30), ValueError,
         "is truncated: 30 bytes, shorter than its 34-byte header"),
    Case("index_empty", lambda tmp: _truncated_index(tmp, 0), ValueError, "is empty (0 bytes)"),
    Case("dataset_max_seq_length_float", lambda tmp: DatasetForCausalLM(_corpus(tmp), 16.5), ValueError,
         "max_seq_length must be an int >= 2 (a sample of one token has no next token to predict), got 16.5"),
    Case("dataset_seed_a_string", lambda tmp: DatasetForCausalLM(_corpus(tmp), 16, seed="x"), ValueError,
         "seed must be None (file order) or an int >= 0, got 'x'"),
    Case("dataset_eod_negative", lambda tmp: DatasetForCausalLM(_corpus(tmp), 16, eod_token_id=-1), ValueError,
         "eod_token_id must be None or a token id >= 0, got -1"),
    Case("dataset_eod_beyond_token_dtype", lambda tmp: DatasetForCausalLM(_corpus(tmp), 16, eod_token_id=70000),
         ValueError, "eod_token_id=70000 does not fit the uint16 tokens"),
    Case("preprocessor_missing_tokenizer_dir", lambda tmp: DatasetPreprocessor(str(tmp / "no_tokenizer")),
         FileNotFoundError, "no_tokenizer' is not a directory"),
    Case("preprocessor_tokenizer_an_int", lambda tmp: DatasetPreprocessor(5), TypeError, "got int 5"),
    Case("preprocessor_chunk_size_a_string", lambda tmp: DatasetPreprocessor(load_tokenizer(), chunk_size="5"),
         ValueError, "chunk_size must be an int >= 1, got '5'"),
    # the example scripts' arguments (their environment variables become these flags)
    Case("example_max_steps_zero", _example_args(max_steps=0), ValueError, "--max_steps=0"),
    Case("example_save_steps_negative", _example_args(save_steps=-1), ValueError, "--save_steps=-1"),
]



def test_the_catalogue_is_large_enough():
    assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_bad_input_raises_naming_the_field(case: Case, tmp_path: Path):
    start = time.monotonic()
    with pytest.raises(case.exc) as info:
        case.call(tmp_path)
    elapsed = time.monotonic() - start
    assert case.names in str(info.value), f"{case.name}: {info.value}"
    assert elapsed < BOUND_S, f"{case.name} took {elapsed:.1f} s"


def test_ambiguous_tp_message_names_both_modules_and_their_shapes():
    with pytest.raises(ValueError) as info:
        check_tp_suffixes(_GPT2, TPInfo().shard_row("c_proj"))
    text = str(info.value)
    assert "'transformer.h.0.attn.c_proj'" in text and "'transformer.h.0.mlp.c_proj'" in text
    assert "Conv1D (64, 64)" in text and "Conv1D (128, 64)" in text
    # The GPT-2 preset names each kind of module unambiguously.
    from atorch.auto.opt_lib.ds_3d_parallel_optimization import get_gpt2_tpinfo, get_llama_tpinfo

    check_tp_suffixes(_GPT2, get_gpt2_tpinfo(_GPT2))
    check_tp_suffixes(_LLAMA, get_llama_tpinfo(_LLAMA))


def test_valid_arguments_pass():
    validate_arguments(model=_LLAMA, optim_func=torch.optim.AdamW, dataset=TokenDataset(),
                       optim_args={"lr": 1e-3, "weight_decay": 0.1}, dataloader_args={"batch_size": 4, "shuffle": True,
                                                                                      "seed": 3, "num_workers": 0},
                       lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 2},
                       excluded=["fsdp"])
    validate_batch_layout({"batch_size": 8}, {"data": 2, "pipeline": 2}, pipeline_chunks=4)
    assert check_loss(torch.tensor(1.5), None).item() == 1.5
    # What the sweep's checks must keep accepting: a real optimizer, the sample kind each input format unpacks
    # (and anything when a collate_fn reshapes it), a size-1 dim of another name, a wrap_cls the model has,
    # registered names and aliases in excluded/included.
    optim = torch.optim.SGD(_LLAMA.parameters(), lr=0.1)
    assert check_optimizer(optim, _no_optimizer) is optim
    validate_arguments(model=_LLAMA, dataset=TokenDataset(), model_input_format="unpack_dict")
    validate_arguments(model=_LLAMA, dataset=[(torch.zeros(4, dtype=torch.long),)] * 8,
                       model_input_format="unpack_sequence")
    validate_arguments(model=_LLAMA, dataset=list(range(8)), model_input_format="unpack_dict",
                       dataloader_args={"batch_size": 4, "collate_fn": lambda xs: {"input_ids": torch.tensor([xs])}})
    _resolve([("parallel_mode", ([("data", 4), ("expert", 1)], None)), ("fsdp", {"wrap_cls": ["LlamaDecoderLayer"]})]
             )(Path("."))
    SearchSpace.default_for(_LLAMA, 2).restricted(excluded=["fsdp"], included=["checkpoint"])
    # ATorch scripts may exclude ATorch optimizations atorch does not have: nothing to exclude, not a typo.
    excluded = drop_atorch_only_names(["native_dynamo", "amp_apex_o2", "fsdp"])
    assert excluded == ["fsdp"]
    SearchSpace.default_for(_LLAMA, 2).restricted(excluded=excluded)
    # A model the user sharded by hand (ATorch's flow) uses the "tensor" group itself: no tensor_parallel needed.
    hand_sharded = TensorParallelModule.__new__(TensorParallelModule)   # no group needed to be recognised
    nn.Module.__init__(hand_sharded)
    resolve_strategy(Strategy([("parallel_mode", ([("tensor", 2), ("data", 2)], None)), "fsdp"]),
                     ValidationContext(4, model=nn.Sequential(nn.Linear(2, 2), hand_sharded)))
    # An optimizer factory taking **kwargs is not second-guessed.
    validate_arguments(model=_LLAMA, optim_func=lambda params, **kw: torch.optim.SGD(params, **kw),
                       optim_args={"lr": 0.1, "anything": 1})


def test_strategy_file_inside_the_report_directory_that_atorch_creates(tmp_path: Path):
    # `make demo` on a fresh clone: the report directory does not exist yet and the strategy goes inside it.
    report = tmp_path / "atorch_search"
    validate_arguments(model=_LLAMA, report_path=str(report), save_strategy_to_file=str(report / "strategy.json"))
    with pytest.raises(ValueError, match="save_strategy_to_file"):   # any other missing directory is still refused
        validate_arguments(model=_LLAMA, report_path=str(report), save_strategy_to_file=str(tmp_path / "x" / "s.json"))
    with pytest.raises(ValueError, match="report_path"):   # and so is a report directory whose parent is missing
        validate_arguments(model=_LLAMA, report_path=str(tmp_path / "a" / "b"),
                           save_strategy_to_file=str(tmp_path / "a" / "b" / "s.json"))


def test_launcher_usage_error_exits_2_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as info:
        launcher.main(["--nproc_per_node", "0", str(REPO / "benchmarks" / "exit_stress_job.py")])
    assert info.value.code == 2
    assert "--nproc_per_node='0' must be a number of processes >= 1" in capsys.readouterr().err


def test_save_onto_an_empty_directory_or_an_old_checkpoint(tmp_path: Path):
    # What the refusal of a directory of other files must keep: an empty directory made for the checkpoint,
    # and a second save of the same step replacing the first.
    (tmp_path / "empty").mkdir()
    save_checkpoint(nn.Linear(2, 2), str(tmp_path / "empty"), step=1)
    model = nn.Linear(2, 2)
    assert save_checkpoint(model, str(tmp_path / "empty"), step=2) == str(tmp_path / "empty")
    assert load_checkpoint(nn.Linear(2, 2), str(tmp_path / "empty")).step == 2
