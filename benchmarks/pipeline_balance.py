"""Per-stage parameter counts of the balanced pipeline split (tiny Llama and GPT2, 4 layers).

    .venv/bin/python benchmarks/pipeline_balance.py [--layers 4] [--no-spawn]

1. The plan, on the meta device (no memory): for pipeline sizes 2 and 4, the parameters of
   each stage without the embeddings and LM head (the balance criterion: max/min <= 1.5) and
   with them.
2. Measured per rank (unless --no-spawn): `PipeModuleFromRecordedMeta` built by DeepSpeed on
   gloo ranks for (tensor, data, pipeline) = (1, 1, 2), (1, 1, 4) and (2, 1, 2); each rank
   reports the parameters it actually holds (tensor-parallel shards included).
Prints Markdown tables for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import platform
from typing import Dict, List, Tuple

import torch


def _meta_model(kind: str, layers: int) -> torch.nn.Module:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    from atorch.testing import tiny_gpt2_config, tiny_llama_config
    from atorch.utils.meta_model_utils import record_module_init

    with record_module_init():
        if kind == "llama":
            return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers))
        return GPT2LMHeadModel(tiny_gpt2_config(n_layer=layers))


def plan_table(layers: int) -> List[str]:
    from atorch.modules.pipeline import expand_patcher, get_custom_patcher, plan_stages, stage_parameter_counts
    from atorch.modules.pipeline.partition import embedding_paths

    rows = ["| model | stages | pieces per stage | params per stage, no embeddings/head | max/min | "
            "params per stage, all |", "|---|---|---|---|---|---|"]
    for kind in ("llama", "gpt2"):
        model = _meta_model(kind, layers)
        pieces = expand_patcher(model, get_custom_patcher(model))
        for stages in (2, 4):
            plan = plan_stages(model, pieces, stages)
            bare = stage_parameter_counts(model, plan, excluded_paths=embedding_paths(model, pieces))
            full = stage_parameter_counts(model, plan, include_embeddings=True)
            names = [" ".join(p.path.split(".")[-1] if p.kind == "block" else p.path.split(".")[-1]
                              for p in plan.stage_pieces(s)) for s in range(stages)]
            rows.append(f"| {kind} | {stages} | {' / '.join(names)} | {', '.join(f'{c:,}' for c in bare)} | "
                        f"{max(bare) / min(bare):.3f} | {', '.join(f'{c:,}' for c in full)} |")
    return rows


def _count_per_rank(kind: str, layers: int, dims: List[Tuple[str, int]]) -> Dict[str, int]:
    import deepspeed  # noqa: F401 - fail early with a clear import error
    import torch.distributed as dist

    from atorch import distributed as adist
    from atorch.modules.pipeline import PipeModuleFromRecordedMeta
    from atorch.modules.pipeline.ds_pipe import build_topology

    adist.create_parallel_group((dims, None))
    t, d, p = (adist.parallel_size_or_one(n) for n in ("tensor", "data", "pipeline"))
    module = PipeModuleFromRecordedMeta(_meta_model(kind, layers), topology=build_topology(p, t, d),
                                        tensor_group=adist.parallel_group("tensor") if t > 1 else None)
    counts = {"rank": dist.get_rank(), "stage": adist.parallel_rank_or_zero("pipeline"),
              "tensor_rank": adist.parallel_rank_or_zero("tensor"),
              "params": sum(q.numel() for q in module.parameters()),
              "pieces": " ".join(layer.path.split(".")[-1] for layer in module.local_layers())}
    del module
    dist.barrier()
    return counts


def measured_table(layers: int) -> List[str]:
    from atorch.testing import run_distributed

    rows = ["| model | (t, d, p) | rank | stage | tensor rank | pieces | parameters held |",
            "|---|---|---|---|---|---|---|"]
    for kind, dims in [("llama", [("tensor", 1), ("data", 1), ("pipeline", 2)]),
                       ("llama", [("tensor", 1), ("data", 1), ("pipeline", 4)]),
                       ("llama", [("tensor", 2), ("data", 1), ("pipeline", 2)]),
                       ("gpt2", [("tensor", 1), ("data", 1), ("pipeline", 2)])]:
        world = 1
        for _, size in dims:
            world *= size
        for c in run_distributed(_count_per_rank, world, kind, layers, dims, timeout=600):
            rows.append(f"| {kind} | {tuple(s for _, s in dims)} | {c['rank']} | {c['stage']} | {c['tensor_rank']} | "
                        f"{c['pieces']} | {c['params']:,} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--no-spawn", action="store_true", help="only the plan table (no processes)")
    args = parser.parse_args()
    print(f"machine: {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}")
    print("\nPlan (meta device):\n")
    print("\n".join(plan_table(args.layers)))
    if not args.no_spawn:
        print("\nMeasured per rank (DeepSpeed PipelineModule, gloo):\n")
        print("\n".join(measured_table(args.layers)))


if __name__ == "__main__":
    main()
