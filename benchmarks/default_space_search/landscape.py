"""A synthetic, project-independent landscape over atorch strategies: true step time and peak memory
from my own arithmetic, with per-landscape random constants; dry runs as the dry runner reports them."""
import math
import numpy as np
from atorch.auto.search.results import DryRunResult
from atorch.auto.step_timing import summarize


def parse(strategy):
    d = dict(data=1, tensor=1, pipeline=1, chunks=1, accum=1, mr=False, ckpt=False, compile=False, amp=False,
             zero=None, offload=False, ds=False)
    for it in strategy:
        n, c = it.name, it.config
        if n == "parallel_mode":
            for k, v in c[0]:
                d[k] = int(v)
        elif n == "pipeline_parallel":
            d["chunks"] = int((c or {}).get("chunks", 1))
        elif n == "gradient_accumulation":
            d["accum"] = int((c or {}).get("steps", 1))
        elif n == "module_replace":
            d["mr"] = True
        elif n == "checkpoint":
            d["ckpt"] = True
        elif n == "compile":
            d["compile"] = True
        elif n == "amp_native":
            d["amp"] = True
        elif n in ("zero1", "zero2", "fsdp"):
            d["zero"] = n
            r = repr(c).lower()
            d["offload"] = "cpu_offload': true" in r
            d["ds"] = "deepspeed" in r
    return d


class Landscape:
    def __init__(self, params, layers, hidden, seq, world, global_batch, seed, oom_frac=None):
        r = np.random.default_rng(seed)
        self.P, self.L, self.H, self.S, self.W, self.B = params, layers, hidden, seq, world, global_batch
        self.r = r
        self.c = dict(
            amp=r.uniform(0.35, 0.6), ckpt=r.uniform(1.25, 1.4), compile=r.uniform(0.8, 1.02),
            mr=r.uniform(0.85, 1.0), m0=r.uniform(0.3, 3.0),           # micro-batch inefficiency (samples)
            tp_eff=r.uniform(0.03, 0.1),                              # matmul efficiency loss per log2(tp)
            bw_intra=r.uniform(100e9, 300e9), bw_inter=r.uniform(10e9, 50e9),
            ds=r.uniform(0.9, 1.12), offload_ns=r.uniform(0.5, 3.0),  # CPU optimizer ns per param
            compile_pp=r.uniform(1.0, 1.15),                          # compile hurts with a pipeline
            fsdp_extra=r.uniform(1.3, 1.7), flops=r.uniform(150e12, 400e12),
            act=r.uniform(20, 40),                                    # activation bytes per token*hidden per layer (fp32)
            overlap=r.uniform(0.3, 0.8))
        self.oom_frac = oom_frac if oom_frac is not None else r.uniform(0.2, 0.6)
        self.limit = None

    def true(self, s):
        """(step seconds, peak bytes) of strategy s."""
        c, d = self.c, parse(s)
        dp, tp, pp = d["data"], d["tensor"], d["pipeline"]
        per_rank = self.B / dp
        if pp > 1:
            micro = per_rank / d["chunks"]; passes = d["chunks"]
        else:
            micro = per_rank / d["accum"]; passes = d["accum"]
        # compute
        flops = 6 * self.P * self.S * per_rank / (tp * pp)
        t = flops / c["flops"]
        t *= (c["amp"] if d["amp"] else 1.0) * (c["ckpt"] if d["ckpt"] else 1.0) * (c["mr"] if d["mr"] else 1.0)
        if d["compile"]:
            t *= c["compile"] * (c["compile_pp"] if pp > 1 else 1.0)
        t *= (micro + c["m0"]) / micro                  # small micro-batches are inefficient
        t *= 1 + c["tp_eff"] * math.log2(tp)
        # TP comm: 4 all-reduces of activations per layer per pass
        if tp > 1:
            bw = c["bw_intra"] if tp <= 8 else c["bw_inter"]
            act_bytes = micro * self.S * self.H * (2 if d["amp"] else 4)
            t += passes * 4 * (self.L / pp) * 2 * (tp - 1) / tp * act_bytes / bw * (1.33 if d["ckpt"] else 1.0)
        # pipeline bubble
        if pp > 1:
            t *= 1 + (pp - 1) / d["chunks"]
        # DP gradient reduction (once per step), partly overlapped
        grad_bytes = self.P / (tp * pp) * (2 if d["amp"] else 4)
        bw_dp = c["bw_inter"] if dp * tp * pp > 8 else c["bw_intra"]
        comm = 2 * (dp - 1) / dp * grad_bytes / bw_dp if dp > 1 else 0.0
        if d["zero"] == "fsdp":
            comm = comm * c["fsdp_extra"] + passes * 2 * (dp - 1) / dp * grad_bytes / bw_dp * 0.5
        t += comm * (1 - c["overlap"])
        if d["ds"]:
            t *= c["ds"]
        if d["offload"]:
            shard = self.P / (tp * pp) / (dp if d["zero"] else 1)
            t += shard * c["offload_ns"] * 1e-9 + shard * 4 * 2 / 25e9
        # memory
        p_rank = self.P / (tp * pp)
        w, g, o = 4 * p_rank, 4 * p_rank, 8 * p_rank
        if d["amp"]:
            w += 2 * p_rank
        z = d["zero"]
        if z in ("zero1", "zero2", "fsdp"):
            o /= dp
        if z in ("zero2", "fsdp"):
            g /= dp
        if z == "fsdp":
            w /= dp
        if d["offload"]:
            o = 0.0
            if z == "fsdp":
                w *= 0.3
        act_layer = micro * self.S * self.H * c["act"] * (0.5 if d["amp"] else 1.0) / tp
        layers = self.L / pp
        if d["ckpt"]:
            act = layers * micro * self.S * self.H * (2 if d["amp"] else 4) / tp + act_layer
        else:
            act = layers * act_layer
        if d["mr"]:
            act *= 0.8
        if pp > 1:
            act *= min(pp, d["chunks"])
        if d["compile"]:
            act *= 0.9
        mem = w + g + o + act + 1.5e9
        return t, mem

    def calibrate(self, candidates):
        self.truth = [self.true(c.strategy) for c in candidates]
        mems = np.array([m for _, m in self.truth])
        self.limit = float(np.quantile(mems, 1 - self.oom_frac))
        thr = [self.B / t if m <= self.limit else 0.0 for t, m in self.truth]
        self.best = max(thr)
        self.thr = thr
        return self

    def evaluator(self, seed, noise=0.03, steps=12):
        rng = np.random.default_rng(seed)
        cache = {}

        def run(strategy):
            t, m = self.true(strategy)
            if m > self.limit:
                return DryRunResult(0.0, int(m * rng.uniform(1.0, 1.2)), "oom: rank 0: CUDA out of memory (synthetic)")
            bias = float(np.clip(rng.normal(0, noise / 2), -noise, noise))
            times = tuple(float(t * (1 + bias) * x) for x in np.exp(rng.normal(0, noise, steps)))
            sm = summarize(times, pilot=8)
            return DryRunResult(sm.throughput(self.B), int(m * rng.uniform(0.97, 1.03)), None, sm.mean_s, times,
                                sm.throughput_interval(self.B))
        return run

    def true_thr(self, strategy):
        t, m = self.true(strategy)
        return self.B / t if m <= self.limit else 0.0
