"""model_input_format=None: `model(batch)` as the system we follow defines it, refined for dict batches."""

import pytest
import torch
from torch import nn

from atorch.auto import auto_accelerate, train_step
from atorch.auto.model_context import call_model, infer_input_format
from atorch.testing.models import tiny_llama
from atorch.testing.parity import TokenDataset


class TakesBatch(nn.Module):
    """An ATorch-style model whose forward takes the whole batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, batch):
        return self.fc(batch["x"]).sum() if isinstance(batch, dict) else self.fc(batch).sum()


class TakesX(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x, scale=1.0):
        return self.fc(x).sum() * scale


def test_inference_rules():
    llama = tiny_llama()
    ids = torch.zeros(2, 8, dtype=torch.long)
    assert infer_input_format(llama, {"input_ids": ids, "labels": ids}) == "unpack_dict"
    assert infer_input_format(TakesBatch(), {"x": torch.ones(2, 4), "y": torch.ones(2)}) == "whole"
    assert infer_input_format(TakesBatch(), torch.ones(2, 4)) == "whole"
    assert infer_input_format(TakesX(), (torch.ones(2, 4),)) == "whole"
    assert infer_input_format(TakesX(), {"x": torch.ones(2, 4)}) == "unpack_dict"
    with pytest.raises(ValueError, match=r"keys \['x', 'y'\], which are not all parameters of TakesX.forward "
                                         r"\(\['x', 'scale'\]\)"):
        infer_input_format(TakesX(), {"x": torch.ones(2, 4), "y": torch.ones(2)})


def test_call_model_decides_once_per_model_and_explicit_formats_win():
    model = TakesX()
    assert call_model(model, {"x": torch.ones(2, 4)}, None).shape == ()
    # Decided on the first batch: the same model keeps the keyword form.
    assert call_model(model, {"x": torch.ones(2, 4), "scale": 2.0}, None).shape == ()
    assert call_model(TakesBatch(), {"x": torch.ones(2, 4)}, "whole").shape == ()
    assert call_model(model, [torch.ones(2, 4)], "unpack_sequence").shape == ()


def test_hugging_face_dict_batches_train_with_the_default_format():
    # One process, no launcher: the common case that used to fail with "argument 'indices' must be Tensor".
    torch.manual_seed(0)
    status, result, _ = auto_accelerate(tiny_llama(), torch.optim.SGD, TokenDataset(n=8, seq_len=8),
                                        optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4},
                                        load_strategy=[])
    assert status
    losses = [float(train_step(result, batch)) for batch in result.dataloader]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_a_dict_batch_reaches_the_model_under_lora_s_peft_wrapper():
    """`lora` wraps the model in peft's `PeftModel`, whose forward is `(*args, **kwargs)`: the default format
    looked at that signature (under DDP's `.module`), saw no parameter named input_ids or labels and refused a
    Hugging Face batch ("not all parameters of DistributedDataParallel.forward (['args', 'kwargs'])"). The
    forward inferred from is the base model's (`get_base_model()`)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"]))
    assert type(peft_model).__name__ == "PeftModel"

    class Wrapper(nn.Module):   # as DDP keeps it
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long)}
    assert infer_input_format(Wrapper(peft_model), batch) == "unpack_dict"
    assert infer_input_format(peft_model, batch) == "unpack_dict"
    with pytest.raises(ValueError, match="model_input_format=None: the batch is a dict with keys"):
        infer_input_format(Wrapper(peft_model), {"pixels": torch.zeros(2)})
