"""The optimization library: one module per optimization, registered by name.

Import `get_optimization`, `registered_names` or `resolve_strategy` from here; every module
in this package registers itself when first needed.
"""

from atorch.auto.opt_lib.base import (
    NoConfig,
    Optimization,
    Order,
    Registry,
    ValidationContext,
    canonical_name,
    default_registry,
    get_optimization,
    register,
    registered_names,
)
from atorch.auto.opt_lib.resolve import ResolvedOptimization, is_valid_strategy, resolve_strategy

__all__ = ["NoConfig", "Optimization", "Order", "Registry", "ResolvedOptimization", "ValidationContext",
           "canonical_name", "default_registry", "get_optimization", "is_valid_strategy", "register",
           "registered_names", "resolve_strategy"]
