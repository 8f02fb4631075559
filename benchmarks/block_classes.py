"""Which classes atorch takes for a model's transformer blocks, over every architecture transformers can build.

    OMP_NUM_THREADS=1 python benchmarks/block_classes.py      # ~20 s, models on the meta device

For each model type of transformers' causal-LM, masked-LM, seq2seq, image- and sequence-classification
mappings (default configs, built on the meta device), the classes its `_no_split_modules` names and the
ones `find_transformer_block_classes` keeps (those standing in a layer stack), listing the models where
they differ. The blocks are FSDP2's units and what `checkpoint` recomputes; an embedding taken for a
block made a tied masked-LM head unshardable (session 27).
"""

import logging
import warnings

import torch
import transformers
from transformers import AutoConfig
from transformers.models.auto import modeling_auto

from atorch.utils import module_utils

MAPPINGS = {"causal": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            "masked": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
            "seq2seq": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
            "image": modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
            "sequence-classification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES}


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    seen, built, unbuilt, changed = set(), 0, 0, []
    for kind, mapping in MAPPINGS.items():
        for model_type, class_name in mapping.items():
            if isinstance(class_name, (list, tuple)):
                class_name = class_name[0]
            if (model_type, class_name) in seen:
                continue
            seen.add((model_type, class_name))
            try:
                config = AutoConfig.for_model(model_type)
                with torch.device("meta"):
                    model = getattr(transformers, class_name)(config)
            except Exception:  # noqa: BLE001 - a model type without a default config or class: not counted
                unbuilt += 1
                continue
            built += 1
            named = [c.__name__ for c in module_utils._classes_from_no_split_modules(model)]
            kept = [c.__name__ for c in module_utils.find_transformer_block_classes(model)]
            if named and named != kept:
                changed.append(f"{kind} {model_type}: named {named} -> blocks {kept}")
    print(f"models built: {built} (not buildable from a default config: {unbuilt}); "
          f"blocks differ from the named classes: {len(changed)}")
    for line in changed:
        print(" ", line)


if __name__ == "__main__":
    main()
