"""One flag table per engine, read both ways: settings rendered as flags (cbsim.server.render, used by
`cbsim tune`'s best_flags.txt) parse back through cbsim/server to the same settings; pipeline
parallelism maps onto cost_model.pp only where the cost model has that option."""
from __future__ import annotations

import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels.catalog.lookup import gpu_spec
from cbsim.server import ENGINES, Context, apply_server, sglang, vllm
from cbsim.server.flags import read_flags
from cbsim.server.render import join, render, unmatched
from cbsim.tools.tune.flags import flags_text, sglang_settings, vllm_settings
from cbsim.tools.tune.stages import policy_settings

H100 = Context(gpu_spec("h100"), 8192, None, "roofline", frozenset({"tp", "gpu"}))
WITH_PP = Context(gpu_spec("h100"), 8192, None, "roofline", frozenset({"tp", "gpu", "pp"}))
WORKLOAD = {"num_requests": 4, "arrival": {"type": "poisson", "rate": 10.0},
            "prompt_len": {"type": "fixed", "value": 16}, "output_len": {"type": "fixed", "value": 4}}


def round_trip(engine: str, wanted: dict, context=H100) -> dict:
    """Render `wanted`, write the flags as a command line, parse and resolve that line again."""
    module = ENGINES[engine]
    line = join(render(engine, wanted, context))
    flags, ignored, positional = read_flags(line, module.FLAGS, module.IGNORED, module.ALIASES, "line")
    assert not ignored and not positional, line
    resolved, _ = module.resolve(flags, context, "line")
    return resolved


def engines_value(engine: str, key: str, resolved: dict, context=H100):
    """The value the engine runs for `key`: resolved, or the default of the flag that maps it (a setting
    resolve leaves to the experiment, like cluster.tp, is the engine's default when no flag sets it)."""
    if key in resolved:
        return resolved[key]
    module = ENGINES[engine]
    names = [name for name, flag in module.FLAGS.items() if flag.key == key]
    return module.default(names[0], context) if names else "unset"


kv = {"cluster.kv_cache.block_size": st.sampled_from([1, 8, 16, 32]),
      "cluster.kv_cache.gpu_memory_utilization": st.sampled_from([0.5, 0.85, 0.9, 0.95]),
      "cluster.kv_cache.prefix_caching": st.booleans(),
      "cluster.tp": st.sampled_from([1, 2, 4, 8]),
      "cluster.max_model_len": st.sampled_from([2048, 4096, 8192])}
optional_kv = {"cluster.kv_cache.num_blocks": st.integers(1, 100_000)}


@st.composite
def vllm_wanted(draw):
    name = draw(st.sampled_from(["sarathi", "orca"]))
    budget = draw(st.integers(256, 16384))
    wanted = {"policy.name": name, "policy.token_budget": budget,
              "policy.max_num_seqs": draw(st.integers(1, budget)), **{k: draw(s) for k, s in kv.items()}}
    wanted.update(draw(st.fixed_dictionaries({}, optional=optional_kv)))
    if name == "sarathi":
        wanted["policy.long_prefill_token_threshold"] = draw(st.one_of(st.none(), st.integers(1, 4096)))
        loras = draw(st.one_of(st.none(), st.integers(1, 8)))
        if loras is not None:
            wanted["policy.max_loras"] = loras
        overlap, eager = draw(st.booleans()), draw(st.booleans())
        engine = {"preset": "vllm-v1", **({"overlap": True, "output_lag_steps": 1} if overlap else {}),
                  **({"cuda_graph_max_batch": 0} if eager else {})}
        wanted["cost_model.engine"] = engine if len(engine) > 1 else "vllm-v1"
    return wanted


@st.composite
def sglang_wanted(draw):
    wanted = {"policy.token_budget": draw(st.integers(256, 32768)),
              "policy.chunked_prefill_size": draw(st.one_of(st.none(), st.integers(64, 16384))),
              "policy.max_num_seqs": draw(st.integers(1, 2048)),
              "policy.schedule_policy": draw(st.sampled_from(["fcfs", "lpm", "dfs_weight", "lof", "random"])),
              "policy.enable_mixed_chunk": draw(st.booleans()),
              "cluster.replicas": draw(st.integers(1, 4)), **{k: draw(s) for k, s in kv.items()}}
    if draw(st.booleans()):
        wanted["cluster.kv_cache.num_blocks"] = draw(st.integers(1, 100_000))
    return wanted


@settings(max_examples=150, deadline=None)
@given(vllm_wanted())
def test_every_vllm_flag_rendered_parses_back_to_the_same_settings(wanted):
    resolved = round_trip("vllm", wanted)
    for key, value in wanted.items():
        assert engines_value("vllm", key, resolved) == value, key
    assert not unmatched("vllm", wanted, render("vllm", wanted, H100), H100)


@settings(max_examples=150, deadline=None)
@given(sglang_wanted())
def test_every_sglang_flag_rendered_parses_back_to_the_same_settings(wanted):
    resolved = round_trip("sglang", wanted)
    for key, value in wanted.items():
        assert engines_value("sglang", key, resolved) == value, key


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_only_flags_that_change_something_or_are_pinned_are_written(engine):
    module = ENGINES[engine]
    defaults, _ = module.resolve({}, H100, "x")
    wanted = {k: v for k, v in defaults.items() if k.startswith(("policy.", "cluster."))}
    flags = render(engine, wanted, H100)
    assert set(flags) == {name for name, flag in module.FLAGS.items() if flag.pin and flag.key in wanted}


def test_sglang_switches_are_never_written_in_a_no_form():
    # SGLang's store_true flags have no --no- form: a setting at the default writes no flag at all
    wanted = {"cluster.kv_cache.prefix_caching": True, "policy.enable_mixed_chunk": False,
              "cost_model.engine": "sglang"}
    assert "--no-" not in join(render("sglang", wanted, H100))


def _commands(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def _server(command: str) -> dict:
    tokens = shlex.split(command)
    if tokens[:2] == ["vllm", "serve"]:
        return {"engine": "vllm", "args": tokens[3:]}  # past the MODEL placeholder
    assert tokens[:5] == ["python", "-m", "sglang.launch_server", "--model-path", "MODEL"], command
    return {"engine": "sglang", "args": tokens[5:]}


BASE = {"name": "t", "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "h100", "tp": 2},
        "workload": WORKLOAD, "output": {"plots": False, "trace": False}}
DEPLOYMENTS = [
    {"cluster": {"replicas": 2}, "policy": {"name": "sarathi", "token_budget": 2048, "max_num_seqs": 128,
                                            "chunk_size": 512}},
    {"cluster": {"kv_cache": {"block_size": 32, "gpu_memory_utilization": 0.8, "num_blocks": 900,
                              "prefix_caching": True}, "max_model_len": 4096},
     "policy": {"name": "sarathi", "token_budget": 8192, "max_num_seqs": 1024, "max_loras": 2},
     "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1,
                    "engine": {"preset": "vllm-v1", "overlap": True, "output_lag_steps": 1}}},
    {"policy": {"name": "orca", "kv_reservation": "paged", "token_budget": 8192, "max_num_seqs": 64}},
    {"cluster": {"replicas": 3, "kv_cache": {"block_size": 16, "num_blocks": 500}},
     "policy": {"name": "sglang", "token_budget": 4096, "chunked_prefill_size": None, "schedule_policy": "lpm"}},
    {"policy": {"name": "sglang", "token_budget": 16384, "chunked_prefill_size": 2048, "max_num_seqs": 48,
                "enable_mixed_chunk": True}},
]


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=["sarathi", "sarathi-kv-lora-async", "orca", "sglang-lpm",
                                                         "sglang-mixed"])
def test_tune_flags_resolve_back_through_server_to_the_simulated_settings(deployment):
    config = load_config({**BASE, **deployment})
    [command] = _commands(flags_text(config))
    server = _server(command)
    data = {**BASE, **{k: v for k, v in deployment.items() if k == "cost_model"}, "server": server}
    merged, resolution = apply_server(data)
    settings_ = policy_settings(config)
    tp = int(config.cluster.tp or config.cost_model.get("tp", 1))
    wanted = (vllm_settings(config, settings_, tp, 1) if server["engine"] == "vllm"
              else sglang_settings(config, settings_, tp, 1, config.cluster.replicas))
    context = Context(gpu_spec("h100"), 8192)
    for key, value in wanted.items():
        assert engines_value(server["engine"], key, resolution.settings, context) == value, (key, command)


def test_pipeline_parallel_size_maps_onto_cost_model_pp_where_the_cost_model_has_it():
    settings_, explicit = vllm.resolve({"pipeline-parallel-size": 4}, WITH_PP, "server.args")
    assert settings_["cost_model.pp"] == 4 and "cost_model.pp" in explicit
    settings_, _ = sglang.resolve({"pp-size": 2}, WITH_PP, "server.args")
    assert settings_["cost_model.pp"] == 2
    assert "cost_model.pp" not in vllm.resolve({}, WITH_PP, "server.args")[0]  # no flag: the experiment's own
    assert round_trip("vllm", {"policy.name": "sarathi", "policy.token_budget": 4096, "policy.max_num_seqs": 64,
                               "cost_model.pp": 2}, WITH_PP)["cost_model.pp"] == 2


@pytest.mark.parametrize("engine, flag", [("vllm", "pipeline-parallel-size"), ("sglang", "pp-size")])
def test_pipeline_parallelism_without_a_pp_option_is_a_clear_error(engine, flag):
    module = ENGINES[engine]
    with pytest.raises(ConfigError, match=f"server.args --{flag}.*does not model pipeline parallelism"):
        module.resolve({flag: 2}, H100, "server.args")
    assert "cost_model.pp" not in module.resolve({flag: 1}, H100, "server.args")[0]  # one stage: nothing to model
    linear = {"name": "s", "cost_model": {"type": "linear", "base": 0.01, "per_token": 1e-4}, "workload": WORKLOAD,
              "server": {"engine": engine, "args": f"--{flag} 2"}}
    with pytest.raises(ConfigError, match="cost model 'linear' does not model pipeline parallelism"):
        load_config(linear)
