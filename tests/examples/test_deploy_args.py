"""examples/deploy/server.py without workers: its argument checks, its tokenizer lookup and its request checks."""

import json
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def server(load_example):
    return load_example("deploy/server.py")


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent"], "--model '/nonexistent' is neither 'tiny' nor a directory"),
    (["--model", "tiny", "--tensor-parallel-size", "3"],
     "--tensor-parallel-size=3 does not divide the model's num_attention_heads=4; use one of [1, 2, 4]"),
    (["--model", "tiny", "--tensor-parallel-size", "0"], "--tensor-parallel-size=0 must be >= 1"),
    (["--model", "tiny", "--max-new-tokens-limit", "0"], "--max-new-tokens-limit=0 must be >= 1"),
    (["--model", "tiny", "--max-sequences-limit", "0"], "--max-sequences-limit=0 must be >= 1"),
])
def test_bad_model_or_tensor_size_is_a_usage_error_before_any_worker(server, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        server.main(argv + ["--port", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_width_the_tensor_size_does_not_divide_is_a_usage_error(server, capsys, tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=91, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=1, vocab_size=128).save_pretrained(tmp_path)   # heads split over 2, the MLP not
    with pytest.raises(SystemExit) as exc:
        server.main(["--model", str(tmp_path), "--tensor-parallel-size", "2", "--port", "0"])
    assert exc.value.code == 2
    assert "--tensor-parallel-size=2 does not divide the model's intermediate_size=91; use one of [1, 7, 13, 91]" \
        in capsys.readouterr().err


def test_a_corrupted_checkpoint_is_a_usage_error_before_any_worker(server, capsys, tmp_path, monkeypatch):
    """It was found by each worker after they started: a WorkerError traceback per rank, exit 1."""
    import subprocess

    from atorch.checkpoint import save_checkpoint
    from atorch.testing import tiny_llama

    ckpt = save_checkpoint(tiny_llama(seed=0), str(tmp_path / "step_1"), save_optimizer=False)
    shard = next((tmp_path / "step_1" / "dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started for a corrupted checkpoint")

    monkeypatch.setattr(subprocess, "Popen", no_worker)
    for model in (ckpt, str(tmp_path)):      # the checkpoint, and its root's `latest`
        with pytest.raises(SystemExit) as exc:
            server.main(["--model", model, "--port", "0"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        line = f": error: checkpoint {ckpt} failed verification, nothing was loaded: {shard}: checksum mismatch"
        assert line in err and "Traceback" not in err, err
        assert len([x for x in err.splitlines() if "error:" in x]) == 1, err


def test_workers_that_fail_to_start_end_the_server_with_one_line(server, capsys, monkeypatch):
    def failing_deploy(*args, **kwargs):
        raise server.WorkerError("deployed model: rank 0 failed while building the model: OSError: no weights in "
                                 "/m\n  and more\nTraceback (most recent call last):\n  File \"worker.py\", line 1")

    monkeypatch.setattr(server.atorch, "deploy", failing_deploy)
    with pytest.raises(SystemExit) as exc:
        server.main(["--model", "tiny", "--port", "0"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    # (the program name is argv[0]'s: server.py when run as a script)
    assert err.endswith(": error: the workers could not start: deployed model: rank 0 failed while building the "
                        "model: OSError: no weights in /m and more\n") and err.count("\n") == 1, err


def test_the_tokenizer_an_atorch_checkpoint_records_is_found(server, tmp_path, capsys):
    from atorch.testing.assets import load_tokenizer

    checkpoint = tmp_path / "step_2"
    load_tokenizer().save_pretrained(checkpoint / "tokenizer")   # where save_checkpoint records it
    assert server.tokenizer_folder(str(checkpoint)) == str(checkpoint / "tokenizer")
    tokenizer = server.load_tokenizer(str(checkpoint))
    assert tokenizer("hello world")["input_ids"] == load_tokenizer()("hello world")["input_ids"]
    load_tokenizer().save_pretrained(tmp_path / "hf")             # a merged folder holds it at the top
    assert server.tokenizer_folder(str(tmp_path / "hf")) == str(tmp_path / "hf")
    # None: said on stderr, naming both folders looked in.
    (tmp_path / "bare").mkdir()
    assert server.load_tokenizer(str(tmp_path / "bare")) is None
    assert f"no tokenizer in {tmp_path / 'bare'} nor in {tmp_path / 'bare' / 'tokenizer'}" in capsys.readouterr().err


def test_a_broken_tokenizer_stops_the_server_naming_the_folder(server, tmp_path):
    broken = tmp_path / "m" / "tokenizer"
    broken.mkdir(parents=True)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"the tokenizer in .*m/tokenizer cannot be loaded"):
        server.load_tokenizer(str(tmp_path / "m"))


def parse(server, request, limit=8, positions=16, sequences=4, **model):
    """`_parse` of a handler in front of a model with 1024 tokens and `positions` positions, limited to `limit` new
    tokens and `sequences` sequences at once."""
    config = SimpleNamespace(vocab_size=1024, max_position_embeddings=positions)
    handler = SimpleNamespace(model=SimpleNamespace(config=config, **model), tokenizer=None, max_new_tokens_limit=limit,
                              max_sequences_limit=sequences)
    return server.GenerateHandler._parse(handler, json.loads(json.dumps(request, allow_nan=True)))


@pytest.mark.parametrize("request_, message", [
    ({"input_ids": [[True, False]]}, r"lists of ints \(not booleans\)"),
    ({"input_ids": [[5, 6]], "num_beams": 0}, "num_beams must be >= 1, got 0"),
    ({"input_ids": [[5, 6]], "top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
    ({"input_ids": [[5, 6]], "top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"input_ids": [[5, 6]], "top_p": -0.1}, r"top_p must be in \(0, 1\], got -0.1"),
    # The server's limits: one long request held the workers while every other client waited, and a prompt
    # past the model's positions was accepted.
    ({"input_ids": [[5, 6]], "max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    ({"input_ids": [[5, 6]], "max_new_tokens": 9},
     r"max_new_tokens=9 exceeds this server's limit of 8 \(--max-new-tokens-limit\)"),
    ({"input_ids": [[5] * 12], "max_new_tokens": 5}, "the prompt's 12 tokens \\+ max_new_tokens=5 exceed this model's "
     "max_position_embeddings=16; ask for at most 4 new tokens"),
    ({"input_ids": [[5] * 16]}, "the prompt has 16 tokens; this model reads at most max_position_embeddings=16"),
    # Unbounded rows x beams held a KV cache each in the workers' memory.
    ({"input_ids": [[5, 6]] * 3, "num_beams": 2}, r"3 prompt row\(s\) x num_beams=2 = 6 sequences exceed this "
     r"server's limit of 4 \(--max-sequences-limit\)"),
    ({"input_ids": [[5, 6]] * 5}, r"5 prompt row\(s\) x num_beams=1 = 5 sequences exceed"),
    ({"input_ids": [[5, 6]], "temperature": 0.0, "do_sample": True}, "temperature must be > 0, got 0.0"),
    ({"input_ids": [[5, 6]], "top_k": -1}, "top_k must be >= 0, got -1"),
    ({"input_ids": [[5, 6]], "repetition_penalty": 0}, "repetition_penalty must be > 0, got 0"),
    ({"input_ids": [[5, 6]], "no_repeat_ngram_size": -2}, "no_repeat_ngram_size must be >= 0, got -2"),
    ({"input_ids": [[5, 6]], "min_new_tokens": -1}, "min_new_tokens must be >= 0, got -1"),
    ({"input_ids": [[5, 6]], "min_new_tokens": 5, "max_new_tokens": 3}, "min_new_tokens=5 exceeds max_new_tokens=3$"),
    # The max_new_tokens compared with is the server's default, which the client never sent: said, with the fix.
    ({"input_ids": [[5, 6]], "min_new_tokens": 9}, r"min_new_tokens=9 exceeds max_new_tokens=8, the server's default "
     r"for a request without max_new_tokens \(transformers' default of 20, cut to 8 by --max-new-tokens-limit=8\); "
     r"send max_new_tokens >= 9 in the request \(this server allows at most 8: --max-new-tokens-limit\)"),
    # Both prompts: text was silently dropped.
    ({"input_ids": [[5, 6]], "text": "hello"}, "send either input_ids or text, not both"),
    # json.loads reads NaN and Infinity: they reached generate() (NaN temperature failed in the workers).
    ('{"input_ids": [[5, 6]], "temperature": Infinity}', "temperature must be a finite number, got inf"),
    ('{"input_ids": [[5, 6]], "temperature": NaN}', "temperature must be a finite number, got nan"),
    ('{"input_ids": [[5, 6]], "repetition_penalty": Infinity}', "repetition_penalty must be a finite number"),
    ('{"input_ids": [[5, 6]], "top_p": -Infinity}', "top_p must be a finite number, got -inf"),
    # stop_strings needs the tokenizer object in the workers: refused with what to use instead.
    ({"input_ids": [[5, 6]], "stop_strings": ["the"]}, "stop_strings is not supported: .*send eos_token_id"),
    ({"input_ids": [[5, 6]], "eos_token_id": [7, True]}, "eos_token_id must be a token id or a non-empty list"),
    ({"input_ids": [[5, 6]], "eos_token_id": []}, "eos_token_id must be a token id or a non-empty list"),
    ({"input_ids": [[5, 6]], "eos_token_id": 1024}, r"eos_token_id must be token ids in \[0, 1024\), got \[1024\]"),
])
def test_requests_generate_cannot_run_are_refused_with_the_reason(server, request_, message):
    with pytest.raises(ValueError, match=message):
        parse(server, json.loads(request_) if isinstance(request_, str) else request_)


def test_valid_requests_pass(server):
    ids, options = parse(server, {"input_ids": [[5, 6]], "num_beams": 2, "top_p": 1, "max_new_tokens": 3})
    assert ids.tolist() == [[5, 6]] and options == {"num_beams": 2, "top_p": 1, "max_new_tokens": 3}
    assert parse(server, {"input_ids": [[5] * 12], "max_new_tokens": 4})[1]["max_new_tokens"] == 4   # 16 positions
    assert parse(server, {"input_ids": [[5, 6]] * 2, "num_beams": 2})[0].shape == (2, 2)   # 4 sequences: the limit
    # eos_token_id, what a deployed model stops on instead of stop_strings: one id or a list, sent as a list.
    assert parse(server, {"input_ids": [[5, 6]], "eos_token_id": 7})[1]["eos_token_id"] == [7]
    assert parse(server, {"input_ids": [[5, 6]], "eos_token_id": [7, 9]})[1]["eos_token_id"] == [7, 9]


@pytest.mark.parametrize("prompt, limit, positions, model_default, expected", [
    (2, 64, 256, None, 20),   # transformers' default
    (2, 8, 256, None, 8),     # cut to the server's limit
    (12, 64, 16, None, 4),    # cut to the positions left
    (2, 64, None, 30, 30),    # the model's generation config; a model without a position bound
])
def test_a_request_without_max_new_tokens_gets_a_length_within_the_limits(server, prompt, limit, positions,
                                                                          model_default, expected):
    generation = SimpleNamespace(max_new_tokens=model_default)
    _, options = parse(server, {"input_ids": [[5] * prompt]}, limit=limit, positions=positions,
                       generation_config=generation)
    assert options["max_new_tokens"] == expected


def test_min_new_tokens_past_the_models_default_length_names_where_that_length_comes_from(server):
    generation = SimpleNamespace(max_new_tokens=5)
    with pytest.raises(ValueError, match=r"min_new_tokens=6 exceeds max_new_tokens=5, the server's default for a "
                       r"request without max_new_tokens \(the model's generation_config.max_new_tokens=5\); send "
                       r"max_new_tokens >= 6 in the request"):
        parse(server, {"input_ids": [[5, 6]], "min_new_tokens": 6}, generation_config=generation)
    assert parse(server, {"input_ids": [[5, 6]], "min_new_tokens": 6, "max_new_tokens": 6},
                 generation_config=generation)[1] == {"min_new_tokens": 6, "max_new_tokens": 6}
    # Cut by the positions the prompt leaves (16 - 12 = 4), under the server's limit of 8.
    with pytest.raises(ValueError, match=r"max_new_tokens=4, the server's default .*\(transformers' default of 20, cut "
                       r"to 4 by the 4 positions the model has left after the prompt\); send max_new_tokens >= 5"):
        parse(server, {"input_ids": [[5] * 12], "min_new_tokens": 5})
