"""What hides behind the GPU (engine.py): `overlap` hides all host work (SGLang's zero-overhead
scheduler, vLLM V1 async scheduling), `host_hidden_share` only the output processing (vLLM V0 async
output processing, PR #7049); the float and array paths agree, and the presets say which they run."""
from __future__ import annotations

import numpy as np
import pytest

from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels.engine import EngineTerms, StepEngine, load_engine

HOST = dict(host_per_step_s=1e-3, host_per_seq_s=20e-6)  # 1 ms + 20 us per sequence


def step(gpu: float, seqs: int, **terms) -> float:
    return StepEngine(EngineTerms(**HOST, **terms), num_layers=32, tp=1).decode_step(gpu, seqs)


@pytest.mark.parametrize("gpu", [0.5e-3, 1.5e-3, 4e-3])
def test_a_hidden_share_sits_between_synchronous_and_full_overlap(gpu):
    host = 1e-3 + 64 * 20e-6
    sync, full = step(gpu, 64), step(gpu, 64, overlap=True)
    assert sync == gpu + host and full == max(gpu, host)
    assert step(gpu, 64, host_hidden_share=0.0) == sync
    assert step(gpu, 64, host_hidden_share=1.0) == pytest.approx(full, rel=1e-15)
    share = step(gpu, 64, host_hidden_share=0.3)
    assert share == pytest.approx(max(gpu, 0.3 * host) + 0.7 * host, rel=1e-15)
    assert full <= share <= sync
    assert step(gpu, 64, overlap=True, host_hidden_share=0.3) == full  # overlap hides it all already


def test_decode_runs_agree_with_single_steps():
    engine = StepEngine(EngineTerms(**HOST, host_hidden_share=0.3), num_layers=32, tp=1)
    gpu = np.array([0.2e-3, 1e-3, 2.08e-3, 5e-3])
    assert engine.step_many(gpu, 64).tolist() == [engine.decode_step(float(g), 64) for g in gpu]


def test_presets_and_bounds():
    assert load_engine("vllm-v1").terms.host_hidden_share == 0.0 and not load_engine("vllm-v1").terms.overlap
    assert load_engine("sglang").terms.overlap and load_engine("trtllm").terms.overlap
    assert load_engine({"preset": "vidur-a100-tp1", "host_hidden_share": 0.3}).terms.host_hidden_share == 0.3
    for bad in (1.5, -0.1):
        with pytest.raises(ConfigError, match="host_hidden_share"):
            load_engine({"host_hidden_share": bad})
