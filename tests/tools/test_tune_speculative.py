"""`cbsim tune`'s speculative stage: the draft length (0 = off) is chosen by capacity under the SLO, so
it follows the physics of the step: where a step's fixed cost dominates (decode is memory-bound)
speculation raises capacity and a k wins; where every token costs the same, the verified drafts are
paid for and off wins. The chosen deployment's flags carry the speculative config both engines read."""
from __future__ import annotations

import yaml

from cbsim.server import speculative
from cbsim.tools.tune.flags import flags_text
from cbsim.tools.tune.tune import run_tune

BASE = {
    "name": "tiny_spec",
    "model": "llama-3-8b",
    "cluster": {"kv_cache": {"num_blocks": 4000}},
    "policy": {"name": "sarathi", "token_budget": 512},
    "workload": {"num_requests": 60, "arrival": {"type": "poisson", "rate": 4.0},
                 "prompt_len": {"type": "fixed", "value": 32},
                 "output_len": {"type": "fixed", "value": 48}},
    "speculative": {"method": "eagle3", "num_speculative_tokens": 3, "acceptance": 0.8},
    "output": {"plots": False, "trace": False},
}
OTHER_STAGES = ("parallelism", "policy", "token_budget", "max_num_seqs", "chunk_size", "partial_prefills",
                "admission", "queue_policy", "pd")


def _tune(folder, cost_model: dict, slo: dict):
    (folder / "base.yaml").write_text(yaml.safe_dump({**BASE, "cost_model": cost_model}))
    spec = {"name": "spec_tune", "base": "base.yaml", "slo": slo, "gpus": {"count": 1},
            "search": {"lo": 2.0, "rel_tol": 0.1, "seeds": [0]},
            "stages": {**{name: [] for name in OTHER_STAGES}, "speculative": [0, 3]}}
    (folder / "tune.yaml").write_text(yaml.safe_dump(spec))
    return run_tune(folder / "tune.yaml", folder / "out", workers=1)


def _chosen_k(result) -> int:
    section = result.best.point.config.speculative
    return 0 if section is None else section.num_speculative_tokens


def test_a_fixed_cost_step_picks_speculation(tmp_path):
    """Step time 20 ms + 10 us per token: four query tokens cost about what one does, and 1 + 0.8 + ...
    tokens come out of each verify step, so TPOT falls below the step time: a 15 ms TPOT limit is met
    at some rate with k = 3 and at none without speculation."""
    result = _tune(tmp_path, {"type": "linear", "base": 0.02, "per_token": 1e-5}, {"tpot_p99": 0.015})
    outcome = next(o for o in result.stages if o.stage.name == "speculative")
    assert outcome.status == "searched" and sorted(c.label for c in outcome.candidates) == ["k=3", "off"]
    assert _chosen_k(result) == 3
    off, k3 = (next(c for c in outcome.candidates if c.label == label) for label in ("off", "k=3"))
    assert off.record["rate"] is None and k3.record["rate"] is not None


def test_a_per_token_step_turns_speculation_off(tmp_path):
    """Step time 2 ms per token and nothing fixed: a verify row costs 4 tokens for about 2.4 emitted."""
    result = _tune(tmp_path, {"type": "linear", "base": 0.0, "per_token": 2e-3}, {"tpot_p99": 0.05})
    assert _chosen_k(result) == 0
    outcome = next(o for o in result.stages if o.stage.name == "speculative")
    off, k3 = (next(c for c in outcome.candidates if c.label == label) for label in ("off", "k=3"))
    assert off.record["rate"] > k3.record["rate"] > 0


def test_flags_carry_the_speculative_config_both_ways(tmp_path):
    result = _tune(tmp_path, {"type": "linear", "base": 0.02, "per_token": 1e-5}, {"tpot_p99": 0.015})
    text = flags_text(result.best.point.config)
    assert """--speculative-config '{"method":"eagle3","num_speculative_tokens":3}'""" in text
    section = {"method": "eagle3", "num_speculative_tokens": 3}
    flags = speculative.to_sglang(section)
    assert speculative.from_sglang(flags, "flags") == {"speculative.method": "eagle3",
                                                       "speculative.num_speculative_tokens": 3}
    draft = {"method": "draft_model", "num_speculative_tokens": 4, "model": "llama-3.2-1b"}
    assert speculative.from_vllm(speculative.json_object(speculative.to_vllm(draft)), "flags") == {
        f"speculative.{k}": v for k, v in draft.items()}


def test_shipped_speculative_tune_file_loads():
    from cbsim.config import load_config
    from cbsim.tools.tune.tune import load_tune
    from paths import ROOT

    spec = load_tune(ROOT / "experiments" / "tune" / "speculative_h100.yaml")
    base = load_config(ROOT / "experiments" / "tune" / spec.base)
    assert base.speculative.method == "eagle3" and base.speculative.num_speculative_tokens == 3
    assert "speculative" not in spec.stages  # its default candidates: off and k = 1..5
