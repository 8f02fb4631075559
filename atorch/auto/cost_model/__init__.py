"""Predict a strategy's per-rank peak memory and step time without running it.

The planner ranks candidates by predicted step time and never dry-runs one whose predicted
peak exceeds the device memory. Pure: plain values in (model shape, strategy, batch, world
size, device), an `Estimate` out; nothing is allocated or communicated. A transformers config's
parameter layout (counts, tensor sizes, experts) is read off its own model class built on the
meta device (`ModelShape.from_config`); other configs are counted by Llama's and GPT-2's formula.

What a strategy does is declared by its optimizations (`Optimization.cost_traits`), combined
into `StrategyTraits`; the formulas read only those traits. Memory per rank, by backend
(`memory_breakdown`): replicated (DDP, torch ZeRO-1, tensor/pipeline stages), torch FSDP2, or
DeepSpeed ZeRO (a half-precision module with fp32 master partitions) -- model states,
buffers, gathered parameters and activations. The peak (`peak_bytes`) is what is always held
plus the larger of the activation phase and the gradient phase. Activations are counted, not
fitted: the tensors a Hugging Face decoder block saves for backward (per precision mode,
attention kind and tensor-parallel split; `_block_saved_bytes`), the final norm, and the loss's
b*s*vocab buffers (TP's gathered logits included), with and without checkpointing. Checked against
measured bytes on 2 ranks for every backend (tests/distributed/test_memory_model.py), the ZeRO
paper's Figure 1 (tests/unit/test_cost_model.py) and torch's FSDPMemTracker at 1B-7B on 8-64
fake ranks (benchmarks/memory_model.py). Step time = FLOPs / measured rate + a per-layer
overhead (both times the strategy's `compute_time_factor`, e.g. compile's) + communication volume /
measured bandwidth + a latency per collective.

The parts, each importable on its own: `shape` (ModelShape from a config or a module), `traits`
(StrategyTraits from a strategy), `activations` (bytes saved for backward, the activation probe's
scale), `memory` (per-backend breakdown and peak), `step_time` (device rates and time
breakdown), `optimizer` (what the user's optimizer keeps per parameter), `predict` (`estimate`, the
one entry the planner calls).
"""

from atorch.auto.cost_model.activations import (activation_bytes, block_activation_bytes, calibrated_shape,
                                                loss_buffer_bytes, loss_softmax_bytes, shape_of)
from atorch.auto.cost_model.memory import (ACTIVATION_PHASE_KEYS, ADAM_STATE_BYTES_PER_PARAM,
                                           DS_REDUCE_BUCKET_ELEMENTS, DS_STAGE3_PERSISTENCE_ELEMENTS,
                                           DS_STAGE3_PREFETCH_ELEMENTS, MODEL_STATE_KEYS, PHASES, RESIDENT_KEYS,
                                           adam_step_bytes, memory_breakdown, model_state_bytes, peak_bytes,
                                           resident_bytes, stage_params)
from atorch.auto.cost_model.optimizer import ADAM, OptimizerStates, optimizer_states
from atorch.auto.cost_model.predict import Estimate, estimate
from atorch.auto.cost_model.shape import ModelShape
from atorch.auto.cost_model.step_time import DEVICE_PROFILES, time_breakdown
from atorch.auto.cost_model.traits import StrategyTraits, lora_params, micro_batch_size, precision_mode

__all__ = [
    "ACTIVATION_PHASE_KEYS", "ADAM", "ADAM_STATE_BYTES_PER_PARAM", "DEVICE_PROFILES", "DS_REDUCE_BUCKET_ELEMENTS",
    "DS_STAGE3_PERSISTENCE_ELEMENTS", "DS_STAGE3_PREFETCH_ELEMENTS", "Estimate", "MODEL_STATE_KEYS", "ModelShape",
    "OptimizerStates", "PHASES", "RESIDENT_KEYS", "StrategyTraits", "activation_bytes", "adam_step_bytes",
    "block_activation_bytes", "calibrated_shape", "estimate", "loss_buffer_bytes", "loss_softmax_bytes", "lora_params",
    "memory_breakdown", "micro_batch_size", "model_state_bytes", "optimizer_states", "peak_bytes", "precision_mode",
    "resident_bytes", "shape_of", "stage_params", "time_breakdown",
]
