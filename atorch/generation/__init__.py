"""Generation helpers: vectorized no-repeat-n-gram blocking and the generate switch that uses it."""

from atorch.generation.generate import FUSED_NGRAM_KEYWORD, enable_fused_generate, fuse_ngram_processors
from atorch.generation.ngram import FusedNoRepeatNGramLogitsProcessor

__all__ = ["FUSED_NGRAM_KEYWORD", "FusedNoRepeatNGramLogitsProcessor", "enable_fused_generate",
           "fuse_ngram_processors"]
