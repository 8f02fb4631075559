"""Single-GPU landscape: measured step time and peak vs the cost model (default profile and calibrated).

    python benchmarks/gpu_single_landscape.py          # a 0.35B Llama, batch 8 x 1024, 12 strategies, twice
    python benchmarks/gpu_single_landscape.py small    # a tiny Llama, 4 x 32: checks the script on CPU

Each strategy: `auto_accelerate(load_strategy=...)`, 3 warm-up and 10 timed `train_step`s (median,
min, max), the CUDA allocator's peak above what was allocated before; the cost model's prediction
with the device profile and with `calibrate_device`'s measured matmul rates. Two passes over the
strategies (interleaved repeats); Kendall's tau of predicted vs measured throughput. The figures
are in benchmarks/RESULTS.md ("First GPU run").
"""
import gc, json, os, sys, time
import torch
from atorch.auto import auto_accelerate, train_step
from atorch.auto.cost_model import estimate, DEVICE_PROFILES
from atorch.auto.calibration.device_probe import calibrate_device
from atorch.auto.calibration.refit import kendall_tau
from atorch.testing import tiny_llama

small = len(sys.argv) > 1 and sys.argv[1] == "small"
dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
BATCH, SEQ = (4, 32) if small else (8, 1024)
SHAPE = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              vocab_size=1024, max_position_embeddings=SEQ) if small else
         dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=6, num_attention_heads=16,
              num_key_value_heads=16, vocab_size=32000, max_position_embeddings=SEQ))
BF = ("amp_native", {"dtype": torch.bfloat16})
S = {"fp32": [], "amp": [BF], "amp+ckpt": [BF, "checkpoint"], "mr+amp": ["module_replace", BF],
     "mr+amp+ckpt": ["module_replace", BF, "checkpoint"], "amp+ga2": [BF, ("gradient_accumulation", 2)],
     "mr+amp+ga4": ["module_replace", BF, ("gradient_accumulation", 4)], "half": ["half"],
     "mr+half": ["module_replace", "half"], "mr": ["module_replace"], "ckpt": ["checkpoint"],
     "mr+amp+ckpt+ga2": ["module_replace", BF, "checkpoint", ("gradient_accumulation", 2)]}
cal = calibrate_device(dev, cache_path="/tmp/atorch_cal.json")
print("calibrated", cal, "default", DEVICE_PROFILES.get(dev.type), flush=True)
rows = []
for rep in range(2):
    for name, strat in S.items():
        gc.collect(); torch.cuda.empty_cache() if dev.type == "cuda" else None
        if dev.type == "cuda":
            torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        model = tiny_llama(seed=0, **SHAPE)
        e0 = estimate(model, strat, BATCH, SEQ, 1, dev.type)
        e1 = estimate(model, strat, BATCH, SEQ, 1, dev.type, profile=cal.as_profile())
        ok, result, _ = auto_accelerate(model, optim_func=torch.optim.AdamW, optim_args={"lr": 1e-5},
                                        load_strategy=strat, ignore_dryrun_on_load_strategy=True)
        x = torch.randint(4, SHAPE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).to(dev)
        times = []
        for i in range(13):
            if dev.type == "cuda": torch.cuda.synchronize()
            t = time.perf_counter()
            train_step(result, {"input_ids": x, "labels": x})
            if dev.type == "cuda": torch.cuda.synchronize()
            if i >= 3: times.append(time.perf_counter() - t)
        peak = (torch.cuda.max_memory_allocated() - base) if dev.type == "cuda" else 0
        times.sort(); med = times[len(times) // 2]
        row = dict(rep=rep, name=name, measured_s=med, min_s=times[0], max_s=times[-1], pred_s=e0.step_time_s,
                   pred_cal_s=e1.step_time_s, peak=peak, pred_peak=e0.peak_memory_bytes)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del result, model
m = {}
for r in rows:
    m.setdefault(r["name"], []).append(r)
names = list(S)
meas = [min(r["measured_s"] for r in m[n]) for n in names]
for key in ("pred_s", "pred_cal_s"):
    pred = [m[n][0][key] for n in names]
    print(key, "kendall tau (throughput order)", round(kendall_tau([-p for p in pred], [-t for t in meas]), 3))
print("| strategy | measured ms (rep1, rep2) | predicted ms default | calibrated | peak GiB measured | predicted | ratio |")
for n in names:
    a, b = m[n][0], m[n][-1]
    print(f"| {n} | {a['measured_s']*1e3:.1f}, {b['measured_s']*1e3:.1f} | {a['pred_s']*1e3:.1f} | {a['pred_cal_s']*1e3:.1f} | "
          f"{a['peak']/2**30:.2f} | {a['pred_peak']/2**30:.2f} | {a['pred_peak']/max(1,a['peak']):.3f} |")
out = os.environ.get("OUT")
if out:
    json.dump(rows, open(os.path.join(out, "landscape.json"), "w"), indent=1)
