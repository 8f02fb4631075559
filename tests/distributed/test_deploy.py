"""atorch.deploy: a TP=2 deployment gives the unsharded model's tokens, survives threads, and never leaks a worker.

Token parity is exact (greedy and beam search pick the same tokens when the gathered logits
differ from the unsharded ones by ~1e-7); forward logits: rtol = atol = 1e-5 (the row-parallel
all-reduce sums partial products in another order, measured ~2e-7).

Each deployment starts worker processes that import torch and transformers (tens of seconds
on a loaded machine), so each test checks a lot per deployment; all are `heavy`.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import atorch
from atorch.deploy import WorkerError
from atorch.testing import tiny_llama

PAD = 3
GEN = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=None)


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _prompts(rows, seed):
    ids = torch.randint(4, 200, (rows, 7), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = PAD, 0  # one left-padded row
    return ids, mask


@pytest.mark.heavy
def test_deployed_model_object_matches_unsharded_model_and_reports_a_dead_worker():
    model = tiny_llama(seed=1).eval()
    ids, mask = _prompts(3, 0)
    with torch.no_grad():
        expected = {
            "greedy": model.generate(ids, attention_mask=mask, **GEN),
            "beam": model.generate(ids, attention_mask=mask, num_beams=3, **GEN),
            "ngram": model.generate(ids, attention_mask=mask, num_beams=2, no_repeat_ngram_size=2, **GEN),
        }
        logits = model(ids, attention_mask=mask).logits
    with atorch.deploy(model, tensor_parallel_size=2) as deployed:
        pids = deployed.worker_pids
        assert len(pids) == 2 and deployed.tensor_parallel_size == 2
        assert deployed.config.to_dict() == model.config.to_dict()
        assert torch.equal(deployed.generate(ids, attention_mask=mask, **GEN), expected["greedy"])
        assert torch.equal(deployed.generate(ids, attention_mask=mask, num_beams=3, **GEN), expected["beam"])
        for fused in (False, True):
            got = deployed.generate(ids, attention_mask=mask, num_beams=2, no_repeat_ngram_size=2,
                                    fused_no_repeat_ngram_blocking=fused, **GEN)
            assert torch.equal(got, expected["ngram"])
        assert not torch.equal(expected["ngram"], expected["beam"][:, :expected["ngram"].shape[1]])
        out = deployed(ids, attention_mask=mask)
        assert type(out).__name__ == "CausalLMOutputWithPast" and out.logits.device == ids.device
        torch.testing.assert_close(out.logits, logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(deployed.forward(input_ids=ids, attention_mask=mask).logits, logits,
                                   rtol=1e-5, atol=1e-5)
        # Outputs that hold a KV cache (transformers 5 names the field `cache`): the cache stays with the workers.
        cached = deployed(ids, attention_mask=mask, use_cache=True)
        torch.testing.assert_close(cached.logits, logits, rtol=1e-5, atol=1e-5)
        scored = deployed.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True, **GEN)
        assert type(scored).__name__ == "GenerateDecoderOnlyOutput" and len(scored.scores) == GEN["max_new_tokens"]
        assert torch.equal(scored.sequences, expected["greedy"])
        assert all(getattr(o, name, None) is None for o in (cached, scored) for name in ("cache", "past_key_values"))

        # Sampling: one seed per call from the caller's RNG, so the caller's seed repeats it.
        sampled = []
        for _ in range(2):
            torch.manual_seed(7)
            sampled.append(deployed.generate(ids, attention_mask=mask, do_sample=True, top_k=20, **{
                k: v for k, v in GEN.items() if k != "do_sample"}))
        assert torch.equal(sampled[0], sampled[1])

        # A worker's error comes back as the same type; the deployment stays usable.
        with pytest.raises(ValueError, match="bogus") as info:
            deployed.generate(ids, bogus=1)
        assert "raised by deployed rank 0" in str(info.value)
        with pytest.raises(TypeError, match=r"\['stopping'\] is of type object"):
            deployed.generate(ids, stopping=object())

        # Concurrent callers are serialized, each gets its own answer.
        prompts = [_prompts(2, seed) for seed in range(4)]
        with torch.no_grad():
            wanted = [model.generate(p, attention_mask=m, **GEN) for p, m in prompts]
        results = [None] * 4

        def call(i):
            results[i] = deployed.generate(prompts[i][0], attention_mask=prompts[i][1], **GEN)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(torch.equal(r, w) for r, w in zip(results, wanted))

        # A GenerationConfig object (it travels as a dict; the workers rebuild it).
        from transformers import GenerationConfig

        got = deployed.generate(ids, attention_mask=mask, generation_config=GenerationConfig(**GEN))
        assert torch.equal(got, expected["greedy"])

        # A call the caller abandons (Ctrl-C, a request timeout): its reply is dropped before the next
        # call, which gets its own answer (it got the abandoned call's before).
        class Abandoned(Exception):
            pass

        def interrupt(signum, frame):
            raise Abandoned()

        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(Abandoned):
                deployed.generate(ids, attention_mask=mask, **{**GEN, "max_new_tokens": 2000})
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert torch.equal(deployed.generate(ids, attention_mask=mask, **GEN), expected["greedy"])
        torch.testing.assert_close(deployed(ids, attention_mask=mask).logits, logits, rtol=1e-5, atol=1e-5)

        # A dead worker: the next call raises a WorkerError naming it, instead of hanging.
        os.kill(pids[1], signal.SIGKILL)
        errors = []
        caller = threading.Thread(target=lambda: errors.append(pytest.raises(WorkerError, deployed.generate, ids,
                                                                             attention_mask=mask, **GEN)))
        caller.start()
        caller.join(timeout=60)
        assert not caller.is_alive(), "the call hung on a dead worker"
        assert "worker rank 1" in str(errors[0].value) and not deployed.is_alive()
        with pytest.raises(WorkerError, match="worker rank 1"):
            deployed(ids)
    assert _wait_gone(pids, 10) == [], "close() must end every worker"


CHILD = textwrap.dedent("""
    import json, sys, time, torch, atorch
    folder, ckpt = sys.argv[1], sys.argv[2]
    ids = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, num_beams=2, no_repeat_ngram_size=2,
              pad_token_id=3, eos_token_id=None)
    from_ckpt = atorch.deploy(ckpt, tensor_parallel_size=1)
    out_ckpt = from_ckpt.generate(ids, **kw).tolist()
    from_folder = atorch.deploy(folder, tensor_parallel_size=2, fuse=["norm"])  # fp32 FusedRMSNorm: exact
    out_folder = from_folder.generate(ids, **kw).tolist()
    print(json.dumps({"pids": from_ckpt.worker_pids + from_folder.worker_pids, "folder": out_folder,
                      "ckpt": out_ckpt}), flush=True)
    time.sleep(600)
""")


@pytest.mark.heavy
def test_folder_and_checkpoint_sources_and_workers_die_with_a_killed_parent(tmp_path):
    from atorch.checkpoint import save_checkpoint

    model = tiny_llama(seed=2).eval()
    model.save_pretrained(tmp_path / "hf")
    save_checkpoint(model, str(tmp_path / "ckpt"), save_optimizer=False)
    ids = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]])
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, num_beams=2,
                                  no_repeat_ngram_size=2, pad_token_id=3, eos_token_id=None).tolist()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "hf"), str(tmp_path / "ckpt")],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line, "the deploying process exited early"
        report = json.loads(line)
        assert report["folder"] == expected and report["ckpt"] == expected
        assert len(report["pids"]) == 3 and all(_alive(p) for p in report["pids"])
        child.kill()  # SIGKILL: no atexit, no close(); the workers must notice on their own
        child.wait()
        assert _wait_gone(report["pids"], 15) == [], "workers outlived a SIGKILLed parent"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_bad_arguments_are_value_errors_before_any_process_starts(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int, got 0"):
        atorch.deploy(tiny_llama(), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        atorch.deploy(tiny_llama(), device="tpu")
    with pytest.raises(ValueError, match="Sequential is not a Hugging Face transformers model"):
        atorch.deploy(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="neither an atorch checkpoint"):
        atorch.deploy(str(tmp_path))
    with pytest.raises(ValueError, match="neither a model object nor a directory"):
        atorch.deploy(str(tmp_path / "missing"))
    # A split the model's heads refuse: before the workers load anything (it was a WorkerError after).
    for source in (tiny_llama(), _saved_folder(tmp_path)):
        with pytest.raises(ValueError, match=r"deploy: tensor_parallel_size=3: .*num_attention_heads=4"):
            atorch.deploy(source, tensor_parallel_size=3)
    # LoRA checkpoints of both kinds: refused here with the merge to run (tensor-parallel LoRA was a WorkerError
    # "does not match LlamaForCausalLM: unexpected [...lora_B]" from the workers, peft's one after they started).
    checkpoints = _lora_checkpoints(tmp_path)
    monkeypatch.setattr(subprocess, "Popen", _no_worker)
    for kind, ckpt in checkpoints.items():
        for path in (ckpt, os.path.dirname(ckpt)):        # the checkpoint, and its root's `latest`
            with pytest.raises(ValueError, match=rf"is a {kind} LoRA checkpoint .*`atorch merge {ckpt} MERGED_DIR`"):
                atorch.deploy(path, tensor_parallel_size=2)
    # A corrupted checkpoint: verified here (each worker found it after starting: a WorkerError).
    from atorch.checkpoint import CheckpointError, save_checkpoint

    ckpt = save_checkpoint(tiny_llama(), str(tmp_path / "plain" / "step_1"), save_optimizer=False)
    shard = next(Path(ckpt, "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    for path in (ckpt, os.path.dirname(ckpt)):
        with pytest.raises(CheckpointError, match=rf"(?s)checkpoint {ckpt} failed verification.*{shard.name}: "
                                                  "truncated"):
            atorch.deploy(path, tensor_parallel_size=2)


def _no_worker(*args, **kwargs):
    raise AssertionError("deploy started a worker for a source it must refuse")


def _lora_checkpoints(tmp_path):
    """{kind: checkpoint dir} of a peft LoRA tiny Llama and of one with a tensor-parallel LoRA adapter (plain
    `lora_A`/`lora_B` parameters and a `lora_scaling` number, what meta.json records as `tp_lora`)."""
    from peft import LoraConfig, get_peft_model

    from atorch.checkpoint import save_checkpoint

    peft_model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"]))
    tp_model = tiny_llama()
    proj = tp_model.model.layers[0].self_attn.q_proj
    proj.lora_A = torch.nn.Parameter(torch.zeros(2, proj.in_features))
    proj.lora_B = torch.nn.Parameter(torch.zeros(proj.out_features, 2))
    proj.lora_scaling = 1.0
    return {kind: save_checkpoint(m, str(tmp_path / kind / "step_1"), save_optimizer=False)
            for kind, m in (("peft", peft_model), ("tensor-parallel", tp_model))}


def _saved_folder(tmp_path):
    folder = tmp_path / "hf"
    tiny_llama().save_pretrained(folder)
    return str(folder)


def test_the_proxy_has_the_folders_generation_defaults(tmp_path):
    """A folder's generation_config.json (do_sample=True) is what its workers' models use: the proxy reads
    it too, so it draws the per-call seed that makes sampling repeatable (it read config.json only)."""
    from transformers import GenerationConfig

    from atorch.deploy.launcher import _config_of, _generation_config_of, _source

    model = tiny_llama(seed=1)
    model.generation_config = GenerationConfig(do_sample=True, top_k=5)
    model.save_pretrained(tmp_path / "hf")
    source = _source(tmp_path / "hf")
    assert _generation_config_of(tmp_path / "hf", source, _config_of(tmp_path / "hf", source)).do_sample is True
    assert _generation_config_of(model, _source(model), model.config).top_k == 5
