"""The data pipeline on 3 gloo ranks posing as 2 nodes (ranks 0-1 and rank 2): one index build per
node, the same samples everywhere, sharded epochs that cover every sample, and a builder failure,
arguments that differ between ranks, a bad argument on one rank or token ids outside the vocabulary (read
once per node) raised the same on every rank."""

import os

import torch
from torch.utils.data import DataLoader, DistributedSampler

from atorch import distributed as adist
from atorch.data import DatasetForCausalLM, DatasetPreprocessor, DistributedProxySampler, InfiniteDataLoader
from atorch.testing import run_distributed
from atorch.testing.assets import corpus_documents, load_tokenizer

SEQ = 32
BATCH = 4
LOCAL_RANKS = [0, 1, 0]


def _pipeline(prefix):
    rank = adist.rank()
    # Node A holds ranks 0 and 1, node B rank 2, on one shared filesystem.
    os.environ["LOCAL_RANK"] = str(LOCAL_RANKS[rank])
    builds = []
    real_build = DatasetForCausalLM._build_index

    def counting_build(self):
        builds.append(self.split_type)
        real_build(self)

    DatasetForCausalLM._build_index = counting_build
    train = DatasetForCausalLM(prefix, SEQ, "train", 0.0, 0.9, seed=1)
    valid = DatasetForCausalLM(prefix, SEQ, "valid", 0.9, 1.0, seed=1)

    # The wrapped sampler must give every rank the same order: a seeded, epoch-aware shuffle
    # (its set_epoch is driven through the proxy).
    inner = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=7)
    sampler = DistributedProxySampler(inner, seed=3)
    loader = InfiniteDataLoader(DataLoader(train, batch_size=BATCH, sampler=sampler))
    per_epoch = -(-len(sampler) // BATCH)
    epochs, batches_match = [], True
    for epoch in range(2):
        sampler.set_epoch(epoch)
        indices = list(sampler)
        epochs.append(indices)
        # The next pass of the infinite loader sets the same epoch and yields those samples.
        for b in range(per_epoch):
            batch = next(loader)
            expected = torch.stack([train[i]["input_ids"] for i in indices[b * BATCH:(b + 1) * BATCH]])
            batches_match &= torch.equal(batch["input_ids"], expected) and torch.equal(batch["labels"], expected)
        batches_match &= inner.epoch == epoch

    def boom(self):
        raise OSError("disk full")

    DatasetForCausalLM._build_index = boom
    try:
        DatasetForCausalLM(prefix, 16, "boom", seed=2)
        failure = None
    except Exception as e:  # noqa: BLE001 - the message is the result
        failure = f"{type(e).__name__}: {e}"
    DatasetForCausalLM._build_index = real_build
    # Ranks given different arguments built or read different index files (FileNotFoundError on rank 1);
    # one rank's bad argument left the others with gloo's "Connection closed by peer".
    disagreements = []
    for kwargs in ({"max_seq_length": 16 + rank}, {"max_seq_length": 16, "end_weight": 1.5 if rank == 2 else 1.0}):
        try:
            DatasetForCausalLM(prefix, split_type="odd", seed=2, **kwargs)
            disagreements.append(None)
        except Exception as e:  # noqa: BLE001 - the message is the result
            disagreements.append(f"{type(e).__name__}: {e}")
    # A token id outside the model's vocabulary: read once per node (local ranks 0), refused on every rank.
    from atorch.data import causal_lm

    scans = []
    real_bounds = causal_lm.token_id_bounds

    def counting_bounds(tokens):
        scans.append(tokens.prefix)
        return real_bounds(tokens)

    causal_lm.token_id_bounds = counting_bounds
    try:
        DatasetForCausalLM(prefix, 16, "vocab", seed=2, vocab_size=100)
        vocab = None
    except Exception as e:  # noqa: BLE001 - the message is the result
        vocab = f"{type(e).__name__}: {e}"
    causal_lm.token_id_bounds = real_bounds
    return {
        "vocab": vocab, "scans": len(scans),
        "builds": builds, "lengths": (len(train), len(valid)), "epochs": epochs, "batches_match": batches_match,
        "fingerprint": [train.sample_tokens(i).tolist() for i in (0, len(train) // 2, len(train) - 1)]
        + [valid.sample_tokens(0).tolist()],
        "failure": failure, "disagreements": disagreements,
    }


def test_pipeline_on_two_nodes(tmp_path):
    prefix = str(tmp_path / "corpus")
    DatasetPreprocessor(load_tokenizer()).preprocess(corpus_documents(), prefix, progress_enabled=False)
    results = run_distributed(_pipeline, 3, prefix, timeout=180)

    # Only local ranks 0 build (both nodes may: a shared filesystem takes identical atomic renames).
    assert results[1]["builds"] == []
    assert results[0]["builds"] + results[2]["builds"], "no rank built the index"
    assert all(set(r["builds"]) <= {"train", "valid"} for r in results)
    cached = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".npy")
    assert len(cached) == 6 and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    # Every rank reads the same samples.
    assert len({str(r["lengths"]) + str(r["fingerprint"]) for r in results}) == 1
    n_train = results[0]["lengths"][0]
    for epoch in range(2):
        shards = [r["epochs"][epoch] for r in results]
        assert all(len(s) == -(-n_train // 3) for s in shards)
        flat = [i for s in shards for i in s]
        assert set(flat) == set(range(n_train))  # none missing
        assert len(flat) - len(set(flat)) == -(-n_train // 3) * 3 - n_train  # repeats: only the padding
    assert [r["epochs"][0] for r in results] != [r["epochs"][1] for r in results]
    assert all(r["batches_match"] for r in results)

    # A failing build reaches every rank as the same exception instead of a hang at a barrier.
    assert {r["failure"] for r in results} == {"OSError: building the sample index " + str(tmp_path / "corpus")
                                               + "_boom_16sl_0_1_2s_*.npy on the local rank 0 of each node failed on "
                                               "ranks [0, 2]: disk full"}, results[0]["failure"]
    # Different arguments, or a bad one on one rank: the same actionable error on every rank.
    assert len({str(r["disagreements"]) for r in results}) == 1, [r["disagreements"] for r in results]
    differ, bad = results[0]["disagreements"]
    assert differ.startswith("ValueError: DatasetForCausalLM") and "max_seq_length" in differ and "18" in differ, differ
    assert bad.startswith("ValueError: DatasetForCausalLM failed on rank [2]: need 0 <= start_weight < end_weight "
                          "<= 1"), bad
    assert not list(tmp_path.glob("corpus_odd_*")), "an index was built for arguments the ranks did not agree on"
    assert [r["scans"] for r in results] == [1, 0, 1]
    assert len({r["vocab"] for r in results}) == 1, [r["vocab"] for r in results]
    assert results[0]["vocab"].startswith("ValueError: DatasetForCausalLM failed on ranks [0, 2]: '" + prefix
                                          + ".bin' holds token id "), results[0]["vocab"]
    assert "but the model's vocab_size is 100" in results[0]["vocab"]
