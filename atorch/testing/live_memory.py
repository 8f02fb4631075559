"""Bytes of tensors still alive, read the way the memory tests compare them with the cost model.

`live_tensor_bytes`: tensors still reachable from Python, what a finished candidate must not
leave behind (`tests/distributed/test_dry_run_sequence.py`, `benchmarks/dry_run_memory_release.py`;
the allocator's RSS cannot see it: it keeps freed memory). `settled_live_bytes`: a
`PeakMemoryTracker`'s live bytes once nothing more is released (the memory-model tests), read
between `backward_only` and `optimizer_step`: one training step of an `AutoAccelerateResult` cut
where the cost model's resident bytes are defined (gradients present, activations freed).
"""

from __future__ import annotations

import gc
import time
from typing import Any, Mapping

import torch

from atorch.utils.peak_memory import PeakMemoryTracker


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Bytes of the distinct storages of every tensor on `device_type` Python can reach, after a gc."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == device_type:
            storage = obj.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def settled_live_bytes(tracker: PeakMemoryTracker, timeout_s: float = 2.0) -> int:
    """The tracker's live bytes once nothing more is released: unreachable cycles collected (they
    are not memory a rank holds), then read until three reads 20 ms apart agree.

    A collective's buffers can be released by the process group's worker thread after the caller
    has returned from it. One CI run read rank 0 of "deepspeed zero2 bf16 offload_optimizer" with
    exactly one more model-sized bf16 buffer alive (426,624 B, the size of its gradient bucket:
    ratio 0.854, where every local repeat, 14 of them, 5 under load, read 0.993), which fits that
    race; a read taken too early counts memory the rank is about to give back."""
    deadline = time.monotonic() + timeout_s
    gc.collect()
    reads = [tracker.live_bytes]
    while time.monotonic() < deadline and (len(reads) < 3 or len(set(reads[-3:])) > 1):
        time.sleep(0.02)
        gc.collect()
        reads.append(tracker.live_bytes)
    return reads[-1]


def backward_only(result: Any, batch: Mapping[str, Any]) -> None:
    """Forward and backward of one batch of an `AutoAccelerateResult` (a pipeline's schedule, DeepSpeed's
    engine, or the model and its loss), the model's output dropped before backward as `train_step` does."""
    from atorch.auto.model_context import call_model

    engine, pipeline = result.args.get("engine"), result.args.get("pipeline")
    batch = result.prepare_input(batch)
    if pipeline is not None:
        pipeline.forward_backward(batch)
        return
    output = call_model(result.model, batch, "unpack_dict")
    loss = result.loss_func(batch, output)
    del output
    engine.backward(loss) if engine is not None else loss.backward()


def optimizer_step(result: Any) -> None:
    """The optimizer step after `backward_only` (the engine's, or the optimizer's and `zero_grad`)."""
    engine = result.args.get("engine")
    if engine is not None:
        engine.step()
    else:
        result.optim.step()
        result.optim.zero_grad(set_to_none=True)
