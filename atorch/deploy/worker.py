"""One tensor-parallel rank of a deployed model: `python -m atorch.deploy.worker` (started by `deploy`).

The worker reads its setup and then one request at a time from the Unix socket on fd
`--fd`, runs it on its shard of the model, and answers (rank 0 with the result, the others
with an acknowledgement, so the caller knows every rank finished). It ends when told to,
when the socket reaches EOF (the caller closed it or died), or when its parent process
changes (the caller was killed while this rank was busy inside a collective), so no worker
outlives the process that deployed it.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any, Dict, Optional, cast

import torch
from torch import nn

from atorch.deploy import protocol
from atorch.utils.module_utils import cast_floating
from atorch.utils.parent_watch import on_parent_exit

PARENT_POLL_S = 0.5


def watch_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """Exit this process as soon as `parent_pid` is no longer our parent."""
    if use_pdeathsig and sys.platform.startswith("linux"):
        # SIGKILL when the thread that started us exits: immediate, but tied to that thread,
        # which is why the caller asks for it only when it started us from its main thread.
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(3)
    on_parent_exit(parent_pid, lambda: os._exit(3), PARENT_POLL_S, "atorch-deploy-parent-watch")


def _transformers_class(path: str) -> type:
    """A model class by dotted path, from the transformers package only (never arbitrary code)."""
    module_name, _, name = path.rpartition(".")
    if not module_name.startswith("transformers."):
        raise ValueError(f"deploy: model class {path!r} is not a transformers class; deploy a Hugging Face model, "
                         "a merged Hugging Face folder or an atorch checkpoint of one")
    return getattr(importlib.import_module(module_name), name)


def load_model(setup: Dict[str, Any], state: Dict[str, torch.Tensor]) -> nn.Module:
    """The full (unsharded) model the setup describes, on CPU."""
    kind = setup["source"]
    if kind == "module":
        cls = _transformers_class(setup["class"])
        config = cast(Any, cls).config_class.from_dict(setup["config"])  # a transformers model class
        config._attn_implementation = setup.get("attn_implementation") or config._attn_implementation
        model = cls(config)
        if setup.get("dtype"):
            cast_floating(model, getattr(torch, setup["dtype"]))   # complex buffers stay complex
        model.load_state_dict(state, strict=True)
        return model
    if kind == "hf_folder":
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": getattr(torch, setup["dtype"])} if setup.get("dtype") else {}
        return AutoModelForCausalLM.from_pretrained(setup["path"], **kwargs)
    if kind == "atorch_checkpoint":
        model = _load_atorch_checkpoint(setup["path"], verified=bool(setup.get("verified")))
        return cast_floating(model, getattr(torch, setup["dtype"])) if setup.get("dtype") else model
    raise ValueError(f"deploy: unknown source kind {kind!r}")


def check_deployable_checkpoint(ckpt_dir: str, model_meta: Dict[str, Any]) -> None:
    """Raise ValueError for an atorch checkpoint the workers cannot serve, given its meta.json "model" record:
    LoRA adapters of either kind (peft's, or tensor-parallel LoRA's `lora_A`/`lora_B` parameters, which no
    transformers class has) must be merged into the weights first; a model without a config.json is not a
    transformers model. Called by `deploy` before any worker starts, and by each worker."""
    kind = "peft" if model_meta.get("peft_adapter") else "tensor-parallel" if model_meta.get("tp_lora") else None
    if kind is not None:
        raise ValueError(f"deploy: {ckpt_dir} is a {kind} LoRA checkpoint (adapters saved beside the base weights), "
                         "which the workers cannot load into a transformers model; merge the adapters into the "
                         f"weights first with `atorch merge {ckpt_dir} MERGED_DIR` (or atorch.checkpoint."
                         "merge_checkpoint(ckpt_dir, out_dir), whose default lora='merge' folds them) and deploy "
                         "MERGED_DIR")
    if not model_meta.get("has_config"):
        raise ValueError(f"deploy: {ckpt_dir} has no Hugging Face config.json; only transformers models can be "
                         "deployed")


def _load_atorch_checkpoint(path: str, verified: bool = False) -> nn.Module:
    """The whole model of an atorch checkpoint of any layout (its tensors are read full size, then sharded by us).

    Built on CPU from the checkpoint's config.json (not on meta as `merge_checkpoint` does):
    buffers that are not saved, such as rotary frequencies, must be real for inference. `verified`: `deploy`
    checked every file against the manifest before starting the workers (each would hash it all again).
    """
    from transformers import AutoConfig

    from atorch.checkpoint import manifest as mf
    from atorch.checkpoint.merge import _resolve_model_class, _tied_names, load_model_tensors
    from atorch.checkpoint.save_load import _read_meta, verify_checkpoint

    ckpt = mf.resolve_checkpoint_dir(path)
    manifest = mf.Manifest.read(ckpt) if verified else verify_checkpoint(ckpt, collective=False)
    meta = _read_meta(ckpt).get("model") or {}
    check_deployable_checkpoint(ckpt, meta)
    config = AutoConfig.from_pretrained(ckpt)
    model = _resolve_model_class(meta, config, None, ckpt)(config)
    state = load_model_tensors(ckpt, manifest)
    prefix = meta.get("hf_prefix") or ""
    if prefix:
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k not in _tied_names(model)]
    if missing or result.unexpected_keys:
        raise ValueError(f"deploy: checkpoint {ckpt} does not match {type(model).__name__}: missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def build(setup: Dict[str, Any], state: Dict[str, torch.Tensor], rank: int, world: int,
          device: torch.device) -> nn.Module:
    """This rank's tensor-parallel shard of the model, fused as asked, ready for generate."""
    from atorch.generation import enable_fused_generate

    model = load_model(setup, state).eval()
    if setup.get("fuse"):
        from atorch.auto.opt_lib.module_replace import fuse

        fuse(model, setup["fuse"])
    if world > 1:
        import torch.distributed as dist

        from atorch.tensor_parallel import apply_tensor_parallel

        model = apply_tensor_parallel(model, dist.group.WORLD, coords={"tensor": rank}, gather_logits=True,
                                      device=device).model
    return enable_fused_generate(model.to(device).eval())


def serve(conn: Connection, model: nn.Module, rank: int, device: torch.device) -> None:
    """Answer requests until told to close or the caller is gone."""
    while True:
        try:
            header, payload = protocol.recv(conn, device)
        except EOFError:
            return
        op = header.get("op")
        if op == "close":
            return
        try:
            result = run(model, op, header, payload)
            protocol.send(conn, {"ok": True}, result if rank == 0 else None)
        except Exception as e:  # noqa: BLE001 - reported to the caller, which raises it
            protocol.send(conn, {"ok": False, "error": f"{type(e).__name__}: {e}",
                                 "traceback": traceback.format_exc()})


def run(model: nn.Module, op: Optional[str], header: Dict[str, Any], payload: Dict[str, Any]) -> Any:
    args, kwargs = payload["args"], payload["kwargs"]
    if header.get("seed") is not None:  # every rank samples the same tokens
        torch.manual_seed(header["seed"])
    with torch.inference_mode():
        if op == "generate":
            if isinstance(kwargs.get("generation_config"), dict):   # sent as its dict (plain data on the wire)
                from transformers import GenerationConfig

                kwargs = {**kwargs, "generation_config": GenerationConfig.from_dict(kwargs["generation_config"])}
            return cast(Any, model).generate(*args, **kwargs)  # a transformers model
        if op == "forward":
            return model(*args, **{"use_cache": False, **kwargs})
    raise ValueError(f"deploy worker: unknown operation {op!r}")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one rank of an atorch deployment (started by atorch.deploy)")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--pdeathsig", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = _parse()
    watch_parent(args.parent, args.pdeathsig)
    conn = Connection(args.fd)
    try:
        header, state = protocol.recv(conn)
    except EOFError:
        return
    setup = header["setup"]
    try:
        device = torch.device(setup["device"])
        if device.type == "cuda":
            device = torch.device("cuda", args.rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        if args.world > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=args.rank,
                                    world_size=args.world, timeout=datetime.timedelta(seconds=setup["timeout_s"]))
        model = build(setup, state, args.rank, args.world, device)
        del state
        protocol.send(conn, {"ok": True, "ready": True})
    except Exception as e:  # noqa: BLE001 - the caller raises it
        protocol.send(conn, {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return
    serve(conn, model, args.rank, device)


if __name__ == "__main__":
    main()
