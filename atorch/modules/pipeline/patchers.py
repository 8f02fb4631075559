"""Forward patchers: how each piece of a Hugging Face decoder runs as one pipeline layer.

A pipeline passes one tuple of tensors from layer to layer (and from stage to stage), while
a Hugging Face model calls its sub-modules with keyword arguments it computes once (position
ids, rotary embeddings, the 4-D causal mask). A *custom patcher* bridges the two: an ordered
mapping `{module path: patch_fn}` where `patch_fn(module, inputs) -> outputs` runs that
module on the tuple received from the previous layer. The path of an `nn.ModuleList` (the
transformer blocks) expands to one layer per block; paths before it are the "pre" pieces
(embeddings, always on the first stage), paths after it the "post" pieces (final norm and
head, always on the last stage).

The ready patchers below (Llama, GPT2) use one convention, so their pieces interoperate:
first layer input `(input_ids, attention_mask)`, or `(input_ids, attention_mask, position_ids)`
when the batch has position ids (left padding, packed rows; a batch without a mask then sends
one with no columns, `batches.no_mask`, for Hugging Face's `attention_mask=None`), between
layers `(hidden_states, attention_mask, position_ids)` (only `hidden_states` is floating point,
so it is the only tensor a pipeline sends gradients for), last layer output: the logits. A
first piece receives the batch's position_ids only when its patch says it takes them
(`patch_fn.takes_position_ids = True`, set on the ready patchers' embeddings); a native
pipeline refuses a batch with position_ids, or any key besides input_ids, attention_mask and
labels, that its first piece would not take.

ATorch's per-module form is accepted too (`expand_patcher` tells them apart by the keys): the
model is flattened into its leaf modules and the elements of its module lists, in definition
order (ATorch's `model_to_module_list`), and `{path: forward_patcher}` names some of them, the
blocks by their own paths (`"h.0"`, `"h.1"`, ...). A forward patcher is
`forward_patcher(forward, module) -> new_forward(inputs)`; an unnamed piece gets
`default_forward_patcher`, which feeds the leading inputs to the module and passes the rest
through. The blocks are the layers of the model's transformer block class
(`find_transformer_block_classes`). With `tie_first`, the first piece is the token embedding
and a last piece computes the logits with its weight (`logit_helper(embedding, outputs)`,
default `outputs @ weight.T`, vocabulary-parallel when the embedding is).
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch
import torch.nn.functional as F
from torch import nn

from atorch.utils.module_utils import find_transformer_block_classes

Tensors = Tuple[torch.Tensor, ...]
# patch_fn(module, inputs): run `module` on the tuple from the previous layer.
PatchFn = Callable[[Any, Tensors], Union[torch.Tensor, Tensors]]
CustomPatcher = Mapping[str, PatchFn]
# ATorch's convention: forward_patcher(module.forward, module) -> forward(inputs).
ForwardPatcher = Callable[[Callable[..., Any], nn.Module], Callable[[Tensors], Any]]
# ATorch's logit helper: logit_helper(embedding module, outputs of the last piece) -> logits.
LogitHelper = Callable[[nn.Module, Any], torch.Tensor]

PRE, BLOCK, POST = "pre", "block", "post"


@dataclass(frozen=True)
class PieceSpec:
    """One pipeline layer: the module at `path` of the model, run through `patch`."""

    path: str
    patch: PatchFn
    kind: str  # PRE, BLOCK or POST


def get_submodule(model: nn.Module, path: str) -> nn.Module:
    """`model.get_submodule(path)` with an error that lists the children of the deepest prefix of `path`
    that exists (where the path went wrong)."""
    try:
        return model.get_submodule(path)
    except AttributeError as e:
        parent, parent_path = model, ""
        for name in path.split("."):
            child = parent._modules.get(name)
            if child is None:
                break
            parent, parent_path = child, f"{parent_path}.{name}" if parent_path else name
        where = (f"{parent_path!r} ({type(parent).__name__}) has the sub-modules" if parent_path
                 else "its top-level modules are")
        raise ValueError(f"custom_patcher path {path!r} is not a sub-module of {type(model).__name__} "
                         f"({where} {list(parent._modules)})") from e


def expand_patcher(model: nn.Module, patcher: CustomPatcher, tie_first: bool = False,
                   logit_helper: Optional[LogitHelper] = None) -> List[PieceSpec]:
    """The pipeline layers of `model` in forward order.

    A patcher naming one nn.ModuleList (atorch's form) expands that path to one layer per
    block. A patcher naming blocks by their own paths and no module list (ATorch's per-module
    form) is expanded by `expand_per_module_patcher`, which uses `tie_first`/`logit_helper`.
    """
    if not isinstance(patcher, Mapping) or not patcher:
        raise ValueError(f"custom_patcher must be a non-empty mapping {{module path: patch_fn}}, got {patcher!r}")
    for path in patcher:
        get_submodule(model, path)  # names what the model has when a path is wrong
    block_paths = [p for p in patcher if isinstance(get_submodule(model, p), nn.ModuleList)]
    if not block_paths and is_per_module_patcher(model, patcher):
        per_module = cast(Mapping[str, ForwardPatcher], patcher)  # checked by is_per_module_patcher
        return expand_per_module_patcher(model, per_module, tie_first=tie_first, logit_helper=logit_helper)
    if len(block_paths) > 1:
        raise ValueError(f"custom_patcher must name exactly one nn.ModuleList (the transformer blocks); it names "
                         f"{len(block_paths)}: {block_paths} among {list(patcher)}")
    if not block_paths:
        layers = model_to_module_list(model)
        block = _block_class_name(model, layers)
        examples = [p for p, m in layers if type(m).__name__ == block][:2]
        named = ", ".join(f"{p!r} ({type(get_submodule(model, p)).__name__})" for p in patcher)
        raise ValueError(f"custom_patcher must name exactly one nn.ModuleList (the transformer blocks, atorch's "
                         f"form), or each transformer block by its own path (ATorch's per-module form, e.g. "
                         f"{examples}: the {block} layers of {type(model).__name__}); none of its keys is either: "
                         f"{named}")
    pieces: List[PieceSpec] = []
    kind = PRE
    for path, fn in patcher.items():
        if not callable(fn):
            raise ValueError(f"custom_patcher[{path!r}] = {fn!r} is not callable; expected patch_fn(module, inputs)")
        if path == block_paths[0]:
            blocks = cast(nn.ModuleList, get_submodule(model, path))  # block_paths are ModuleLists
            if len(blocks) == 0:
                raise ValueError(f"custom_patcher block list {path!r} is empty")
            pieces.extend(PieceSpec(f"{path}.{i}", fn, BLOCK) for i in range(len(blocks)))
            kind = POST
        else:
            pieces.append(PieceSpec(path, fn, kind))
    return pieces


# ---- ATorch's per-module form ----------------------------------------------------------------

def model_to_module_list(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """`(path, module)` of every leaf module and every element of a ModuleList/Sequential, in definition order.

    The layer list of ATorch's `PipeModuleFromRecordedMeta`: it is the forward order only for
    models that define their modules in the order they call them (GPT2Model, LlamaModel, ...).
    """
    out: List[Tuple[str, nn.Module]] = []

    def visit(module: nn.Module, path: str) -> None:
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            out.extend((f"{path}.{i}" if path else str(i), m) for i, m in enumerate(module))
        elif not module._modules:
            out.append((path, module))
        else:
            for name, child in module._modules.items():
                if child is not None:
                    visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    return out


def _block_class_name(model: nn.Module, layers: Sequence[Tuple[str, nn.Module]]) -> str:
    """The class name of the transformer blocks among `model`'s layers (`model_to_module_list`).

    The model's own block class where `find_transformer_block_classes` finds one among the layers
    (its `_no_split_modules`, else the class of its layer stack); otherwise the most common class
    among the layers (ATorch's partition rule), which can be wrong on a shallow model (a 2-layer
    GPT-2 has as many embeddings as blocks).
    """
    present = {type(m).__name__ for _, m in layers}
    for cls in find_transformer_block_classes(model):
        if cls.__name__ in present:
            return cls.__name__
    return Counter(type(m).__name__ for _, m in layers).most_common(1)[0][0]


def is_per_module_patcher(model: nn.Module, patcher: Mapping[str, Any]) -> bool:
    """True for ATorch's form: no key is a module list, and some key is one block's own path."""
    layers = model_to_module_list(model)
    block = _block_class_name(model, layers)
    block_paths = {p for p, m in layers if type(m).__name__ == block}
    containers = [p for p in patcher if isinstance(model.get_submodule(p), nn.ModuleList)]
    return not containers and any(p in block_paths for p in patcher)


def default_forward_patcher(forward: Callable[..., Any], module: nn.Module) -> Callable[[Any], Tensors]:
    """Feed the first k inputs to `forward` (k = its parameter count), pass the remaining ones through.

    E.g. an embedding receiving `(input_ids, position_ids, mask)` returns
    `(embeddings, position_ids, mask)`: the outputs replace as many leading inputs.
    """
    arity = len(inspect.signature(forward).parameters)

    @functools.wraps(forward)
    def patched(inputs: Any) -> Tensors:
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        out = forward(*inputs[:arity])
        out = out if isinstance(out, tuple) else (out,)
        return (*out, *inputs[len(out):])

    return patched


def _as_piece_patch(forward_patcher: ForwardPatcher) -> PatchFn:
    """An ATorch forward patcher as a `patch(module, inputs)` of this module."""

    def patch(module: nn.Module, inputs: Tensors) -> Any:
        return forward_patcher(module.forward, module)(inputs)

    patch.forward_patcher = forward_patcher  # type: ignore[attr-defined]
    return patch


def default_logit_helper(embedding: nn.Module, outputs: Any) -> torch.Tensor:
    """Logits from the last hidden states and the (tied) embedding weight.

    With a vocabulary-parallel embedding each rank computes the logits of its vocabulary
    slice (the loss must then be vocabulary-parallel, e.g. `vocab_parallel_cross_entropy`);
    the hidden states enter through `copy_to_group` so their gradient is summed over the slices.
    """
    hidden = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    if not isinstance(hidden, torch.Tensor):
        raise ValueError(f"the last pipeline piece must output a tensor or a tuple starting with one, got "
                         f"{type(outputs).__name__}")
    if getattr(embedding, "tp_size", 1) > 1:
        from atorch.modules.distributed_modules.mappings import copy_to_group

        hidden = copy_to_group(hidden, cast(Any, embedding).group)  # a tensor-parallel embedding's group
    return F.linear(hidden, cast(torch.Tensor, embedding.weight))


def expand_per_module_patcher(model: nn.Module, patcher: Mapping[str, ForwardPatcher], tie_first: bool = False,
                              logit_helper: Optional[LogitHelper] = None) -> List[PieceSpec]:
    """Pieces of ATorch's per-module form: every layer of `model_to_module_list`, in order.

    Named layers run through their forward patcher, the others through
    `default_forward_patcher`. The blocks (`_block_class_name`) must be contiguous. With
    `tie_first` a last piece computes the logits from the first piece's weight.
    """
    layers = model_to_module_list(model)
    paths = [p for p, _ in layers]
    unknown = [p for p in patcher if p not in paths]
    if unknown:
        raise ValueError(f"custom_patcher keys {unknown} are not pipeline layers of {type(model).__name__}; in the "
                         f"per-module form the layers are {paths}")
    for path, fn in patcher.items():
        if not callable(fn):
            raise ValueError(f"custom_patcher[{path!r}] = {fn!r} is not callable; expected "
                             "patch_fn(forward, module) -> forward(inputs)")
    if logit_helper is not None and not callable(logit_helper):
        raise ValueError(f"logit_helper={logit_helper!r} must be callable as logit_helper(embedding, outputs)")
    block = _block_class_name(model, layers)
    is_block = [type(m).__name__ == block for _, m in layers]
    first, last = is_block.index(True), len(is_block) - 1 - is_block[::-1].index(True)
    if not all(is_block[first:last + 1]):
        raise ValueError(f"the transformer blocks ({block}) of {type(model).__name__} are not contiguous in its "
                         f"layer list {paths}; the per-module form needs pre pieces, blocks, then post pieces")
    pieces = [PieceSpec(path, _as_piece_patch(patcher.get(path, default_forward_patcher)),
                        PRE if i < first else BLOCK if i <= last else POST)
              for i, (path, _) in enumerate(layers)]
    if tie_first:
        helper = logit_helper or default_logit_helper
        pieces.append(PieceSpec(pieces[0].path, lambda embedding, inputs: helper(embedding, inputs), POST))
    return pieces


def tied_piece_indices(model: nn.Module, pieces: Sequence[PieceSpec]) -> Optional[Tuple[int, int]]:
    """(embedding piece, head piece) indices when the head reuses the embedding's weight, else None.

    The per-module form's logit piece has the first piece's path; otherwise the model's own
    tied input/output embeddings are looked up (`tied_head_paths`).
    """
    if len(pieces) > 1 and pieces[-1].path == pieces[0].path:
        return 0, len(pieces) - 1
    paths = tied_head_paths(model, pieces)
    if paths is None:
        return None
    index_of = {p.path: i for i, p in enumerate(pieces)}
    return index_of[paths[0]], index_of[paths[1]]


class PatchedLayer(nn.Module):
    """A pipeline layer: a model piece and the patch that adapts its inputs and outputs.

    `path` is the piece's name in the original model, so a stage's weights can be mapped back
    to the model's state-dict keys (`path + "." + key`).
    """

    def __init__(self, module: nn.Module, patch: PatchFn, path: str):
        super().__init__()
        self.module = module
        self.patch = patch
        self.path = path

    def forward(self, inputs: Union[torch.Tensor, Tensors]) -> Union[torch.Tensor, Tensors]:
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        return self.patch(self.module, tuple(inputs))

    def extra_repr(self) -> str:
        return f"path={self.path!r}"


# ---- shared pieces of the ready patchers -----------------------------------------------------

def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    """Position ids 0..seq-1 for every row (no cache: training always starts at position 0)."""
    batch, seq = input_ids.shape[:2]
    # contiguous: pipelines send it to the next stage, and send needs contiguous tensors.
    return torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq).contiguous()


def _split_first(inputs: Tensors) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, mask, position ids) of a first piece's inputs: `(input_ids[, attention_mask[, position_ids]])`;
    the mask is all ones and the positions 0..seq-1 where absent."""
    input_ids = inputs[0]
    mask = inputs[1] if len(inputs) > 1 else torch.ones_like(input_ids)
    positions = inputs[2].contiguous() if len(inputs) > 2 else _positions(input_ids)
    return input_ids, mask, positions


def _mask_or_none(config: Any, mask: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
    """The 2-D padding mask a Hugging Face forward would pass its mask function.

    A mask with no columns stands for a batch without one (`atorch.modules.pipeline.batches.no_mask`).
    Hugging Face reads rows packed with several documents off the position ids (each document then
    attends to itself only) when the mask is None and there is no cache; its forward creates a cache
    whenever `config.use_cache` is set, in training too, and then masks causally over the whole row,
    as an all-ones mask does.
    """
    if mask.shape[-1]:
        return mask
    if getattr(config, "use_cache", True):
        return torch.ones(positions.shape, dtype=torch.long, device=positions.device)
    return None


def takes_position_ids(patch: Any) -> bool:
    """Whether a first piece's patch takes `(input_ids, attention_mask, position_ids)`: the ready patchers'
    do; a custom patch_fn (or ATorch forward patcher) says so with `fn.takes_position_ids = True`."""
    inner = getattr(patch, "forward_patcher", None)
    return bool(getattr(patch, "takes_position_ids", False) or getattr(inner, "takes_position_ids", False))


def pieces_take_position_ids(pieces: Sequence[PieceSpec]) -> bool:
    """Whether a pipeline of `pieces` receives the batch's position_ids (see `takes_position_ids`)."""
    return bool(pieces) and takes_position_ids(pieces[0].patch)


def _causal_mask(config: Any, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 sliding: bool = False) -> Any:
    """The 4-D mask (or None when the kernel masks causally itself) a Hugging Face block takes;
    `sliding`: the sliding-window variant, for the blocks whose `attention_type` says so."""
    # Imported here: masking_utils pulls in much of transformers, and patchers are built once.
    from transformers import masking_utils

    make = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
    # No cache in training: transformers 5.24 names the argument `cache` (`past_key_values` before).
    no_cache = {"cache": None} if "cache" in inspect.signature(make).parameters else {"past_key_values": None}
    return make(config=config, inputs_embeds=hidden, attention_mask=_mask_or_none(config, mask, positions),
                position_ids=positions, **no_cache)


def _final_norm(norm: nn.Module, inputs: Tensors) -> torch.Tensor:
    return norm(inputs[0])


def _head(head: Callable[[torch.Tensor], torch.Tensor], inputs: Tensors) -> torch.Tensor:
    return head(inputs[0])


# ---- Llama (and models with its layout) -------------------------------------------------------

def get_llama_custom_patcher(config: Any) -> Dict[str, PatchFn]:
    """Patcher for `LlamaForCausalLM`: embed_tokens, layers (rotary + causal mask per block), norm, lm_head.

    Each block recomputes the rotary cos/sin and the causal mask from the position ids and the
    2-D mask it receives: both are cheap next to a block, and only integer tensors then cross
    stage boundaries (floating cos/sin would be treated as activations needing gradients). The
    same pieces serve every family laid out as Llama (`get_llama_layout_patcher`).
    """
    return get_llama_layout_patcher(config)


def _family_rotary(config: Any) -> nn.Module:
    """The model family's own rotary embedding, built from the config alone (its buffers are
    computed from it): `<Family>RotaryEmbedding` of the family's transformers modeling module."""
    import importlib

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    model_type = config.model_type
    name = model_type_to_module_name(model_type)      # gemma3_text lives in transformers.models.gemma3
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    classes = [v for k, v in vars(module).items() if k.endswith("RotaryEmbedding") and isinstance(v, type)
               and issubclass(v, nn.Module) and v.__module__ == module.__name__]
    if len(classes) != 1:
        raise ValueError(f"model_type {model_type!r}: expected one *RotaryEmbedding class in {module.__name__}, found "
                         f"{sorted(c.__name__ for c in classes)}; pass custom_patcher={{module path: patch_fn}}")
    return classes[0](config=config)


# How each family's own forward picks the sliding-window mask (transformers 5.24): Mistral,
# Phi-3, Mixtral and Qwen3-MoE use it for every block when `config.sliding_window` is set;
# Qwen2, Qwen3 and Gemma-2 per block, by `config.layer_types`; Gemma never.
_SLIDING_RULES = {"mistral": "every layer", "phi3": "every layer", "mixtral": "every layer",
                  "qwen3_moe": "every layer", "phimoe": "every layer", "qwen2": "per layer", "qwen3": "per layer",
                  "gemma2": "per layer", "qwen2_moe": "per layer", "smollm3": "per layer", "exaone4": "per layer",
                  "gemma3_text": "per layer"}
# Scalars a family's own forward applies outside the blocks: (the config attribute the embedding's
# output is multiplied by, the one the logits are divided by). Granite: embedding_multiplier and
# logits_scaling (its residual and attention multipliers act inside the blocks).
_OUTER_SCALES = {"granite": ("embedding_multiplier", "logits_scaling")}
# Families laid out as Llama whose forward adds nothing outside the blocks but what the tables say
# (transformers 5.24, read one by one; checked piece by piece in tests/unit/test_pipeline_patchers.py).
LLAMA_LAYOUT_FAMILIES = ("mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "gemma", "gemma2",
                         "olmo2", "olmoe", "glm4", "ernie4_5", "helium", "seed_oss", "nemotron", "granite",
                         "qwen2_moe", "smollm3", "exaone4", "phimoe", "gemma3_text")


def get_llama_layout_patcher(config: Any) -> Dict[str, PatchFn]:
    """Patcher for the decoders laid out as Llama (model.embed_tokens, model.layers, model.norm,
    lm_head, a model-level rotary embedding): `LLAMA_LAYOUT_FAMILIES` (Mistral, Qwen2/3, Phi-3,
    Mixtral, Qwen3-MoE, Gemma whose embedding module scales by sqrt(hidden_size) itself, Gemma-2,
    OLMo-2, OLMoE, GLM-4, ERNIE-4.5, Helium, Seed-OSS, Nemotron, Granite, Qwen2-MoE, SmolLM3,
    EXAONE-4, PhiMoE, Gemma-3's text model). What they add to Llama's forward is done here as their own forward does it:
    the sliding-window mask where the family's own forward uses it (`_SLIDING_RULES`), Granite's
    embedding multiplier and logits scaling (`_OUTER_SCALES`), Gemma-2's final logit soft-capping,
    Gemma-3's rotary tables per layer type.
    Checked piece by piece against each family's own forward (tests/unit/test_pipeline_patchers.py).
    """
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{config.model_type} with use_bidirectional_attention=True: the pipeline pieces build "
                         "causal masks only; pass custom_patcher={module path: patch_fn}")
    rotary = _family_rotary(config)
    # Gemma-3's rotary embedding keeps one frequency table per layer type (local and global).
    per_type_rotary = "layer_type" in inspect.signature(rotary.forward).parameters
    softcap = getattr(config, "final_logit_softcapping", None)
    sliding_rule = _SLIDING_RULES.get(config.model_type, "none")
    embedding_attr, logits_attr = _OUTER_SCALES.get(config.model_type, (None, None))
    embedding_scale = getattr(config, embedding_attr) if embedding_attr else None
    logits_divisor = getattr(config, logits_attr) if logits_attr else None

    def layer_type(layer: nn.Module) -> Optional[str]:
        """config.layer_types' entry of a block, read through its attention."""
        attention = getattr(layer, "self_attn", None)
        kind = getattr(attention, "layer_type", None)
        index = getattr(attention, "layer_idx", None)
        if kind is None and index is not None and getattr(config, "layer_types", None):
            kind = config.layer_types[index]
        return kind

    def is_sliding(layer: nn.Module) -> bool:
        if sliding_rule == "every layer":     # a sliding window set in the config applies to every block
            return getattr(config, "sliding_window", None) is not None
        if sliding_rule == "per layer":
            return layer_type(layer) == "sliding_attention"
        return False

    def embed(embed_tokens: nn.Module, inputs: Tensors) -> Tensors:
        input_ids, mask, positions = _split_first(inputs)
        hidden = embed_tokens(input_ids)
        if embedding_scale is not None:
            hidden = hidden * embedding_scale
        return hidden, mask, positions

    embed.takes_position_ids = True  # type: ignore[attr-defined]

    def block(layer: nn.Module, inputs: Tensors) -> Tensors:
        hidden, mask, positions = inputs
        rotary.to(hidden.device)
        cos_sin = rotary(hidden, positions, layer_type(layer)) if per_type_rotary else rotary(hidden, positions)
        hidden = layer(hidden, attention_mask=_causal_mask(config, hidden, mask, positions, is_sliding(layer)),
                       position_ids=positions, position_embeddings=cos_sin)
        return hidden, mask, positions

    def head(lm_head: nn.Module, inputs: Tensors) -> torch.Tensor:
        logits = lm_head(inputs[0])
        if logits_divisor is not None:
            logits = logits / logits_divisor
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    return {"model.embed_tokens": embed, "model.layers": block, "model.norm": _final_norm, "lm_head": head}


# ---- GPT2 ----------------------------------------------------------------------------------

def get_gpt2_custom_patcher(config: Any) -> Dict[str, PatchFn]:
    """Patcher for `GPT2LMHeadModel`: wte, wpe, drop, h, ln_f, lm_head (tied to wte).

    Token and position embeddings are separate layers so the token embedding alone can be the
    weight tied to the LM head.
    """

    def token_embed(wte: nn.Module, inputs: Tensors) -> Tensors:
        input_ids, mask, positions = _split_first(inputs)
        return wte(input_ids), mask, positions

    token_embed.takes_position_ids = True  # type: ignore[attr-defined]

    def position_embed(wpe: nn.Module, inputs: Tensors) -> Tensors:
        hidden, mask, positions = inputs
        return hidden + wpe(positions), mask, positions

    def dropout(drop: nn.Module, inputs: Tensors) -> Tensors:
        hidden, mask, positions = inputs
        return drop(hidden), mask, positions

    def block(layer: nn.Module, inputs: Tensors) -> Tensors:
        hidden, mask, positions = inputs
        hidden = layer(hidden, None, _causal_mask(config, hidden, mask, positions), position_ids=positions)
        return hidden, mask, positions

    return {"transformer.wte": token_embed, "transformer.wpe": position_embed, "transformer.drop": dropout,
            "transformer.h": block, "transformer.ln_f": _final_norm, "lm_head": _head}


# model_type -> patcher factory. Only layouts tested here are listed.
PATCHER_PRESETS: Dict[str, Callable[[Any], Dict[str, PatchFn]]] = {
    "llama": get_llama_custom_patcher,
    "gpt2": get_gpt2_custom_patcher,
    **{model_type: get_llama_layout_patcher for model_type in LLAMA_LAYOUT_FAMILIES},
}


def model_config_of(model_or_config: Any) -> Any:
    return getattr(model_or_config, "config", model_or_config)


def get_custom_patcher(model_or_config: Any) -> Dict[str, PatchFn]:
    """The ready patcher for a model (or its config), found by `config.model_type`."""
    config = model_config_of(model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in PATCHER_PRESETS:
        raise ValueError(f"no pipeline patcher preset for model_type {model_type!r}; presets exist for "
                         f"{sorted(PATCHER_PRESETS)}. Pass custom_patcher={{module path: patch_fn}} "
                         "(see atorch.modules.pipeline.patchers)")
    return PATCHER_PRESETS[model_type](config)


def resolve_patcher(model: nn.Module, custom_patcher: Optional[CustomPatcher]) -> CustomPatcher:
    """The user's `custom_patcher`, else the preset of the model's type, checked against the model.

    A preset describes the model type's causal LM (embedding, blocks, norm, lm_head); a task head of the
    same type (ForSequenceClassification's `score`) shares the model_type, so the preset was found and its
    missing `lm_head` blamed on a custom_patcher the user never passed."""
    if custom_patcher is not None:
        return custom_patcher
    patcher = get_custom_patcher(model)
    modules = dict(model.named_modules())
    missing = [path for path in patcher if path not in modules]
    if missing:
        model_type = getattr(model_config_of(model), "model_type", "?")
        raise ValueError(f"pipeline: the {model_type!r} preset describes its causal LM (...ForCausalLM, trained on "
                         f"the language-model loss); {type(model).__name__} has no {missing} (its top-level modules "
                         f"are {list(model._modules)}). Pipelines train causal LMs only: use data, FSDP or tensor "
                         "parallelism for this model, or pass a custom_patcher for a model shaped like a causal LM")
    return patcher


def tied_head_paths(model: nn.Module, pieces: Sequence[PieceSpec]) -> Optional[Tuple[str, str]]:
    """(embedding path, head path) when the model's output head shares the input embedding's weight."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    emb, head = get_in(), get_out()
    if emb is None or head is None or getattr(head, "weight", None) is None or head.weight is not emb.weight:
        return None
    if getattr(head, "bias", None) is not None:
        return None  # a head with its own bias is not a pure view of the embedding
    names = {id(m): n for n, m in model.named_modules()}
    paths = {p.path for p in pieces}
    emb_path, head_path = names.get(id(emb)), names.get(id(head))
    if emb_path in paths and head_path in paths:
        return emb_path, head_path
    return None
