"""Test and example support: the spawn helper, tiny models, the bundled corpus and tokenizer."""

from atorch.testing.models import (tiny_bert_config, tiny_bert_mlm, tiny_gpt2, tiny_gpt2_config, tiny_llama,
                                   tiny_llama_config)
from atorch.testing.spawn import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed", "tiny_bert_config", "tiny_bert_mlm", "tiny_gpt2",
           "tiny_gpt2_config", "tiny_llama", "tiny_llama_config"]
