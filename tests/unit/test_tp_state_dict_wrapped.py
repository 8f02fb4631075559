"""`load_tp_state_dict` slices a full state dict into a tensor-parallel model whose blocks are wrapped
(activation checkpointing, torch.compile), as `gather_tp_state_dict` writes it: the wrapper names
are not in the full dict's keys. One fake rank of two: the slicing is local, no collective moves data."""

import torch
import transformers
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from atorch.tensor_parallel import apply_tensor_parallel, load_tp_state_dict
from atorch.tensor_parallel.layers import TensorParallelModule, shard_tensor
from atorch.testing.fake_distributed import fake_process_group


def test_a_full_state_dict_loads_into_a_wrapped_tensor_parallel_model():
    import torch.distributed as dist

    cfg = transformers.AutoConfig.for_model("llama", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with fake_process_group(1, 2):
        model = apply_tensor_parallel(model, dist.group.WORLD).model
        layers = model.model.layers
        layers[0] = checkpoint_wrapper(layers[0])       # keys gain `_checkpoint_wrapped_module.` (hidden by hooks)
        layers[1] = torch.compile(layers[1])            # keys gain `_orig_mod.` (kept in state_dict())
        torch.manual_seed(1)
        full = {k: torch.randn_like(v) for k, v in transformers.AutoModelForCausalLM.from_config(cfg)
                .state_dict().items()}
        load_tp_state_dict(model, full)
        checked = 0
        for name, module in model.named_modules():
            if isinstance(module, TensorParallelModule):
                key = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
                for pname, spec in module.shard_specs().items():
                    expected = shard_tensor(full[f"{key}.{pname}"], spec, 1)
                    assert torch.equal(getattr(module, pname), expected), f"{name}.{pname}"
                    checked += 1
        assert checked >= 14   # 7 sharded linears per block, both blocks
        assert torch.equal(model.model.layers[1]._orig_mod.input_layernorm.weight,
                           full["model.layers.1.input_layernorm.weight"])
