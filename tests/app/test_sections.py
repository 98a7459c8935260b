"""The config's registry-owned sections are parsed once, where the config is loaded (issue 25): a run
reads the model, cost models, policies and workload from config.sections; a mapping changed after
loading is parsed afresh, never read stale."""
import cbsim.config
import cbsim.policies.registry
from cbsim.api import run_experiment
from cbsim.config import load_config, parsed_sections

TINY = {"name": "tiny", "model": "llama-3-8b", "cost_model": {"type": "unit", "seconds": 0.01},
        "policy": {"name": "sarathi", "token_budget": 256}, "cluster": {"kv_cache": {"num_blocks": 4096}},
        "workload": {"num_requests": 6, "arrival": {"type": "poisson", "rate": 50.0},
                     "prompt_len": {"type": "fixed", "value": 300}, "output_len": {"type": "fixed", "value": 4}}}


def counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def test_a_run_parses_its_policy_and_cost_model_once(monkeypatch):
    policies = counting(monkeypatch, cbsim.config, "parse_policy")
    costs = counting(monkeypatch, cbsim.config, "load_cost_model")
    results = run_experiment(TINY)
    assert len(policies) == 1 and len(costs) == 1
    assert results.summary["num_finished"] == 6


def test_the_token_budget_reaches_the_policy_as_parsed():
    cfg = load_config(TINY)
    spec = cfg.sections.policies["cluster"]
    assert spec.config.token_budget == 256
    assert spec.build().config is spec.config


def test_a_mapping_changed_after_loading_is_parsed_again():
    cfg = load_config(TINY)
    first = cfg.sections
    assert parsed_sections(cfg) is first
    cfg.policy = {"name": "sarathi", "token_budget": 128}
    assert parsed_sections(cfg).policies["cluster"].config.token_budget == 128


def test_pd_pools_get_their_own_policy_and_cost_model():
    cfg = load_config({**TINY, "cluster": {"mode": "pd", "kv_cache": {"num_blocks": 4096}, "prefill": {"replicas": 1, "policy": {"name": "orca"}},
                                           "decode": {"replicas": 1}}})
    assert set(cfg.sections.policies) == {"cluster", "prefill", "decode"}
    assert cfg.sections.policies["prefill"].cls.__name__ != cfg.sections.policies["decode"].cls.__name__


def test_the_config_file_leaves_the_sections_out():
    assert "sections" not in load_config(TINY).to_dict()
