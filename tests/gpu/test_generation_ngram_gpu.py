"""FusedNoRepeatNGramLogitsProcessor on CUDA (skipped without it by tests/conftest.py).

The same tensor ops run on the GPU: banned positions must equal transformers' processor run
on the CPU copy, exactly, and a CUDA generate with the switch must give transformers' tokens.
"""

import torch
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from atorch.generation import FusedNoRepeatNGramLogitsProcessor, enable_fused_generate
from atorch.testing import tiny_llama

DEVICE = torch.device("cuda")


def test_processor_on_cuda_matches_transformers_on_cpu():
    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 4, 5):
        ids = torch.randint(0, 8, (256, 300), generator=g)
        scores = torch.randn(256, 32000, generator=g)
        expected = NoRepeatNGramLogitsProcessor(n)(ids, scores.clone())
        for inplace in (False, True):
            got = FusedNoRepeatNGramLogitsProcessor(n, inplace=inplace)(ids.to(DEVICE), scores.to(DEVICE))
            assert got.device.type == "cuda" and torch.equal(got.cpu(), expected)


def test_generate_on_cuda_with_the_switch_gives_the_same_tokens():
    model = enable_fused_generate(tiny_llama(seed=1).to(DEVICE).eval())
    ids = torch.randint(4, 16, (32, 10), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                  num_beams=2, no_repeat_ngram_size=3, pad_token_id=3, eos_token_id=None)
    with torch.no_grad():
        assert torch.equal(model.generate(**kwargs, fused_no_repeat_ngram_blocking=True), model.generate(**kwargs))
