"""`ds_config` of the DeepSpeed ZeRO engines (zero1/zero2/fsdp with use_ds_zero=True): merge over
atorch's derived keys, conflicts named at validation, JSON round trip, describe and cost traits.

Pure: no process group, no DeepSpeed import.
"""

import json
import re

import pytest
import torch

from atorch.auto import Strategy
from atorch.auto.cost_model import ModelShape, StrategyTraits, estimate
from atorch.auto.opt_lib import ValidationContext, get_optimization, resolve_strategy
from atorch.auto.opt_lib._ds_config import (
    bucket_elements,
    derived_zero_config,
    merge_ds_config,
    offload_devices,
    with_derived_buckets,
    zero_ds_config,
)
from atorch.auto.opt_lib.ds_3d_parallel_optimization import resolve_ds_config
from atorch.testing import tiny_llama, tiny_llama_config

OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 1000}}


def resolve(items, world_size=2, global_batch=8):
    return resolve_strategy(Strategy(items), ValidationContext(world_size=world_size, global_batch_size=global_batch))


def config_of(resolved, name):
    return next(r.config for r in resolved if r.name == name)


def test_merge_keeps_atorch_keys_under_the_users_sections():
    derived = derived_zero_config(2, data_size=2, global_batch=8, accumulation_steps=2,
                                  autocast_dtype=torch.bfloat16)
    assert (derived["train_micro_batch_size_per_gpu"], derived["train_batch_size"]) == (2, 8)
    merged = merge_ds_config(derived, OFFLOAD)
    assert merged["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                           "reduce_bucket_size": 1000}
    assert merged["bf16"] == {"enabled": True} and merged["gradient_clipping"] == 0.0
    assert "offload_optimizer" not in derived["zero_optimization"]   # nothing shared with the inputs


def test_user_keys_that_repeat_the_strategy_are_accepted():
    cfg = zero_ds_config("zero2", {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                                   "zero_optimization": {"stage": 2, "overlap_comm": True}, "bf16": {"enabled": True}},
                         stage=2, data_size=2, global_batch=8, accumulation_steps=1, autocast_dtype=torch.bfloat16)
    assert cfg["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == \
        (8, 4, 1)
    # Without a dataloader, the user's consistent batch keys stand (DeepSpeed only logs them).
    cfg = zero_ds_config("zero1", {"train_micro_batch_size_per_gpu": 3}, stage=1, data_size=2, global_batch=None,
                         accumulation_steps=1, autocast_dtype=None)
    assert cfg["train_batch_size"] == 6


def test_a_hugging_face_trainer_config_with_auto_values_is_accepted():
    # "auto" (Hugging Face Trainer configs) means: atorch derives it, or DeepSpeed's default applies.
    hf = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": True}}
    cfg = zero_ds_config("zero2", hf, stage=2, data_size=2, global_batch=8, accumulation_steps=2,
                         autocast_dtype=torch.bfloat16)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == \
        (8, 2, 2)
    assert cfg["zero_optimization"] == {"stage": 2, "overlap_comm": True} and cfg["bf16"] == {"enabled": True}
    assert cfg["gradient_clipping"] == 0.0
    assert "auto" not in json.dumps(cfg)


@pytest.mark.parametrize("items, match", [
    ([("zero2", {"use_ds_zero": True, "ds_config": {"train_micro_batch_size_per_gpu": 2}})],
     r"zero2: ds_config train_micro_batch_size_per_gpu=2 disagrees with the dataloader: its global batch 8 "
     r"\(dataloader_args batch_size\) over 2 data rank\(s\) and 1 accumulation step\(s\) gives "
     r"train_micro_batch_size_per_gpu=4"),
    ([("zero1", {"use_ds_zero": True, "ds_config": {"train_batch_size": 16}})],
     r"zero1: ds_config train_batch_size=16 disagrees with the dataloader"),
    ([("fsdp", {"use_ds_zero": True, "ds_config": {"gradient_accumulation_steps": 2}})],
     r"fsdp: ds_config gradient_accumulation_steps=2 but the strategy accumulates 1 micro-batch\(es\) per step; "
     r"accumulation is the gradient_accumulation optimization's here: add \('gradient_accumulation', \{'steps': 2\}\)"),
    ([("zero2", {"use_ds_zero": True, "ds_config": {"zero_optimization": {"stage": 3}}})],
     r"zero2: ds_config zero_optimization.stage=3 but zero2 is DeepSpeed ZeRO stage 2"),
    ([("fsdp", {"use_ds_zero": True, "ds_config": {"bf16": {"enabled": True}}})],
     r"fsdp: ds_config bf16.enabled=true but the strategy has no amp_native; .*add \('amp_native', "
     r"\{'dtype': torch.bfloat16\}\)"),
    ([("amp_native", torch.bfloat16), ("zero2", {"use_ds_zero": True, "ds_config": {"bf16": {"enabled": False}}})],
     r"zero2: ds_config bf16.enabled=false but amp_native asks for bf16"),
    ([("amp_native", torch.bfloat16), ("zero2", {"use_ds_zero": True, "ds_config": {"fp16": {"enabled": True}}})],
     r"zero2: ds_config fp16.enabled=true but amp_native is bf16"),
    ([("zero1", {"use_ds_zero": True, "ds_config": {"gradient_clipping": 1.0}})],
     r"zero1: ds_config gradient_clipping=1.0: clipping is train_step's max_grad_norm here .*max_grad_norm=1.0"),
    ([("zero2", {"use_ds_zero": True, "ds_config": {"zero_optimization": {"offload_param": {"device": "cpu"}}}})],
     r"zero2: ds_config zero_optimization.offload_param needs ZeRO stage 3"),
    ([("fsdp", {"use_ds_zero": True, "ds_config": {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}})],
     r"fsdp: ds_config zero_optimization.offload_optimizer.device='gpu' must be one of \['none', 'cpu', 'nvme'\]"),
    ([("zero2", {"ds_config": OFFLOAD})], r"zero2: ds_config is DeepSpeed's config and applies with use_ds_zero=True"),
    ([("zero1", {"use_ds_zero": True, "ds_config": [1]})], r"zero1: ds_config must be a dict or a JSON file path"),
    ([("zero1", {"use_ds_zero": True, "ds_config": {"zero_optimization": 2}})],
     r"zero1: ds_config zero_optimization=2 must be a section \(a JSON object\)"),
    ([("zero1", {"use_ds_zero": True, "ds_config": {"x": object()}})], r"zero1: ds_config must hold JSON values"),
    ([("fsdp", {"use_ds_zero": True, "ds_config": {"zero_optimization": {"stage3_param_persistence_threshold": "x"}}})],
     r"ds_config zero_optimization.stage3_param_persistence_threshold='x' must be a non-negative number of elements"),
    ([("zero2", {"use_ds_zero": True, "ds_config": {"zero_optimization": {"reduce_bucket_size": -5}}})],
     r"ds_config zero_optimization.reduce_bucket_size=-5 must be a non-negative number of elements"),
    ([("zero1", {"use_ds_zero": True, "ds_config": "/nonexistent/ds.json"})],
     r"zero1: ds_config '/nonexistent/ds.json' is not a readable JSON file"),
])
def test_conflicts_are_named_at_validation(items, match):
    with pytest.raises(ValueError, match=match):
        resolve(items)


def test_accumulation_from_the_strategy_and_json_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}))
    resolved = resolve([("gradient_accumulation", {"steps": 2}),
                        ("zero2", {"use_ds_zero": True, "ds_config": path})])   # a PathLike is kept as a string
    assert config_of(resolved, "zero2").ds_config == str(path)


def test_strategy_json_round_trip_keeps_ds_config(tmp_path):
    strategy = Strategy([("amp_native", torch.bfloat16),
                         ("fsdp", {"use_ds_zero": True, "ds_config": {**OFFLOAD, "bf16": {"enabled": True}}})])
    resolved = resolve(list(strategy))
    saved = Strategy([(r.name, r.config) for r in resolved])
    saved.save(tmp_path / "s.json")
    loaded = Strategy.load(tmp_path / "s.json")
    again = resolve(list(loaded))
    assert config_of(again, "fsdp") == config_of(resolved, "fsdp")
    assert config_of(again, "fsdp").ds_config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert "fsdp(deepspeed stage 3,ds_config,offload_optimizer=cpu)" in loaded.describe()
    # A path stays a path; zero1's config round-trips as well (as a dataclass, as the search saves it).
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(OFFLOAD))
    zero1 = config_of(resolve([("zero1", {"use_ds_zero": True, "ds_config": path})]), "zero1")
    back = Strategy.from_json(Strategy([("zero1", zero1)]).to_json())
    assert config_of(resolve(list(back)), "zero1") == zero1 and "zero1(deepspeed stage 1,ds_config=ds.json)" in \
        back.describe()


def test_cost_traits_declare_offload_from_ds_config():
    shape = ModelShape.from_config(tiny_llama_config())
    for name in ("zero1", "zero2", "fsdp"):
        plain = StrategyTraits.from_strategy([(name, {"use_ds_zero": True})], 2, shape, device_type="cuda")
        offload = StrategyTraits.from_strategy([(name, {"use_ds_zero": True, "ds_config": OFFLOAD})], 2, shape,
                                               device_type="cuda")
        assert (plain.ds_offload_optimizer, offload.ds_offload_optimizer) == (False, True)
        assert not offload.ds_offload_params and not offload.cpu_offload    # cpu_offload is torch FSDP2's
        assert offload.sharding == "deepspeed" and offload.ds_bucket_elements == 1000


PARAMS = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}


def test_offload_keeps_on_the_device_what_each_backend_keeps_there():
    shape = ModelShape.from_module(tiny_llama())
    n, d = shape.num_params, 2

    def breakdown(item):
        return estimate(shape, ["amp_native", item], 8, 32, d, "cuda").breakdown

    # DeepSpeed optimizer offload: the bf16 module, the bucket and a staging buffer of the largest
    # parameter stay; master, Adam state, the fp32 gradient partition (no bf16 partition, no
    # upcast for the step), a bf16 copy of the partition and a second staging buffer go to the host.
    largest = 1024 * 64                     # tiny_llama's embedding (and head)
    opt = breakdown(("zero2", {"use_ds_zero": True, "ds_config": OFFLOAD}))
    assert opt["mem_params"] == 2 * n and opt["mem_ds_reduce_bucket"] == 2 * 1000
    assert opt["mem_host_grad_fp32"] == 4 * n / d and opt["mem_host_master"] == 4 * n / d
    assert opt["mem_host_optimizer"] == 8 * n / d and opt["mem_ds_offload_buffers"] == 2 * largest
    assert opt["mem_host_ds_offload_host_buffers"] == 2 * (n / d + largest)
    assert not {"mem_grads", "mem_step_grad_fp32", "mem_host_step_grad_fp32", "mem_master"} & set(opt)
    # ZeRO-3 with optimizer offload only: the bf16 partitions and gradient partition stay; with
    # offload_param the parameter partitions go too. Parameters below 1e5 elements (all of the
    # tiny model's) stay whole on every rank either way.
    z3 = breakdown(("fsdp", {"use_ds_zero": True, "ds_config": OFFLOAD}))
    assert z3["mem_params"] == 2 * n / d and z3["mem_grads"] == 2 * n / d and "mem_host_params" not in z3
    assert z3["mem_host_grad_fp32"] == 4 * n / d and z3["mem_ds_persistent_params"] == 2 * n
    z3p = breakdown(("fsdp", {"use_ds_zero": True, "ds_config": PARAMS}))
    assert z3p["mem_host_params"] == 2 * n / d and "mem_params" not in z3p
    # torch FSDP2 CPUOffloadPolicy: fp32 shards, gradients, Adam state and the (per-tensor) step on the host.
    torch_offload = estimate(shape, ["parallel_mode", "amp_native", ("fsdp", {"cpu_offload": True})], 8, 32, d,
                             "cuda").breakdown
    assert torch_offload["mem_host_params"] == 4 * n / d and "mem_optimizer_step" not in torch_offload
    assert torch_offload["mem_host_optimizer_step"] > 0 and torch_offload["mem_gathered_params"] > 0
    # On a CPU run the host is the device: nothing is split off, the totals are the same.
    on_cpu = estimate(shape, ["amp_native", ("zero2", {"use_ds_zero": True, "ds_config": OFFLOAD})], 8, 32, d,
                      "cpu").breakdown
    assert not any(k.startswith("mem_host_") for k in on_cpu) and on_cpu["mem_grad_fp32"] == 4 * n / d


def test_offload_devices_and_3d_shares_the_reader(tmp_path):
    assert offload_devices({}) == ("none", "none")
    assert offload_devices({"zero_optimization": {"offload_param": {"device": "cpu"}}}) == ("none", "cpu")
    # deepspeed_3d_parallel reads and completes its config with the same module (same messages).
    with pytest.raises(ValueError, match=r"deepspeed_3d_parallel: ds_config train_batch_size=0 must be a positive"):
        resolve_ds_config({"train_batch_size": 0}, 2, 2)
    assert get_optimization("zero1").parse_config({"use_ds_zero": True, "ds_config": OFFLOAD}).ds_config == OFFLOAD


def test_who_builds_the_optimizer_is_checked_when_applied():
    """optim_func or ds_config's optimizer, exactly one; offload needs DeepSpeed's CPU Adam (checked by class name)."""
    import functools

    from atorch.auto.model_context import ModelContext
    from atorch.auto.opt_lib._sharding import prepare_deepspeed

    def ctx(optim_func):
        return ModelContext(model=torch.nn.Linear(2, 2), optim_func=optim_func)

    with pytest.raises(ValueError, match=r"zero2: both optim_func and ds_config\['optimizer'\] are given; pass one"):
        prepare_deepspeed(ctx(torch.optim.AdamW), "zero2", {"optimizer": {"type": "AdamW"}})
    with pytest.raises(ValueError, match=r"zero1 with use_ds_zero=True needs optim_func or ds_config\['optimizer'\]"):
        prepare_deepspeed(ctx(None), "zero1", None)
    with pytest.raises(ValueError, match=r"fsdp: ds_config offloads the optimizer, which runs DeepSpeed's CPU Adam; "
                                         r"optim_func='SGD' is not it"):
        prepare_deepspeed(ctx(torch.optim.SGD), "fsdp", OFFLOAD)

    class DeepSpeedCPUAdam(torch.optim.Adam):   # stands in for deepspeed.ops.adam's (matched by name)
        pass

    for optim_func in (DeepSpeedCPUAdam, functools.partial(DeepSpeedCPUAdam, adamw_mode=True)):
        context = ctx(optim_func)
        prepare_deepspeed(context, "fsdp", OFFLOAD)
        assert context.is_sharded
    prepare_deepspeed(ctx(None), "zero2", {**OFFLOAD, "optimizer": {"type": "AdamW"}})


def test_a_scheduler_given_twice_is_refused():
    """DeepSpeed runs a scheduler built from lr_scheduler_cls and drops ds_config's: a WarmupLR there never ran."""
    from atorch.auto.model_context import ModelContext
    from atorch.auto.opt_lib._ds_config import check_one_scheduler
    from atorch.auto.opt_lib._sharding import prepare_deepspeed

    warmup = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
    context = ModelContext(model=torch.nn.Linear(2, 2), optim_func=torch.optim.AdamW,
                           lr_scheduler_cls=torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ValueError, match=r"zero2: both lr_scheduler_cls=StepLR and ds_config\['scheduler'\] \(type "
                                         r"'WarmupLR'\) are given; DeepSpeed would run the first and ignore the "
                                         r"second: pass one"):
        prepare_deepspeed(context, "zero2", warmup)
    check_one_scheduler("zero2", warmup, None)          # either alone is fine
    check_one_scheduler("zero2", {}, torch.optim.lr_scheduler.StepLR)


def test_buckets_follow_the_model_size_and_the_users_values_win():
    def zero(user, trainable):
        return zero_ds_config("zero2", user, stage=2, data_size=2, global_batch=8, accumulation_steps=1,
                              autocast_dtype=torch.bfloat16, trainable_elements=trainable)["zero_optimization"]

    # DeepSpeed's 5e8-element default bucket is 1 GB a rank in bf16 even for a 213k-parameter model.
    assert zero(None, 213_000) == {"stage": 2, "reduce_bucket_size": 213_000, "allgather_bucket_size": 213_000}
    assert zero(None, 7_000_000_000)["reduce_bucket_size"] == 500_000_000      # bounded by DeepSpeed's default
    assert bucket_elements(0) == 2 and bucket_elements(643) == 644   # even: ZeRO-1/2 assert a 2-element alignment
    user = zero({"zero_optimization": {"reduce_bucket_size": 1000}}, 213_000)
    assert (user["reduce_bucket_size"], user["allgather_bucket_size"]) == (1000, 213_000)
    assert zero({"zero_optimization": {"reduce_bucket_size": "auto"}}, 213_000)["reduce_bucket_size"] == 213_000
    # Without the model's size (validation), DeepSpeed's defaults stand.
    assert "reduce_bucket_size" not in derived_zero_config(2, 2, 8, 1, torch.bfloat16)["zero_optimization"]


def test_the_cost_model_counts_the_bucket_deepspeed_allocates():
    shape = ModelShape.from_module(tiny_llama())
    derived = estimate(shape, ["amp_native", ("zero2", {"use_ds_zero": True})], 8, 32, 2, "cuda").breakdown
    assert derived["mem_ds_reduce_bucket"] == 2 * shape.num_params          # bf16, one bucket for the model
    user = {"zero_optimization": {"reduce_bucket_size": 1000}}
    given = estimate(shape, ["amp_native", ("zero2", {"use_ds_zero": True, "ds_config": user})], 8, 32, 2,
                     "cuda").breakdown
    assert given["mem_ds_reduce_bucket"] == 2 * 1000
    stage3 = estimate(shape, ["amp_native", ("fsdp", {"use_ds_zero": True})], 8, 32, 2, "cuda").breakdown
    assert stage3["mem_ds_reduce_buffer"] == 2 * shape.num_params


def test_zero3_persistence_and_prefetch_from_the_users_config():
    """ZeRO-3 keeps every parameter below `stage3_param_persistence_threshold` whole on each rank
    (DeepSpeed's default 1e5 elements: all of a tiny model) and gathers `stage3_prefetch_bucket_size`
    elements ahead; the cost model reads the user's values (0 is a setting: nothing persists, no
    prefetch)."""
    shape = ModelShape.from_module(tiny_llama())

    def breakdown(zero):
        cfg = {"zero_optimization": zero}
        return estimate(shape, ["amp_native", ("fsdp", {"use_ds_zero": True, "ds_config": cfg})], 8, 32, 2,
                        "cuda").breakdown

    default, none, everything = breakdown({}), breakdown({"stage3_param_persistence_threshold": 0}), \
        breakdown({"stage3_param_persistence_threshold": 10 ** 12})
    assert default["mem_ds_persistent_params"] == everything["mem_ds_persistent_params"] > 0   # tiny: all persist
    assert none["mem_ds_persistent_params"] == 0
    big = ModelShape.from_config(tiny_llama_config(hidden_size=1024, intermediate_size=2048, vocab_size=32000))
    unit = max(big.embedding_params / 2, big.layer_params)

    def gathered(zero):
        cfg = {"zero_optimization": zero}
        return estimate(big, ["amp_native", ("fsdp", {"use_ds_zero": True, "ds_config": cfg})], 8, 32, 2,
                        "cuda").breakdown["mem_gathered_params"]

    assert gathered({"stage3_prefetch_bucket_size": 0}) == 2 * unit
    assert gathered({"stage3_prefetch_bucket_size": 1000}) == 2 * (unit + 1000)


def test_3d_buckets_follow_the_stage_only_with_a_zero_optimizer():
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    assert with_derived_buckets(cfg, 4096)["zero_optimization"] == {
        "stage": 1, "reduce_bucket_size": 4096, "allgather_bucket_size": 4096}
    users = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 10}}
    assert with_derived_buckets(users, 4096)["zero_optimization"]["reduce_bucket_size"] == 10
    assert with_derived_buckets({"zero_optimization": {"stage": 0}}, 4096) == {"zero_optimization": {"stage": 0}}
    assert with_derived_buckets({}, 4096) == {}
    assert cfg == {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}     # not edited


@pytest.mark.parametrize("cfg, key, meant", [
    ({"zero_optimisation": {"stage": 2}}, "'zero_optimisation'", "'zero_optimization'"),
    ({"bf_16": {"enabled": True}}, "'bf_16'", "'bf16'"),
    ({"gradient_acumulation_steps": 2}, "'gradient_acumulation_steps'", "'gradient_accumulation_steps'"),
    ({"zero_optimization": {"reduce_bucket_szie": 5}}, "'zero_optimization.reduce_bucket_szie'",
     "'zero_optimization.reduce_bucket_size'"),
])
def test_a_misspelled_deepspeed_key_is_refused_naming_the_one_meant(cfg, key, meant):
    """DeepSpeed ignores keys it does not know: a typo would train without the user's settings."""
    from atorch.auto.opt_lib._ds_config import load_ds_config

    with pytest.raises(ValueError, match=f"ds_config key {re.escape(key)} is not a DeepSpeed setting.*did you mean "
                                         f"{re.escape(meant)}"):
        load_ds_config("fsdp", cfg)
    # A key unlike any DeepSpeed setting (a newer DeepSpeed's, a comment) passes: the list is not exhaustive.
    assert load_ds_config("fsdp", {"my_notes": "x", "zero_optimization": {"stage": 2}})["my_notes"] == "x"
