"""A step-time model that learns: device constants from a short probe, then a refit on every dry run.

Two layers over the cost model (`atorch.auto.cost_model.estimate`, used as is):

1. **Probe**: `calibrate_model` measures what the step will run -- matmul FLOP/s at the
   model's own GEMM shapes (tokens per rank x hidden x hidden / kv / intermediate / vocab,
   forward and backward, per tensor split and dtype) and all-reduce times at the sizes the
   strategies move, fitted to a bandwidth and a latency; `cost_model_predictor(profile=...)`
   gives each strategy the rates of its own tokens and split (`ShapedConstants`).
   (`calibrate_device`, one large square matmul, overstates a small model's rates.) Measured
   once per device kind (and shape, backend and group size), cached as JSON in
   `$ATORCH_CALIBRATION_CACHE` or `~/.cache/atorch/calibration.json` (never pickle); a corrupt
   file or entry is ignored with a warning naming the file.
2. **Refit** (`LearningPredictor`), on every measured dry run (`observe(strategy, step_time_s)`):
   one non-negative weight per part of the cost model's step time (compute, overhead,
   communication; least squares on relative errors, shrunk towards a common rescale), then
   per-option corrections: log(measured / predicted) ~ bias + one effect per option of the
   strategy (amp, checkpoint, each sharder, tensor=2, ...), ridge-shrunk towards 0 and fitted
   with a Huber loss. An option the cost model misjudges (autocast on a CPU) is learned from
   the trials that used it and corrects the candidates not yet run, which reorders them; one
   trial only rescales, and one wild measurement is downweighted. Memory is left as the base
   model says.
"""

from atorch.auto.calibration.cache import CACHE_ENV, CACHE_VERSION, default_cache_path, load_cache
from atorch.auto.calibration.device_probe import (DeviceConstants, calibrate_device, device_kind, probe_all_reduce,
                                                  probe_matmul)
from atorch.auto.calibration.predictor import COMPONENTS, Predictor, cost_model_predictor
from atorch.auto.calibration.refit import (LearningPredictor, fit_option_effects, fit_weights, kendall_tau,
                                           option_keys)
from atorch.auto.calibration.shape_probe import (ShapedConstants, calibrate_model, fit_bandwidth, model_gemms,
                                                 probe_all_reduce_sizes, probe_block, probe_model_gemms, shape_key,
                                                 strategy_workload)

__all__ = ["CACHE_ENV", "CACHE_VERSION", "COMPONENTS", "DeviceConstants", "LearningPredictor", "Predictor",
           "ShapedConstants", "calibrate_device", "calibrate_model", "cost_model_predictor", "default_cache_path",
           "device_kind", "fit_bandwidth", "fit_option_effects", "fit_weights", "kendall_tau", "load_cache",
           "model_gemms", "option_keys", "probe_all_reduce", "probe_all_reduce_sizes", "probe_block", "probe_matmul",
           "probe_model_gemms", "shape_key", "strategy_workload"]
