"""`plan_cluster`: the cost model's ranked strategies for a model on a cluster that is not here.

"What should I use for this model on these devices?" answered before renting them: the
model (a causal language model: `check_causal_lm`; a sequence longer than its positions is
refused as `auto_accelerate` refuses it: `check_seq_len`) is built on the meta device (no weights,
no GPU), the automatic search space is enumerated for the cluster's world size and global batch
(as `auto_accelerate`'s search does), candidates whose layout the global batch does not split
over are refused with `validate_batch_layout` (`auto_accelerate` would refuse them), and every other candidate gets
the cost model's memory per device and step time. Nothing runs; the figures are predictions (see
`atorch.auto.cost_model` for what they include), ranked by predicted throughput among the
candidates that fit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import pandas as pd
import torch

from atorch.auto.token_limits import position_limit
from atorch.auto.devices import DeviceSpec, device_spec
from atorch.auto.search.space import SearchSpace

# Configs of well-known models, for planning without a config file (numbers from their papers
# and model cards; no weights are involved).
MODEL_PRESETS = {
    "llama2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "llama2-13b": dict(model_type="llama", hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                       num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                       max_position_embeddings=4096),
    "llama2-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
    "gpt2-xl": dict(model_type="gpt2", n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024),
}


def load_model_config(model: str) -> Any:
    """A transformers config from a preset name, a config.json path, or a model directory.

    A file is read by transformers itself (`AutoConfig.from_pretrained`, offline for a local file), so what
    `save_pretrained` writes loads here as it loads in `from_pretrained` (e.g. an infinite float, written as
    `{"__float__": "Infinity"}`). A file that is not a model config, or whose values transformers refuses, is a
    ValueError naming the file and transformers' reason.
    """
    from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

    if model in MODEL_PRESETS:
        values: Dict[str, Any] = dict(MODEL_PRESETS[model])
        return CONFIG_MAPPING[values.pop("model_type")](**values)
    path = model
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--model {model!r} is neither a preset ({sorted(MODEL_PRESETS)}) nor a config.json or a "
                         "model directory that has one")
    try:
        values, _ = PretrainedConfig.get_config_dict(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--model {model!r}: {path} is not a JSON model config ({_cause(e)})") from None
    if not isinstance(values, dict) or "model_type" not in values:
        # Checked here: transformers would guess the type from the file's path instead.
        raise ValueError(f"{path} has no model_type; it is not a Hugging Face model config")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers' validation raises several types (huggingface_hub's too)
        raise ValueError(f"--model {model!r}: transformers refuses {path} as a {values['model_type']!r} config: "
                         f"{' '.join(str(e).split())}") from None


def _cause(error: BaseException) -> str:
    """The JSON parser's reason for `error` (transformers wraps it in a generic OSError), else `error` itself."""
    inner: Optional[BaseException] = error
    while inner is not None:
        if isinstance(inner, (json.JSONDecodeError, UnicodeDecodeError)):
            return str(inner)
        inner = inner.__cause__ or inner.__context__
    return str(error)


def check_seq_len(config: Any, seq_len: int, name: str = "seq_len") -> None:
    """ValueError naming `name` when `seq_len` is longer than the model's positions: `auto_accelerate`
    refuses such samples (`check_sequence_length`), so there is nothing to plan for them."""
    limit = position_limit(config)
    if limit is not None and seq_len > limit[1]:
        field_name, value = limit
        raise ValueError(f"{name}={seq_len} is longer than the model's {field_name}={value} "
                         f"({type(config).__name__}), which auto_accelerate refuses; use {name} <= {value}")


def check_causal_lm(config: Any) -> None:
    """ValueError unless `config` describes a causal language model, which is what the planner builds.

    Refused, from the config alone (before anything is built): encoder-decoder configs
    (`is_encoder_decoder`), configs transformers has no causal-LM class for
    (`MODEL_FOR_CAUSAL_LM_MAPPING`), and encoder-only architectures (those with a masked-LM class,
    `MODEL_FOR_MASKED_LM_MAPPING`) not configured as a decoder (`is_decoder` False): their
    causal-LM class (e.g. BertLMHeadModel) would attend in both directions.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING

    if getattr(config, "is_encoder_decoder", False):
        why = "it is an encoder-decoder config (is_encoder_decoder=True)"
    elif type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        why = f"transformers has no causal-LM class for {type(config).__name__} (AutoModelForCausalLM cannot build it)"
    elif type(config) in MODEL_FOR_MASKED_LM_MAPPING and not getattr(config, "is_decoder", False):
        why = ("it is an encoder-only architecture with is_decoder=False (its causal-LM class would attend in both "
               "directions); set is_decoder to true in the config to plan it as a decoder")
    else:
        return
    architectures = getattr(config, "architectures", None)
    named = f"model_type {getattr(config, 'model_type', '?')!r}" + (
        f" (architectures {list(architectures)})" if architectures else "")
    raise ValueError(f"{named} is not a causal language model: {why}; atorch plan plans causal (decoder) language "
                     "models")


def meta_model(config: Any) -> torch.nn.Module:
    """The causal language model of `config` on the meta device (ValueError unless it is one: `check_causal_lm`)."""
    from transformers import AutoModelForCausalLM

    check_causal_lm(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


_REFUSED_COLUMNS = ["strategy", "reason"]


def _count(n: int) -> str:
    """A parameter count in the unit that shows it: 6.74B, 125.0M, 213.3K, 512."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


@dataclass
class ClusterPlan:
    """The ranked candidates (`table`), what does not fit (`too_big`), what `auto_accelerate` would
    refuse because the global batch does not split over its layout (`refused`), and the inputs."""

    table: pd.DataFrame
    too_big: pd.DataFrame
    device: DeviceSpec
    world_size: int
    num_params: int
    rejected: List[str] = field(default_factory=list)
    refused: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=_REFUSED_COLUMNS))
    memory_limit_bytes: Optional[int] = None
    """The memory per device the candidates were checked against; None: the device's own."""

    def format(self, top: int = 15) -> str:
        own = self.device.memory_bytes
        limit = self.memory_limit_bytes if self.memory_limit_bytes is not None else own
        # The header states the limit the candidates were checked against, the override included.
        memory = (f"{own / 1e9:.0f} GB each" if limit == own else
                  f"{limit / 1e9:.4g} GB each, --device-memory-gb overriding the device's {own / 1e9:.0f} GB")
        lines = [f"{_count(self.num_params)} parameters on {self.world_size} x {self.device.name} "
                 f"({memory}); predictions of the cost model, nothing was run", ""]
        if self.table.empty:
            lines.append("no candidate strategy fits in device memory")
        else:
            shown = self.table.head(top).copy()
            shown["memory_gb"] = shown["memory_gb"].map(lambda v: f"{v:.3g}")   # a tiny model's 0.0012, not 0.0
            shown["step_time_s"] = shown["step_time_s"].map(lambda v: f"{v:.3g}")
            shown["samples_per_s"] = shown["samples_per_s"].map(lambda v: f"{v:.4g}")
            lines.append(shown.to_string(index=False))
        if not self.too_big.empty:
            lines += ["", f"{len(self.too_big)} candidate(s) do not fit, e.g.:"]
            for row in self.too_big.head(5).itertuples():
                lines.append(f"  {row.strategy}: {row.reason}")
        if not self.refused.empty:
            lines += ["", f"{len(self.refused)} candidate(s) refused: the global batch does not split over their "
                          "layout (auto_accelerate would refuse them):"]
            for reason, group in self.refused.groupby("reason", sort=False):
                more = f" (and {len(group) - 1} more like it)" if len(group) > 1 else ""
                lines.append(f"  {group['strategy'].iloc[0]}{more}: {reason}")
        return "\n".join(lines)


def plan_cluster(model_config: Any, world_size: int, device: str, global_batch: int, seq_len: int,
                 nnodes: int = 1, device_memory_bytes: Optional[int] = None) -> ClusterPlan:
    """Rank the automatic space's candidates for `model_config` on `world_size` devices of kind `device`."""
    from atorch.auto.cost_model import calibrated_shape, estimate

    if world_size < 1 or global_batch < 1 or seq_len < 1 or nnodes < 1:
        raise ValueError(f"world_size={world_size}, global_batch={global_batch}, seq_len={seq_len} and "
                         f"nnodes={nnodes} must all be >= 1")
    if device_memory_bytes is not None and device_memory_bytes <= 0:
        raise ValueError(f"device_memory_bytes={device_memory_bytes} must be > 0 (None: the device's own memory)")
    check_seq_len(model_config, seq_len)
    spec = device_spec(device)
    limit = device_memory_bytes if device_memory_bytes is not None else spec.memory_bytes
    model = meta_model(model_config)   # refuses a model that is not a causal LM (`check_causal_lm`)
    shape = calibrated_shape(model, seq_len)
    device_type = "cpu" if device == "cpu" else "cuda"
    per_node = world_size // nnodes
    space = SearchSpace.default_for(model, world_size, device_type, global_batch_size=global_batch,
                                    ranks_per_node=per_node if nnodes > 1 else None)
    profile = spec.profile(multi_node=nnodes > 1, ranks_per_node=per_node)
    rows, too_big = [], []
    candidates = space.candidates()
    # Enumeration refuses the layouts the global batch does not split over (as auto_accelerate would).
    refused = [{"strategy": s, "reason": why} for s, why in space.batch_refused.items()]
    for candidate in candidates:
        est = estimate(shape, candidate.strategy, global_batch, seq_len, world_size, device_type, profile=profile)
        row = {"strategy": candidate.label(), "memory_gb": est.peak_memory_bytes / 1e9,
               "step_time_s": est.step_time_s, "samples_per_s": est.throughput(global_batch)}
        if est.peak_memory_bytes > limit:
            # 4 digits: one decimal printed "predicted 80.0 GB > 80.0 GB" for 80.04 against 80.
            too_big.append({**row, "reason": f"predicted {est.peak_memory_bytes / 1e9:.4g} GB > "
                                             f"{limit / 1e9:.4g} GB per device"})
        else:
            rows.append(row)
    table = pd.DataFrame(rows, columns=["strategy", "memory_gb", "step_time_s", "samples_per_s"])
    table = table.sort_values(["samples_per_s", "memory_gb"], ascending=[False, True]).reset_index(drop=True)
    table.insert(0, "rank", range(1, len(table) + 1))
    big = pd.DataFrame(too_big, columns=["strategy", "memory_gb", "step_time_s", "samples_per_s", "reason"])
    big = big.sort_values("memory_gb").reset_index(drop=True)
    if refused and not rows and not too_big:
        reasons = list(dict.fromkeys(r["reason"] for r in refused))
        raise ValueError(f"the global batch {global_batch} splits over the layout of none of the {len(refused)} "
                         f"candidate strategies for {world_size} device(s), so auto_accelerate would refuse every one: "
                         + "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else ""))
    return ClusterPlan(table, big, spec, world_size, shape.num_params, sorted(space.rejected)[:20],
                       pd.DataFrame(refused, columns=_REFUSED_COLUMNS), memory_limit_bytes=limit)
