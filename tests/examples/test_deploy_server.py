"""examples/deploy/server.py: start on 127.0.0.1 (tiny Llama, TP=2), call /generate, stop, no worker left."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from atorch.testing import tiny_llama

SERVER = Path(__file__).resolve().parents[2] / "examples" / "deploy" / "server.py"


def _post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of an exited child still answers kill(0): look at its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.heavy  # two worker processes import torch and transformers: tens of seconds under load
def test_server_generates_the_unsharded_tokens_and_leaves_no_worker():
    proc = subprocess.Popen([sys.executable, str(SERVER), "--model", "tiny", "--tensor-parallel-size", "2",
                             "--port", "0", "--max-new-tokens-limit", "64"], stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        port, pids = ready["port"], ready["worker_pids"]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        prompt = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]
        body = {"input_ids": prompt, "max_new_tokens": 10, "num_beams": 2, "no_repeat_ngram_size": 2}
        status, answer = _post(port, body)
        assert status == 200, answer
        model = tiny_llama(seed=0).eval()
        ids = torch.tensor(prompt)
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=3, max_new_tokens=10,
                                      num_beams=2, no_repeat_ngram_size=2)
        assert answer["output_ids"] == expected.tolist()
        assert len(answer["text"]) == 2 and all(isinstance(t, str) for t in answer["text"])
        status, answer = _post(port, {"input_ids": prompt, "max_new_tokens": "ten"})
        assert status == 400 and "max_new_tokens must be a int" in answer["error"]
        status, answer = _post(port, {"prompt": "x"})
        assert status == 400 and "unknown field(s) ['prompt']" in answer["error"]
        # What the request asks cannot run, the workers are fine: 400 without a traceback (503 is for a dead
        # worker); a repetition_penalty of 0, which the workers' generate refused, is now refused before them.
        for bad, says in (({"input_ids": prompt, "max_new_tokens": 2, "repetition_penalty": 0.0},
                           "repetition_penalty must be > 0"),
                          ({"input_ids": [[5, 5000]]}, "token ids in [0, 1024)"),
                          ({"text": ""}, "non-empty string")):
            status, answer = _post(port, bad)
            assert status == 400 and says in answer["error"] and "Traceback" not in answer["error"], answer
        # Limits (the workers run one request at a time): new tokens past --max-new-tokens-limit, and a prompt plus
        # new tokens past the tiny model's max_position_embeddings=256, are a 400 before the workers see them.
        long_prompt = [[5 + i % 700 for i in range(250)]]
        for bad, says in (({"input_ids": prompt, "max_new_tokens": 3000}, "exceeds this server's limit of 64"),
                          ({"input_ids": [[5] * 300], "max_new_tokens": 2}, "max_position_embeddings=256"),
                          ({"input_ids": long_prompt, "max_new_tokens": 7}, "ask for at most 6 new tokens")):
            status, answer = _post(port, bad)
            assert status == 400 and says in answer["error"], answer
        for body in ({"input_ids": long_prompt, "max_new_tokens": 6}, {"input_ids": long_prompt}):  # what fits runs
            status, answer = _post(port, body)
            assert status == 200 and 250 < len(answer["output_ids"][0]) <= 256, answer
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "stopped" in proc.stdout.read()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "a deploy worker outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
