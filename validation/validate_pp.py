"""cbsim's pipeline parallelism (roofline pp, sim/pipeline.py) against the only public whole-run serving
measurements of a dense model under PP on GPUs cbsim prices that were found, printed as predicted vs
published with the source of each row.

Source: vLLM's nightly serving benchmark (the harness of vllm-project/vllm .buildkite/nightly-benchmarks:
`benchmark_serving.py`, "randomly sample 200 prompts from ShareGPT dataset (with fixed random seed)",
output lengths the dataset's, Poisson arrivals at QPS 1, 4, 16 and inf = all at once) run by one user on
Azure VMs and published as GitHub gists (gist.github.com/surajssd), meta-llama/Llama-3.3-70B-Instruct:
- 9e99362736af03575a8c34b46ac8e1bc: tp2_pp2 on "1xStandard_NC48ads_A100_v4 x 2" (two VMs of 2 A100 80GB
  PCIe: one stage per VM), QPS 1, 4, 16, inf;
- c8bbcb244b210a3607ad952a7bdda759: tp4_pp2 on "1xStandard_ND96asr_v4 x 2" (two VMs of 8 A100 40GB SXM4),
  QPS 1 and 4 (the stored copy shows no other rows);
- eef8ebf83cadd690f6fb4ee87b30fe1a: tp4_pp1 on "1xStandard_NC96ads_A100_v4 x 1" (one VM of 4 A100 80GB
  PCIe), QPS 1 and 4: the same harness without PP, for reference.
Second source: Substratus, "Benchmarking 70B model on 8 x L4 GPUs vLLM: Pipeline vs Tensor Parallelism"
(substratus.ai/blog/benchmarking-llama-3.1-70b-on-l4, Sam Stoelinga, 2024): neuralmagic's
Meta-Llama-3.1-70B-Instruct-FP8 on one node of 8 L4 (GKE), vLLM 0.6 with --kv-cache-dtype fp8,
--enable-chunked-prefill=false, --max-num-batched-token 32768, --max-num-seqs 512, --enforce-eager,
prefix caching on, `benchmark_serving.py` with 1,000 ShareGPT prompts at once (seed 12345): pp 4 x tp 2
1.76 req/s, 307.61 output and 717.77 total tok/s; pp 2 x tp 4 1.50 req/s, 261.16 and 610.69 tok/s (the
stored copy ends before the latency lines). cbsim: prefill_first (vLLM V0 without chunked prefill) with
those budgets; V0's PP runs one scheduler per virtual engine, each with its own max_num_seqs, which is
cbsim's per-micro-batch max_num_seqs. ShareGPT prompts rarely share prefixes, so prefix caching is left
off; enforce-eager (no CUDA graphs) is not modelled apart from the default engine's host terms.
Each gist row gives request and output throughput, mean/median/p99 TTFT, TPOT and ITL. The mean prompt and
output lengths follow from it: output = output tok/s / req/s, prompt = (total - output tok/s) / req/s
(213 and 214 tokens on every row).

Hardware (Azure docs, MicrosoftDocs/azure-docs articles/virtual-machines/nc-a100-v4-series.md @0af0f2ef):
NC A100 v4 = A100 80GB PCIe, "NVIDIA NVLink Interconnect: Supported" (bridged pairs), "InfiniBand: Not
Supported", network 40,000 Mbps for NC48ads (2 GPUs: 2.5 GB/s per GPU one way) and 80,000 for NC96ads.
ND96asr_v4 = 8 A100 40GB SXM4 on NVSwitch with a 200 Gb/s HDR link per GPU (the catalog's
a100-40gb-sxm). "x 2" is read as one stage per VM, so the stage boundary crosses the network
(gpus_per_node = the GPUs a stage's VM uses).

What is NOT known, so each row's error carries it: the vLLM version (Llama-3.3 dates the runs to
December 2024 or later; V0's PP, virtual engines with a scheduler each, or V1's batch queue), the
exact prompts (cbsim draws lognormal prompt and output lengths with the row's means, sigma 1, clipped
as benchmark_serving filters ShareGPT: prompt <= 1024, prompt + output <= 2048), the server flags
(defaults assumed: chunked prefill with a 2,048-token budget, max_num_seqs 256, gpu_memory_utilization
0.9), and the model in bf16 (the harness's default dtype). cbsim: roofline with the default engine,
llama-3.1-70b (Llama-3.3-70B's architecture), averaged over SEEDS workload draws.

The two L4 rows are printed with their ratio (pp 4 x tp 2 over pp 2 x tp 4), the quantity PP changes.

Run: python validation/validate_pp.py [quick]   (quick: one seed, QPS inf rows skipped)
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from cbsim.api import run_experiment
from cbsim.sim.costmodels.catalog.specs import GiB

GIST = "gist.github.com/surajssd/"
SUBSTRATUS = "substratus.ai/blog/benchmarking-llama-3.1-70b-on-l4"
SOURCES = {
    "tp2_pp2_nc48": GIST + "9e99362736af03575a8c34b46ac8e1bc",
    "tp4_pp2_nd96": GIST + "c8bbcb244b210a3607ad952a7bdda759",
    "tp4_pp1_nc96": GIST + "eef8ebf83cadd690f6fb4ee87b30fe1a",
    "tp2_pp4_l4": SUBSTRATUS,
    "tp4_pp2_l4": SUBSTRATUS,
}
AZURE_NC = "MicrosoftDocs/azure-docs articles/virtual-machines/nc-a100-v4-series.md @0af0f2ef"

# A100 80GB PCIe (NVIDIA A100 datasheet, as the catalog's a100-80gb-pcie) in an NC A100 v4 VM: NVLink
# bridges between pairs (600 GB/s both ways: 300 one way), network per VM over its GPUs (AZURE_NC)
def nc_a100(gpus_per_vm: int, vm_mbps: float) -> dict:
    return {"name": f"a100-80gb-pcie-nc{gpus_per_vm}", "memory_bytes": 80 * GiB, "bf16_flops": 312e12,
            "hbm_bandwidth": 1935e9, "link_bandwidth": 300e9, "topology": "nvlink_pairwise", "pcie_bandwidth": 32e9,
            "inter_node_bandwidth": vm_mbps * 1e6 / 8 / gpus_per_vm, "family": "a100"}


# layout -> cost model keys. NC48ads: 40,000 Mbps, 2 GPUs; NC96ads: 80,000 Mbps, 4 GPUs
LAYOUTS = {
    "tp2_pp2_nc48": {"gpu": nc_a100(2, 40_000), "tp": 2, "pp": 2, "gpus_per_node": 2},
    "tp4_pp2_nd96": {"gpu": "a100-40gb-sxm", "tp": 4, "pp": 2, "gpus_per_node": 4},
    "tp4_pp1_nc96": {"gpu": nc_a100(4, 80_000), "tp": 4},
    "tp2_pp4_l4": {"gpu": "l4", "tp": 2, "pp": 4},
    "tp4_pp2_l4": {"gpu": "l4", "tp": 4, "pp": 2},
}
# the rest of each source's setup: model, policy, requests, max_model_len
HARNESS = {  # vLLM's nightly serving harness: bf16, V1-era defaults assumed (chunked prefill 2,048, 256 seqs)
    "model": "llama-3.1-70b", "max_model_len": 2048, "num_requests": 200,
    "policy": {"name": "sarathi", "token_budget": 2048, "max_num_seqs": 256}}
L4_RUN = {  # Substratus: FP8 weights and KV, no chunked prefill, 32,768 tokens / 512 sequences, 1,000 prompts
    "model": {"config": "llama-3.1-70b", "weight_dtype": "fp8", "kv_dtype": "fp8"}, "max_model_len": 32768,
    "num_requests": 1000, "policy": {"name": "prefill_first", "token_budget": 32768, "max_num_seqs": 512}}
SETUPS = {"tp2_pp2_nc48": HARNESS, "tp4_pp2_nd96": HARNESS, "tp4_pp1_nc96": HARNESS, "tp2_pp4_l4": L4_RUN,
          "tp4_pp2_l4": L4_RUN}


@dataclass(frozen=True)
class Row:
    layout: str
    qps: float  # inf: all at once
    req_s: float
    output_tok_s: float
    total_tok_s: float
    mean_ttft_ms: float | None = None  # None: not published
    median_tpot_ms: float | None = None

    @property
    def mean_output(self) -> float:
        return self.output_tok_s / self.req_s

    @property
    def mean_prompt(self) -> float:
        return (self.total_tok_s - self.output_tok_s) / self.req_s


INF = float("inf")
ROWS = (  # Tput (req/s), Output Tput, Total Tput (tok/s), Mean TTFT (ms), Median TPOT (ms), as published
    Row("tp2_pp2_nc48", 1, 0.872355, 186.627, 372.696, 183.928, 68.074),
    Row("tp2_pp2_nc48", 4, 2.00982, 427.739, 856.423, 250.331, 104.4),
    Row("tp2_pp2_nc48", 16, 2.67286, 569.012, 1139.12, 813.433, 126.463),
    Row("tp2_pp2_nc48", INF, 2.74262, 585.508, 1170.49, 5586.03, 120.439),
    Row("tp4_pp2_nd96", 1, 0.928406, 198.242, 396.267, 110.373, 43.5453),
    Row("tp4_pp2_nd96", 4, 2.52147, 539.053, 1076.87, 139.838, 63.497),
    Row("tp4_pp1_nc96", 1, 0.927978, 198.508, 396.441, 154.771, 44.6347),
    Row("tp4_pp1_nc96", 4, 2.4957, 532.931, 1065.25, 246.338, 73.8304),
    Row("tp2_pp4_l4", INF, 1.76, 307.61, 717.77),
    Row("tp4_pp2_l4", INF, 1.50, 261.16, 610.69),
)
SEEDS = (0, 1, 2, 3, 4)
SIGMA = 1.0  # lognormal shape of both lengths (an assumption: ShareGPT's lengths are heavy-tailed)


def lengths(mean: float, cap: int) -> dict:
    """A lognormal of shape SIGMA clipped to [4, cap] whose clipped mean is `mean` (its median found by
    bisection on a fixed standard-normal sample of 200,000 draws)."""
    z = np.random.default_rng(0).standard_normal(200_000)
    low, high = 1.0, float(cap)
    for _ in range(60):
        median = (low + high) / 2
        if np.clip(median * np.exp(SIGMA * z), 4, cap).mean() < mean:
            low = median
        else:
            high = median
    return {"type": "lognormal", "median": median, "sigma": SIGMA, "min": 4, "max": cap}


def experiment(row: Row, seed: int, num_requests: int | None = None) -> dict:
    """The cbsim experiment of one published row (`num_requests`: the source's unless given)."""
    setup = SETUPS[row.layout]
    arrival = {"type": "all_at_once"} if row.qps == INF else {"type": "poisson", "rate": float(row.qps)}
    return {
        "name": f"validate_pp_{row.layout}", "seed": seed, "model": setup["model"],
        "cost_model": {"type": "roofline", **LAYOUTS[row.layout]},
        "cluster": {"replicas": 1, "max_model_len": setup["max_model_len"],
                    "kv_cache": {"num_blocks": "auto", "gpu_memory_utilization": 0.9, "block_size": 16}},
        "policy": setup["policy"],
        "workload": {"num_requests": num_requests or setup["num_requests"], "arrival": arrival,
                     "prompt_len": lengths(row.mean_prompt, 1024), "output_len": lengths(row.mean_output, 1024)},
        "output": {"plots": False, "trace": False},
    }


def predict(row: Row, seeds=SEEDS, num_requests: int | None = None) -> dict:
    """cbsim's req/s, output tok/s, mean TTFT (ms) and median TPOT (ms), each averaged over `seeds`."""
    out = {"req_s": [], "output_tok_s": [], "mean_ttft_ms": [], "median_tpot_ms": []}
    for seed in seeds:
        r = run_experiment(experiment(row, seed, num_requests)).requests
        duration = r["completion_time"].max()
        out["req_s"].append(len(r) / duration)
        out["output_tok_s"].append(r["output_tokens"].sum() / duration)
        out["mean_ttft_ms"].append(1e3 * r["ttft"].mean())
        out["median_tpot_ms"].append(1e3 * r["tpot"][r["output_tokens"] > 1].median())
    return {k: float(np.mean(v)) for k, v in out.items()}


def error(predicted: float, published: float) -> str:
    return f"{100 * (predicted / published - 1):+.0f}%"


def cell(predicted: float, published: float | None) -> str:
    if published is None:
        return f"{predicted:>7.4g} (not published)"
    return f"{predicted:>7.4g} vs {published:>6.4g} {error(predicted, published):>5}"


if __name__ == "__main__":
    quick = sys.argv[1:] == ["quick"]
    print(f"Llama-3.3-70B (cbsim: llama-3.1-70b bf16), vLLM nightly serving harness, 200 ShareGPT prompts, and "
          f"Llama-3.1-70B FP8 on 8 L4, 1,000 prompts at once; sources: "
          f"{', '.join(f'{k} {v}' for k, v in SOURCES.items())}; NC A100 v4 network: {AZURE_NC}")
    print(f"{'layout':<14} {'qps':>4} | {'req/s':>20} | {'out tok/s':>20} | {'mean TTFT ms':>20} | "
          f"{'median TPOT ms':>20}")
    l4 = {}
    for row in ROWS:
        if quick and row.qps == INF:
            continue
        t0 = time.perf_counter()
        p = predict(row, SEEDS[:1] if quick else SEEDS)
        cells = [cell(p[k], v) for k, v in
                 (("req_s", row.req_s), ("output_tok_s", row.output_tok_s), ("mean_ttft_ms", row.mean_ttft_ms),
                  ("median_tpot_ms", row.median_tpot_ms))]
        print(f"{row.layout:<14} {row.qps:>4} | " + " | ".join(cells) + f"  ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        if row.layout.endswith("_l4"):
            l4[row.layout] = (p["output_tok_s"], row.output_tok_s)
    if len(l4) == 2:
        (a, pa), (b, pb) = l4["tp2_pp4_l4"], l4["tp4_pp2_l4"]
        print(f"L4 output tok/s, pp 4 x tp 2 over pp 2 x tp 4: cbsim {a / b:.2f}, published {pa / pb:.2f}")
