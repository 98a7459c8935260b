"""cbsim's roofline against TensorRT-LLM's published offline throughput (Total Output Throughput, tokens/s):
NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md (commit 00f37686aa854010d68bcbd0f4ab000221541ca6),
trtllm-bench throughput, ModelOpt FP8 checkpoints, all requests queued at once, fixed ISL/OSL.
Run: python validation/validate_trtllm_fp8.py [quick]   (the table in docs/validation/fp8.md)"""
import sys
import time

from cbsim.tools.scoreboard.published import TRTLLM_FP8, TRTLLM_FP8_REQUESTS
from cbsim.tools.scoreboard.runs import trtllm_fp8_throughput as simulate

PUBLISHED, REQUESTS = TRTLLM_FP8, TRTLLM_FP8_REQUESTS  # (model, gpu, tp, ep) -> {(isl, osl): tokens/s}


if __name__ == "__main__":
    quick = sys.argv[1:] == ["quick"]
    print(f"{'model':<16} {'gpu':<5} {'tp':>2} {'ep':<5} {'isl/osl':>10} {'published':>10} {'cbsim':>10} {'ratio':>6}")
    for (model, gpu, tp, ep), rows in PUBLISHED.items():
        for (isl, osl), tput in rows.items():
            n = REQUESTS[(isl, osl)] // (5 if quick else 1)
            t0 = time.perf_counter()
            sim = simulate(model, gpu, tp, ep, isl, osl, n)
            print(f"{model:<16} {gpu:<5} {tp:>2} {str(ep):<5} {f'{isl}/{osl}':>10} {tput:>10,} {sim:>10,.0f} "
                  f"{sim / tput:>6.2f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
