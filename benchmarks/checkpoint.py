"""Checkpoint save / load seconds and MB/s: atorch.checkpoint vs torch.save / torch.load of the same state.

Run:  .venv/bin/python benchmarks/checkpoint.py            # ~270 MB model (fp32), 3 repeats
      .venv/bin/python benchmarks/checkpoint.py --hidden 512 --layers 2 --repeats 1   # quick
      .venv/bin/python benchmarks/checkpoint.py --targets --hidden 768 --layers 12 --vocab 32000  # issue 19
      # issue 19 at ~1B (1004.6 M, model + AdamW 12 GB; ~16 GiB RSS for both ranks; no async: its copy does not fit):
      .venv/bin/python benchmarks/checkpoint.py --targets --hidden 2048 --layers 17 --intermediate 5632 \
          --vocab 32000 --repeats 5 --torch-chunk-mb 1024 --skip-async --skip-sha256

Measured per case, median of `--repeats`, each in a fresh directory under `--dir`:
  * torch.save / torch.load(weights_only=True) of the state dict (one file, no fsync), and
    torch.save followed by fsync (what durability costs without anything else);
  * save_checkpoint / load_checkpoint in one process: DCP shards, a checksum of every file
    (xxh3_128, taken while writing), fsync, manifest, atomic rename; load verifies every checksum first;
  * the same with the AdamW state (weights + 2 moments: 3x the bytes);
  * sha256 of the checkpoint's files alone (done once in save, once in load);
  * 2 ranks, FSDP2 (each rank writes and reads its half), model + optimizer.
With --targets (issue 19), only: 2 FSDP2 ranks, model + AdamW, interleaved per repeat: each rank
torch.save + fsync of its own local tensors (the same bytes) / torch.load of them, vs save_checkpoint
(synchronous), save_checkpoint(async_save=True) (seconds until it returns = training blocked, and
until committed), load_checkpoint (into the live model and optimizer; --fresh-target: a new one);
plus sha256 vs xxh3_128 over the checkpoint's files; per-repeat ratios and each rank's peak RSS.
The ranks build the model on the meta device and materialize only their own shards; torch.save files
of at most --torch-chunk-mb are torch.load-ed one at a time and dropped, so at most one extra copy of
the state exists at a time (the async staging copy, unless --skip-async).
MB/s is the checkpoint's bytes on disk over the seconds. The disk cache is not dropped
between write and read (no root-only knobs): reads measure the page cache plus hashing.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch


def _config(hidden: int, layers: int, vocab: int, intermediate: Optional[int] = None):
    from atorch.testing.models import tiny_llama_config

    return tiny_llama_config(hidden_size=hidden, intermediate_size=intermediate or hidden * 8 // 3 // 64 * 64,
                             num_hidden_layers=layers, num_attention_heads=hidden // 64,
                             num_key_value_heads=hidden // 64, vocab_size=vocab)


def _model(hidden: int, layers: int, vocab: int, intermediate: Optional[int] = None):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config(hidden, layers, vocab, intermediate))


def _param_count(hidden: int, layers: int, vocab: int, intermediate: Optional[int] = None) -> int:
    """Parameters of the bench model, counted on the meta device (no memory, any size)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(_config(hidden, layers, vocab, intermediate))
    return sum(p.numel() for p in model.parameters())


def _sharded_model(hidden: int, layers: int, vocab: int, intermediate: Optional[int], mesh):
    """FSDP2 model built on the meta device; only this rank's shards are ever allocated.

    A ~1B model in fp32 is 4 GB per rank when built whole; here each rank holds its half only.
    Values: N(0, 0.02) from a per-rank seed (a checkpoint's bytes, not a trained model).
    """
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(_config(hidden, layers, vocab, intermediate))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1000 + mesh.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, 0.02, generator=gen)
    return model


def _one_adamw_step(model):
    """AdamW with its state after one step, one parameter at a time.

    Gradients of the whole model at once would be another 4 bytes per parameter, and the foreach
    step's temporaries more; here one parameter's gradient exists at a time and is freed
    (set_to_none) after its step, so the peak is the state itself (12 bytes per parameter).
    """
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
        optim.step()
        p.grad = None
    optim.zero_grad(set_to_none=True)
    return optim


def _with_optimizer_state(model):
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optim.step()
    optim.zero_grad(set_to_none=True)
    return optim


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median(values: List[float]) -> float:
    return statistics.median(values)


def bench_single(args, root: str) -> List[Dict[str, object]]:
    from atorch.checkpoint import load_checkpoint, save_checkpoint
    from atorch.checkpoint import manifest as mf

    model = _model(args.hidden, args.layers, args.vocab)
    optim = _with_optimizer_state(model)
    rows = []
    for with_optim in (False, True):
        state = {"model": model.state_dict()}
        if with_optim:
            state["optim"] = optim.state_dict()
        times: Dict[str, List[float]] = {k: [] for k in ("torch.save", "torch.save+fsync", "torch.load",
                                                         "atorch save", "atorch load", "sha256 of the files")}
        sizes = {}
        for i in range(args.repeats):
            path = os.path.join(root, f"t{i}.pt")
            times["torch.save"].append(_timed(lambda: torch.save(state, path)))
            sizes["torch"] = os.path.getsize(path)
            times["torch.load"].append(_timed(lambda: torch.load(path, weights_only=True)))
            os.remove(path)

            def save_and_fsync():
                with open(path, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())

            times["torch.save+fsync"].append(_timed(save_and_fsync))
            os.remove(path)

            ckpt = os.path.join(root, f"c{i}", "step_1")
            times["atorch save"].append(_timed(lambda: save_checkpoint(
                model, ckpt, step=1, optimizer=optim if with_optim else None)))
            sizes["atorch"] = _dir_bytes(ckpt)
            # Hashing is part of both save (manifest) and load (verification): its share of each.
            times["sha256 of the files"].append(_timed(lambda: [mf.sha256_file(os.path.join(ckpt, n))
                                                                for n in mf.list_files(ckpt)]))
            target = _model(args.hidden, args.layers, args.vocab)
            target_optim = torch.optim.AdamW(target.parameters(), lr=1e-4) if with_optim else None
            times["atorch load"].append(_timed(lambda: load_checkpoint(target, ckpt, optimizer=target_optim)))
            shutil.rmtree(os.path.join(root, f"c{i}"))
        what = "model + AdamW" if with_optim else "model"
        for name, values in times.items():
            nbytes = sizes["torch" if name.startswith("torch") else "atorch"]
            rows.append({"case": f"{what}, 1 process", "op": name, "seconds": _median(values),
                         "MB": nbytes / 1e6, "MB/s": nbytes / 1e6 / _median(values)})
    return rows


def _fsdp_rank(hidden: int, layers: int, vocab: int, root: str, repeats: int) -> Dict[str, List[float]]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from atorch import distributed as adist
    from atorch.checkpoint import load_checkpoint, save_checkpoint

    adist.create_parallel_group(([("data", dist.get_world_size())], None))

    def build():
        model = _model(hidden, layers, vocab)
        for layer in model.model.layers:
            fully_shard(layer, mesh=adist.device_mesh("data"))
        fully_shard(model, mesh=adist.device_mesh("data"))
        return model

    model = build()
    optim = _with_optimizer_state(model)
    out: Dict[str, List[float]] = {"save": [], "load": [], "bytes": []}
    for i in range(repeats):
        ckpt = os.path.join(root, f"fsdp{i}", "step_1")
        dist.barrier()
        out["save"].append(_timed(lambda: save_checkpoint(model, ckpt, step=1, optimizer=optim)))
        out["bytes"].append(float(_dir_bytes(ckpt)))
        target = build()
        target_optim = torch.optim.AdamW(target.parameters(), lr=1e-4)
        dist.barrier()
        out["load"].append(_timed(lambda: load_checkpoint(target, ckpt, optimizer=target_optim)))
        del target, target_optim
        dist.barrier()
    del model, optim
    dist.barrier()
    return out


def _local_state(model, optim) -> Dict[str, torch.Tensor]:
    """This rank's own tensors of the model and AdamW state (DTensor local shards), for torch.save."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    out = {f"model.{k}": local(v) for k, v in model.state_dict().items()}
    for i, st in enumerate(optim.state.values()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"optim.{i}.{k}"] = local(v)
    return out


def _all_gather_values(values: List[float]) -> List[List[float]]:
    import torch.distributed as dist

    gathered: List[List[float]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, values)
    return gathered


def _chunks(tensors: Dict[str, torch.Tensor], max_bytes: int) -> List[Dict[str, torch.Tensor]]:
    """`tensors` in groups of at most `max_bytes` (a larger tensor is a group of its own), in order."""
    from atorch.checkpoint.merge import group_by_bytes

    return group_by_bytes(tensors.items(), max_bytes)


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _targets_rank(hidden: int, layers: int, vocab: int, root: str, repeats: int,
                  fresh_target: bool = False, intermediate: Optional[int] = None, torch_chunk_mb: int = 0,
                  skip_async: bool = False, skip_sha256: bool = False,
                  atorch_crc32: bool = False, ab_crc32: bool = False) -> Dict[str, List[float]]:
    import contextlib

    import torch.distributed as dist

    from atorch import distributed as adist
    from atorch.checkpoint import load_checkpoint, save_checkpoint, wait_for_checkpoint
    from atorch.checkpoint import manifest as mf
    from atorch.checkpoint.async_save import checkpointer

    if atorch_crc32:  # the "before" of session 4: torch.save's CRC32 pass inside atorch's data files too
        from atorch.checkpoint import hashing_writer

        hashing_writer._no_crc32_in_this_thread = contextlib.nullcontext  # type: ignore[assignment]
    adist.create_parallel_group(([("data", dist.get_world_size())], None))
    mesh = adist.device_mesh("data")

    def build():
        return _sharded_model(hidden, layers, vocab, intermediate, mesh)

    model = build()
    optim = _one_adamw_step(model)
    rank = dist.get_rank()
    ops = ["torch.save+fsync", "atorch save", "torch.load", "atorch load", "xxh3_128 of the files"]
    if not skip_sha256:
        ops.append("sha256 of the files")
    if not skip_async:
        ops += ["atorch async: blocked", "atorch async: until committed"]
    if ab_crc32:
        ops.append("atorch save, CRC32 kept (before)")
    out: Dict[str, List[float]] = {op: [] for op in ops}
    out["bytes"], out["torch bytes"], out["RSS after repeat GiB"] = [], [], []

    def timed_all(fn):
        dist.barrier()
        t = _timed(fn)
        dist.barrier()
        return t

    target = target_optim = None
    for i in range(repeats):
        local = _local_state(model, optim)
        # torch.save of this rank's tensors; with --torch-chunk-mb in files of at most that size,
        # so that torch.load can be timed one file at a time, its result dropped at once (a
        # whole-state torch.load result would be another full copy of the state). The files are
        # fsynced after the last one is written, as one file's single fsync would be (an fsync
        # after each file would stall the writing while the disk catches up).
        groups = _chunks(local, torch_chunk_mb * 2**20) if torch_chunk_mb else [local]
        paths = [os.path.join(root, f"torch_rank{rank}_{i}_{j}.pt") for j in range(len(groups))]

        def save_and_fsync():
            files = [open(path, "wb") for path in paths]
            try:
                for group, f in zip(groups, files):
                    torch.save(group, f)
                    f.flush()
                for f in files:
                    os.fsync(f.fileno())
            finally:
                for f in files:
                    f.close()

        def load_and_drop():
            for path in paths:
                loaded = torch.load(path, weights_only=True)
                del loaded

        out["torch.save+fsync"].append(timed_all(save_and_fsync))
        out["torch bytes"].append(float(sum(os.path.getsize(p) for p in paths)))
        out["torch.load"].append(timed_all(load_and_drop))
        for path in paths:
            os.remove(path)
        del local, groups

        ckpt = os.path.join(root, f"sync{i}", "step_1")
        out["atorch save"].append(timed_all(lambda: save_checkpoint(model, ckpt, step=1, optimizer=optim)))
        out["bytes"].append(float(_dir_bytes(ckpt)))
        if target is None:
            # Default: load into the live model and optimizer (what torch.load is compared with:
            # reading the state, not building an optimizer). --fresh-target: a new model and an
            # AdamW without state (the load's zero step builds it), at the cost of a second copy.
            target, target_optim = (build(), None) if fresh_target else (model, optim)
            if target_optim is None:
                target_optim = torch.optim.AdamW(target.parameters(), lr=1e-4)
        out["atorch load"].append(timed_all(lambda: load_checkpoint(target, ckpt, optimizer=target_optim)))
        # Comparisons after the load, so that the load, like torch.load, reads what its save just wrote.
        names = mf.list_files(ckpt)[rank::dist.get_world_size()]
        for algo in ("xxh3_128",) if skip_sha256 else ("sha256", "xxh3_128"):
            out[f"{algo} of the files"].append(timed_all(
                lambda: [mf.checksum_file(os.path.join(ckpt, n), algo) for n in names]))
        if ab_crc32:  # the same save with torch.save's CRC32 pass kept (as before session 4), interleaved
            from atorch.checkpoint import hashing_writer

            skip = hashing_writer._no_crc32_in_this_thread
            hashing_writer._no_crc32_in_this_thread = contextlib.nullcontext  # type: ignore[assignment]
            before = os.path.join(root, f"crc{i}", "step_1")
            out["atorch save, CRC32 kept (before)"].append(timed_all(
                lambda: save_checkpoint(model, before, step=1, optimizer=optim)))
            hashing_writer._no_crc32_in_this_thread = skip  # type: ignore[assignment]
            if rank == 0:
                shutil.rmtree(os.path.dirname(before))
            dist.barrier()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.dirname(ckpt))

        if not skip_async:
            actkpt = os.path.join(root, f"async{i}", "step_1")
            dist.barrier()
            start = time.perf_counter()
            save_checkpoint(model, actkpt, step=1, optimizer=optim, async_save=True)
            out["atorch async: blocked"].append(time.perf_counter() - start)
            wait_for_checkpoint()
            out["atorch async: until committed"].append(time.perf_counter() - start)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(os.path.dirname(actkpt))
        out["RSS after repeat GiB"].append(_rss_gib())
        # Each repeat as it ends (slower rank), so a run cut short by a time limit still reports.
        last = {op: max(vals) for op, vals in zip(ops, zip(*_all_gather_values([out[op][-1] for op in ops])))}
        if rank == 0:
            print(f"repeat {i}: " + "; ".join(f"{op} {v:.2f}" for op, v in last.items()) +
                  f"; load average {os.getloadavg()[0]:.1f}", flush=True)
        dist.barrier()
    checkpointer().release()
    out["peak RSS GiB"] = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20]
    return out


def bench_targets(args, root: str) -> List[Dict[str, object]]:
    """Issue 19's ratios on 2 FSDP2 ranks; every row is the slowest rank's seconds, median and range."""
    from atorch.testing import run_distributed

    per_rank = run_distributed(_targets_rank, 2, args.hidden, args.layers, args.vocab, root, args.repeats,
                               args.fresh_target, args.intermediate, args.torch_chunk_mb, args.skip_async,
                               args.skip_sha256, args.atorch_crc32, args.ab_crc32, timeout=3000)
    nbytes = per_rank[0]["bytes"][0]
    peaks = [r["peak RSS GiB"][0] for r in per_rank]
    print(f"peak RSS per rank: {', '.join(f'{p:.2f}' for p in peaks)} GiB (sum {sum(peaks):.2f} GiB)")
    torch_mb = [r["torch bytes"][0] / 1e6 for r in per_rank]
    print(f"torch.save bytes per rank: {', '.join(f'{mb:.0f}' for mb in torch_mb)} MB")
    rows = []
    for op in per_rank[0]:
        if "bytes" in op or "RSS" in op:
            continue
        values = [max(r[op][i] for r in per_rank) for i in range(args.repeats)]
        rows.append({"case": "model + AdamW, FSDP2 on 2 ranks", "op": op, "seconds": _median(values),
                     "min": min(values), "max": max(values), "all": values,
                     "MB": nbytes / 1e6, "MB/s": nbytes / 1e6 / _median(values)})
    return rows


def bench_fsdp(args, root: str) -> List[Dict[str, object]]:
    from atorch.testing import run_distributed

    per_rank = run_distributed(_fsdp_rank, 2, args.hidden, args.layers, args.vocab, root, args.repeats,
                               timeout=3000)
    nbytes = per_rank[0]["bytes"][0]
    rows = []
    for op in ("save", "load"):
        seconds = _median([max(r[op][i] for r in per_rank) for i in range(args.repeats)])  # slowest rank
        rows.append({"case": "model + AdamW, FSDP2 on 2 ranks", "op": f"atorch {op}", "seconds": seconds,
                     "MB": nbytes / 1e6, "MB/s": nbytes / 1e6 / seconds})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--intermediate", type=int, default=None,
                        help="MLP width (default hidden * 8/3 rounded down to 64; Llama-1B-like: 5632)")
    parser.add_argument("--torch-chunk-mb", type=int, default=0,
                        help="--targets: torch.save each rank's tensors in files of at most this size and "
                             "torch.load them one at a time, dropping each result (0: one file per rank)")
    parser.add_argument("--skip-async", action="store_true",
                        help="--targets: no async save (its staging copy is another copy of the state)")
    parser.add_argument("--skip-sha256", action="store_true", help="--targets: no sha256 comparison row")
    parser.add_argument("--atorch-crc32", action="store_true",
                        help="--targets: atorch's data files keep torch.save's CRC32 pass (before session 4)")
    parser.add_argument("--ab-crc32", action="store_true",
                        help="--targets: also time, in each repeat, the sync save with the CRC32 pass kept")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed at the end)")
    parser.add_argument("--skip-fsdp", action="store_true")
    parser.add_argument("--targets", action="store_true", help="only issue 19's 2-rank sync/async/load ratios")
    parser.add_argument("--fresh-target", action="store_true",
                        help="--targets: load into a new model and stateless AdamW (another copy of the state)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="atorch_ckpt_bench_", dir=args.dir)
    try:
        params = _param_count(args.hidden, args.layers, args.vocab, args.intermediate)
        print(f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, intermediate "
              f"{_config(args.hidden, args.layers, args.vocab, args.intermediate).intermediate_size}: "
              f"{params / 1e6:.1f} M params, {params * 4 / 1e6:.0f} MB fp32 ({params * 12 / 1e6:.0f} MB with AdamW); "
              f"repeats {args.repeats}; dir {root}; load average {os.getloadavg()}", flush=True)
        if args.targets:
            rows = bench_targets(args, root)
            print("| operation (slowest of 2 ranks) | median s | min-max s | every repeat | MB on disk |")
            print("|---|---|---|---|---|")
            for r in rows:
                print(f"| {r['op']} | {r['seconds']:.2f} | {r['min']:.2f}-{r['max']:.2f} | "
                      f"{' '.join(f'{v:.2f}' for v in r['all'])} | {r['MB']:.0f} |")
            by_op = {r["op"]: r["all"] for r in rows}
            for name, num, den in (("sync save / torch.save+fsync", "atorch save", "torch.save+fsync"),
                                   ("async blocked / sync save", "atorch async: blocked", "atorch save"),
                                   ("async blocked / torch.save+fsync", "atorch async: blocked", "torch.save+fsync"),
                                   ("load / torch.load", "atorch load", "torch.load"),
                                   ("sync save with CRC32 (before) / torch.save+fsync",
                                    "atorch save, CRC32 kept (before)", "torch.save+fsync")):
                if num not in by_op:
                    continue
                ratios = [a / b for a, b in zip(by_op[num], by_op[den])]
                print(f"{name}: per repeat {' '.join(f'{x:.2f}' for x in ratios)}; median "
                      f"{_median(ratios):.2f}")
            return
        rows = bench_single(args, root)
        if not args.skip_fsdp:
            rows += bench_fsdp(args, root)
        print("| case | operation | seconds | MB on disk | MB/s |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['case']} | {r['op']} | {r['seconds']:.2f} | {r['MB']:.0f} | {r['MB/s']:.0f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
