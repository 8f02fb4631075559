"""`fp8`: float8 matmuls in the linear layers through torchao's float8 training.

Float8 GEMMs need NVIDIA tensor cores of compute capability >= 8.9 (Ada, Hopper and later)
and a library that drives them; everywhere else validation raises a ValueError naming the
requirement, never a silent fallback to higher precision. Applied after casting and
autocast (they set the high-precision dtype float8 scales from) and before sharding, which
then shards the converted `Float8Linear` modules.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

from atorch.auto.model_context import ModelContext
from atorch.auto.opt_lib.base import CostContext, Optimization, Order, ValidationContext, register

logger = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 9)
# torchao's pre-made recipes (torchao.float8.Float8LinearRecipeName values).
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# Float8 GEMM kernels need both matrix dimensions divisible by 16.
_DIM_MULTIPLE = 16
_REQUIREMENT = (f"fp8 needs an NVIDIA GPU with compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                "(Ada/Hopper or newer) and torchao installed (pip install torchao)")


@dataclass(frozen=True)
class Fp8Config:
    """Which float8 recipe, and which linear layers stay in high precision."""

    recipe: str = "tensorwise"
    """torchao recipe: "tensorwise" (fastest), "rowwise", or "rowwise_with_gw_hp" (most accurate)."""
    skip_modules: Tuple[str, ...] = ("lm_head",)
    """Names (or dotted-name suffixes) of linear layers kept in high precision; the output projection by
    default, whose large vocabulary dimension is the most sensitive to float8 rounding."""

    def __post_init__(self) -> None:
        if isinstance(self.skip_modules, str):
            object.__setattr__(self, "skip_modules", (self.skip_modules,))
        elif isinstance(self.skip_modules, list):
            object.__setattr__(self, "skip_modules", tuple(self.skip_modules))


def _is_skipped(name: str, skip: Tuple[str, ...]) -> bool:
    return any(name == s or name.endswith(f".{s}") for s in skip)


def module_filter(config: Fp8Config) -> Callable[[nn.Module, str], bool]:
    """torchao's `module_filter_fn`: which `nn.Linear` (by module and fully qualified name) to convert."""

    def keep(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and not _is_skipped(fqn, config.skip_modules)
                and module.in_features % _DIM_MULTIPLE == 0 and module.out_features % _DIM_MULTIPLE == 0)

    return keep


def convertible_linears(model: nn.Module, config: Fp8Config) -> List[str]:
    keep = module_filter(config)
    return [name for name, m in model.named_modules() if keep(m, name)]


def check_fp8_support(device_type: str) -> None:
    """Raise ValueError unless this process can run float8 training.

    Decided from the device type (identical on every rank) and, on CUDA, the device's
    compute capability and the installed libraries, with no collective.
    """
    if device_type != "cuda":
        raise ValueError(f"{_REQUIREMENT}; this process has device {device_type!r}")
    capability = tuple(torch.cuda.get_device_capability())
    if capability < MIN_CAPABILITY:
        raise ValueError(f"{_REQUIREMENT}; this GPU ({torch.cuda.get_device_name()}) has compute capability "
                         f"{capability[0]}.{capability[1]}")
    if importlib.util.find_spec("torchao") is None:
        raise ValueError(f"{_REQUIREMENT}; torchao is not installed in this environment")


@register
class Fp8Optimization(Optimization):
    """Float8 linear layers (torchao); a clear error where the hardware or library is missing."""

    name = "fp8"
    order = Order.FP8
    Config = Fp8Config

    @classmethod
    def cost_traits(cls, config: Fp8Config, context: CostContext) -> Dict[str, Any]:
        return {"compute_dtype_bytes": 2, "fp8": True}

    def validate(self, config: Fp8Config, context: ValidationContext) -> None:
        # Config mistakes first: they are worth reporting whatever the hardware.
        if config.recipe not in RECIPES:
            raise ValueError(f"fp8: recipe={config.recipe!r}; valid recipes are {list(RECIPES)}")
        if not all(isinstance(s, str) for s in config.skip_modules):
            raise ValueError(f"fp8: skip_modules={config.skip_modules!r}; expected a list of layer names")
        check_fp8_support(context.device_type)
        if context.model is not None and not convertible_linears(context.model, config):
            raise ValueError(
                f"fp8: {type(context.model).__name__} has no nn.Linear with both dimensions divisible by "
                f"{_DIM_MULTIPLE} outside skip_modules={list(config.skip_modules)}; fp8 would change nothing")

    def apply(self, ctx: ModelContext, config: Fp8Config) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        names = convertible_linears(ctx.model, config)
        convert_to_float8_training(ctx.model, config=Float8LinearConfig.from_recipe_name(config.recipe),
                                   module_filter_fn=module_filter(config))
        converted = [name for name, m in ctx.model.named_modules() if type(m).__name__ == "Float8Linear"]
        if not converted:
            raise RuntimeError(f"fp8: torchao converted none of the {len(names)} eligible linear layers")
        summary: Dict[str, Any] = {"recipe": config.recipe, "converted": len(converted)}
        ctx.summaries["fp8"] = summary
        logger.info("fp8: %d linear layers run float8 matmuls (%s recipe)", len(converted), config.recipe)
