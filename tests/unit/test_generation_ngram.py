"""FusedNoRepeatNGramLogitsProcessor bans exactly what transformers' NoRepeatNGramLogitsProcessor bans.

Parity is exact (torch.equal on the processed scores, token equality on generate): both set the
same positions to -inf and leave every other score bit-identical, so there is no tolerance to state.
Token ids are drawn from a small range so that most rows contain repeated n-grams to ban.
"""

import copy
import threading

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from atorch.generation import FusedNoRepeatNGramLogitsProcessor, enable_fused_generate, fuse_ngram_processors
from atorch.testing import tiny_gpt2, tiny_llama

PAD = 3


def _random_rows(rows, length, high, seed, pad_to=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, high, (rows, length), generator=g)
    if pad_to:  # left padding of varying width, as a padded batch reaches the processors
        widths = torch.randint(0, pad_to, (rows,), generator=g)
        for r, w in enumerate(widths.tolist()):
            ids[r, :w] = PAD
    return ids


@pytest.mark.parametrize("rows", [1, 2, 64, 256])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("padded", [False, True])
def test_processor_bans_exactly_what_transformers_bans(rows, n, padded):
    vocab = 40
    for length in (n - 1, n, 17, 80):
        if length < 1:
            continue
        ids = _random_rows(rows, length, high=6 if n > 2 else 30, seed=rows * 100 + n + length,
                           pad_to=length // 2 if padded else 0)
        scores = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(length))
        expected = NoRepeatNGramLogitsProcessor(n)(ids, scores.clone())
        before = scores.clone()
        got = FusedNoRepeatNGramLogitsProcessor(n)(ids, scores)
        assert torch.equal(got, expected), (rows, n, length, padded)
        assert torch.equal(scores, before), "inplace=False must leave the caller's scores untouched"
        got_inplace = FusedNoRepeatNGramLogitsProcessor(n, inplace=True)(ids, scores)
        assert got_inplace.data_ptr() == scores.data_ptr() and torch.equal(got_inplace, expected)
        if length == 80 and rows >= 64:
            assert torch.isinf(expected).any(), "the sample should exercise banning"


def test_ids_outside_the_score_matrix_are_never_banned_and_dtypes_are_kept():
    # An embedding larger than the LM head: ids >= vocab can be in input_ids but have no score.
    ids = torch.tensor([[50, 7, 50, 7, 50], [7, 50, 7, 50, 7], [1, 2, 1, 2, 1]], dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        scores = torch.zeros(3, 10, dtype=dtype)
        expected = NoRepeatNGramLogitsProcessor(2)(ids.long(), scores.clone())
        got = FusedNoRepeatNGramLogitsProcessor(2)(ids, scores)
        assert got.dtype == dtype and torch.equal(got, expected)
        assert torch.isinf(got[0, 7]) and torch.isinf(got[2, 2]) and not torch.isinf(got[1]).any()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_bad_ngram_size_is_a_value_error(bad):
    with pytest.raises(ValueError, match="ngram_size"):
        FusedNoRepeatNGramLogitsProcessor(bad)


def test_mismatched_shapes_are_a_value_error():
    with pytest.raises(ValueError, match="same rows"):
        FusedNoRepeatNGramLogitsProcessor(2)(torch.zeros(2, 5, dtype=torch.long), torch.zeros(3, 10))


def test_fuse_ngram_processors_keeps_the_position():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), NoRepeatNGramLogitsProcessor(3),
                                      TopKLogitsWarper(5)])
    fused = fuse_ngram_processors(processors, inplace=True)
    assert [type(p).__name__ for p in fused] == ["TemperatureLogitsWarper", "FusedNoRepeatNGramLogitsProcessor",
                                                 "TopKLogitsWarper"]
    assert fused[1].ngram_size == 3 and fused[1].inplace


def _prompts(rows, length, padded, seed):
    ids = _random_rows(rows, length, high=12, seed=seed) + 4  # ids 4..15: no bos/eos/pad in the prompt
    mask = torch.ones_like(ids)
    if padded:
        for r in range(rows):
            w = r % (length // 2)
            ids[r, :w] = PAD
            mask[r, :w] = 0
    return ids, mask


class _CountCalls:
    def __init__(self):
        self.calls = 0
        self.original = FusedNoRepeatNGramLogitsProcessor.__call__

    def __enter__(self):
        counter = self

        def counting(processor, input_ids, scores):
            counter.calls += 1
            return counter.original(processor, input_ids, scores)

        FusedNoRepeatNGramLogitsProcessor.__call__ = counting
        return self

    def __exit__(self, *exc):
        FusedNoRepeatNGramLogitsProcessor.__call__ = self.original


@pytest.mark.parametrize("make_model", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("rows,n,beams,padded", [
    (1, 2, 1, False), (16, 3, 1, True), (64, 2, 1, True), (4, 4, 3, False), (8, 5, 2, True), (3, 2, 4, True), (256, 3, 1, True),
    (32, 2, 4, True),
])
def test_generate_with_the_fused_switch_gives_the_same_tokens(make_model, rows, n, beams, padded):
    model = enable_fused_generate(make_model(seed=1).eval())
    model.generation_config.pad_token_id = PAD
    ids, mask = _prompts(rows, 10, padded, seed=rows + n)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, num_beams=beams,
                  no_repeat_ngram_size=n, eos_token_id=None)
    with torch.no_grad():
        expected = model.generate(**kwargs)
        with _CountCalls() as counter:
            got = model.generate(**kwargs, fused_no_repeat_ngram_blocking=True)
        unblocked = model.generate(**{**kwargs, "no_repeat_ngram_size": 0})
    assert counter.calls == 24, "the fused processor must run once per generated token"
    assert torch.equal(got, expected)
    if n <= 3:  # random tiny models loop at once; a 2- or 3-gram ban must change the output
        assert not torch.equal(unblocked, expected)


def test_fused_processor_in_a_logits_processor_list_and_output_logits_untouched():
    model = tiny_gpt2(seed=2).eval()  # no enable_fused_generate needed for a processor list
    ids, mask = _prompts(8, 8, padded=True, seed=0)
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=PAD,
                  eos_token_id=None, return_dict_in_generate=True, output_logits=True, output_scores=True)
    with torch.no_grad():
        expected = model.generate(**common, no_repeat_ngram_size=2)
        got = model.generate(**common, logits_processor=LogitsProcessorList([FusedNoRepeatNGramLogitsProcessor(2)]))
        enable_fused_generate(model)
        switched = model.generate(**common, no_repeat_ngram_size=2, fused_no_repeat_ngram_blocking=True)
    for out in (got, switched):
        assert torch.equal(out.sequences, expected.sequences)
        # output_logits must stay the raw logits: the switch only bans in place when they are not kept.
        for a, b in zip(out.logits, expected.logits):
            assert torch.equal(a, b) and not torch.isinf(a).any()
        for a, b in zip(out.scores, expected.scores):
            assert torch.equal(a, b)


def test_switch_is_per_call_per_thread_and_survives_deepcopy():
    model = enable_fused_generate(tiny_gpt2(seed=3).eval())
    ids, mask = _prompts(2, 8, padded=False, seed=1)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD,
                  no_repeat_ngram_size=2, eos_token_id=None)
    copied = copy.deepcopy(model)
    assert copied.generate.__self__ is copied
    with torch.no_grad(), _CountCalls() as counter:
        results = {}
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(
            k, model.generate(**kwargs, fused_no_repeat_ngram_blocking=k))) for k in (True, False)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert counter.calls == 8, "only the thread that asked for the fused processor may use it"
        assert torch.equal(results[True], results[False])
        assert torch.equal(copied.generate(**kwargs, fused_no_repeat_ngram_blocking=True), results[True])
    with pytest.raises(ValueError, match="fused_no_repeat_ngram_blocking"):
        model.generate(**kwargs, fused_no_repeat_ngram_blocking="yes")


def test_models_prepared_by_auto_accelerate_take_the_switch():
    from atorch.auto.accelerate import auto_accelerate

    model = tiny_llama(seed=4)
    reference = copy.deepcopy(model).eval()
    status, result, _ = auto_accelerate(model, load_strategy=["module_replace"])
    assert status
    ids, mask = _prompts(4, 8, padded=True, seed=2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD,
                  no_repeat_ngram_size=2, eos_token_id=None, num_beams=2)
    with torch.no_grad(), _CountCalls() as counter:
        got = result.model.eval().generate(**kwargs, fused_no_repeat_ngram_blocking=True)
        expected = reference.generate(**kwargs)
    assert counter.calls == 12 and torch.equal(got, expected)
