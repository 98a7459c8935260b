"""Workloads: the requests a simulation replays.

Sources: an explicit list, a real trace (Azure LLM 2023, Mooncake, ShareGPT / arXiv lengths,
Vidur processed traces) or a user's dataset (raw ShareGPT JSON, BurstGPT, generic CSV/JSONL, vLLM
bench results), or synthetic arrival processes (load stages among them) and length distributions,
optionally with shared system prompts or multi-turn conversations that fill `Request.prefix_hashes`.
Clients may be closed-loop (max_concurrency, think time, sessions) and give up (timeout). Agentic
sessions (agentic.py) are programs of turns over one growing context, with tool calls (tool_times.py)
and sub-agents between turns.

    cfg = parse_workload(experiment["workload"])          # ConfigError names the bad key
    requests = build_requests(cfg, np.random.default_rng(seed), base_dir=experiment_dir)
    print(format_description(describe_requests(requests)))
"""
from cbsim.workloads.arrivals import ARRIVALS, sample_arrivals
from cbsim.workloads.build import Workload, build_requests, build_run, build_workload, make_requests
from cbsim.workloads.clients import ClientPlan
from cbsim.workloads.config import ExplicitRequest, WorkloadConfig, check_workload, parse_tagged, parse_workload
from cbsim.workloads.describe import describe_requests, format_description, plot_workload
from cbsim.workloads.lengths import LENGTHS, sample_lengths
from cbsim.workloads.prefixes import SharedPrefixConfig, block_hash, content_id, hash_chain
from cbsim.workloads.trace_source import TraceConfig, drop_warnings, load_trace, resolve_path
from cbsim.workloads.readers import TraceData
from cbsim.workloads.traces import read_trace

__all__ = [
    "ARRIVALS", "LENGTHS", "ClientPlan", "ExplicitRequest", "Workload", "build_run", "SharedPrefixConfig", "TraceConfig", "TraceData", "WorkloadConfig",
    "block_hash", "build_requests", "build_workload", "check_workload", "content_id", "describe_requests",
    "drop_warnings", "format_description", "hash_chain", "load_trace", "make_requests", "parse_tagged",
    "parse_workload", "plot_workload", "read_trace", "resolve_path", "sample_arrivals", "sample_lengths",
]
