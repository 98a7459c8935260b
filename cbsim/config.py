"""The experiment file: a typed, validated ExperimentConfig.

`load_config(source, overrides)` accepts a YAML path or a mapping, applies `--set key.path=value`
overrides, validates every section (including the policy, cost model and workload, which are
validated by their own registries), and raises ConfigError naming the file and the key path.
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from cbsim.server import apply_server, describe
from cbsim.core.bounds import MAX_YAML_BYTES, load_yaml

from cbsim.core.errors import ConfigError
from cbsim.policies.registry import parse_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.costmodels.registry import DEFAULT_COST_MODEL
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.costmodels.catalog.specs import DEFAULT_MODEL
from cbsim.core.schema import option, parse, require
from cbsim.core.units import Seconds
from cbsim.sim.metrics import MetricsConfig
from cbsim.sim.speculative import parse_speculative
from cbsim.workloads import parse_workload
from cbsim.workloads.config import check_lengths

MAX_REPLICAS = 4096  # replicas per cluster or pool: more is surely a typo (and a slow run)
MAX_BLOCKS = 1 << 31  # KV blocks per replica
MAX_BLOCK_SIZE = 1 << 16  # tokens per KV block


@dataclass
class KVTierConfig:
    """One lower KV tier (sim/kv/tiers.py): where prefix-cache units evicted from the GPU live on."""

    name: Literal["cpu", "ssd", "remote"] = option(help="cpu (host DRAM; the first tier, shared with swap), ssd "
                                                   "(local NVMe) or remote (a KV store over the network)")
    capacity_gib: float | None = option(None, help="GiB of KV this tier holds per GPU (vLLM --kv-offloading-size "
                                        "/ GPUs, SGLang --hicache-size); or give capacity_ratio")
    capacity_ratio: float | None = option(None, help="capacity as a multiple of the GPU's KV blocks (SGLang "
                                          "--hicache-ratio, 'the ratio of the host KV pool to the device pool')")
    bandwidth_gb_s: float | None = option(None, help="GB/s each way between this tier and the GPU; null for cpu: "
                                          "preemption.swap_bandwidth_gb_s (the host link); required for ssd and "
                                          "remote (cbsim has no cited default for them)")
    latency_s: Seconds = option(0.0, help="fixed seconds per transfer to or from this tier")

    def validate(self) -> None:
        require((self.capacity_gib is None) != (self.capacity_ratio is None), "capacity_gib",
                "exactly one of capacity_gib and capacity_ratio", self.capacity_gib)
        require(self.capacity_gib is None or self.capacity_gib > 0, "capacity_gib", "GiB > 0", self.capacity_gib)
        require(self.capacity_ratio is None or self.capacity_ratio > 0, "capacity_ratio", "a number > 0",
                self.capacity_ratio)
        require(self.bandwidth_gb_s is None or self.bandwidth_gb_s > 0, "bandwidth_gb_s", "a number > 0 or null",
                self.bandwidth_gb_s)
        require(self.name == "cpu" or self.bandwidth_gb_s is not None, "bandwidth_gb_s",
                f"a number > 0 for tier {self.name} (no cited default)", None)
        require(self.latency_s >= 0, "latency_s", "a number >= 0", self.latency_s)


@dataclass
class KVTiersConfig:
    """The tiers behind the GPU prefix cache (sim/kv/tiers.py; docs/concepts/kv-tiers.md)."""

    levels: list[KVTierConfig] = option(help="the tiers, fastest first: cpu, then ssd and/or remote")
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = option(
        "write_through", help="write_through: a unit is copied to cpu when a request computes or hits it without "
        "a copy, beside the steps (vLLM OffloadingConnector, LMCache, SGLang's default); write_through_selective: "
        "the same from its second request on (SGLang); write_back: copied when the GPU evicts it, the evicting "
        "step waiting for the copy (SGLang --hicache-write-policy write_back)")
    load: Literal["layerwise", "blocking"] = option(
        "layerwise", help="layerwise: a restore overlaps the forward of the step that needs it, layer by layer "
        "(SGLang HiCache load_back; vLLM's asynchronous load is approximated by it); blocking: the step runs after "
        "the restore (LMCache without use_layerwise)")

    def validate(self) -> None:
        require(len(self.levels) >= 1, "levels", "a list of one tier or more", self.levels)
        names = [level.name for level in self.levels]
        require(names[0] == "cpu", "levels[0].name", "cpu (the host tier comes first; swap shares it)", names[0])
        require(len(set(names)) == len(names), "levels", "tiers with distinct names", names)


@dataclass
class KVCacheConfig:
    block_size: int = option(16, help="tokens per KV block (page)")
    num_blocks: int | Literal["auto"] = option("auto", help="KV blocks per replica, or 'auto': from GPU memory, "
                                                 "weights and gpu_memory_utilization (needs a gpu)")
    gpu_memory_utilization: float = option(0.9, help="fraction of GPU memory the engine may use (auto sizing)")
    watermark: float = option(0.01, help="fraction of blocks kept free when admitting a new request")
    reserve_full_prompt: bool = option(False, help="admit a request only if its whole input fits, not just "
                                       "its first chunk")
    check_full_input: bool = option(False, help="admit a request only if its whole input would fit in the free "
                                    "blocks, but take blocks for its first chunk only (vLLM 0.32's "
                                    "scheduler_reserve_full_isl; server.version 0.32 or later sets it)")
    prefix_caching: bool = option(False, help="keep computed full prompt blocks in a radix tree after their request "
                                  "ends, shared by later requests with the same prefix (Request.prefix_hashes); "
                                  "unreferenced ones are evicted LRU when blocks run out")
    hash_block_size: int | None = option(None, help="tokens per hash of the requests' prefix_hashes; null: the "
                                         "workload's (shared_prefix.hash_block_size, or trace.hash_block_size, 512 "
                                         "for Mooncake), else block_size. Independent of block_size: the cache "
                                         "keeps units of lcm(block_size, hash_block_size) tokens")
    hybrid_kv_cache_manager: bool = option(True, help="sliding-window models (model sliding_window, e.g. Mistral-7B-"
                                           "v0.1, Gemma-2): free a windowed layer's blocks once they leave the "
                                           "window, as vLLM's hybrid KV cache manager does (its default); false: "
                                           "every layer keeps every block (vLLM --disable-hybrid-kv-cache-manager). "
                                           "No effect without a window; not with prefix_caching or cluster.mode pd")
    tiers: KVTiersConfig | None = option(None, help="lower KV tiers (cpu, ssd, remote) that prefix-cache units "
                                         "evicted from the GPU move to and are restored from; needs "
                                         "prefix_caching; null: evicted units vanish")

    def validate(self) -> None:
        require(1 <= self.block_size <= MAX_BLOCK_SIZE, "block_size", f"an integer >= 1 and <= {MAX_BLOCK_SIZE}",
                self.block_size)
        require(self.num_blocks == "auto" or 1 <= self.num_blocks <= MAX_BLOCKS, "num_blocks",
                f"an integer >= 1 and <= {MAX_BLOCKS} or 'auto'", self.num_blocks)
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "a number in (0, 1]",
                self.gpu_memory_utilization)
        require(0 <= self.watermark < 1, "watermark", "a number in [0, 1)", self.watermark)
        require(self.hash_block_size is None or self.hash_block_size >= 1, "hash_block_size",
                "an integer >= 1 or null", self.hash_block_size)
        require(self.tiers is None or self.prefix_caching, "tiers", "null unless prefix_caching is true (the tiers "
                "hold the prefix cache's evicted units)", "a tiers section")


@dataclass
class PoolConfig:
    """One pool of a P/D cluster: its replicas and what differs from the top-level settings."""

    replicas: int = option(1, help="replicas in this pool")
    policy: dict | None = option(None, help="this pool's scheduling policy {name: ..., options}; null: the "
                                 "top-level policy")
    cost_model: dict | None = option(None, help="keys overriding the top-level cost_model for this pool (e.g. "
                                     "{tp: 2}); null: the same cost model")
    num_blocks: int | None = option(None, help="KV blocks per replica of this pool; null: cluster.kv_cache."
                                    "num_blocks (auto: sized from this pool's GPU and tp)")
    prefix_caching: bool | None = option(None, help="this pool's prefix cache; null: cluster.kv_cache.prefix_caching "
                                         "(e.g. false on the decode pool: hand-offs then send whole prompts)")

    def validate(self) -> None:
        require(1 <= self.replicas <= MAX_REPLICAS, "replicas", f"an integer >= 1 and <= {MAX_REPLICAS}", self.replicas)
        require(self.num_blocks is None or 1 <= self.num_blocks <= MAX_BLOCKS, "num_blocks",
                f"an integer >= 1 and <= {MAX_BLOCKS} or null", self.num_blocks)


@dataclass
class LinkConfig:
    """How KV moves from a prefill replica to a decode replica (see sim/kv/link.py, sim/pd.py)."""

    mode: Literal["p2p", "pool"] = option("p2p", help="p2p: one hop over the prefill replica's link, once the "
                                          "decode side has reserved room; pool: a hop into a shared KV store "
                                          "(at once, freeing the prefill side), then a hop over the decode "
                                          "replica's link once it has room")
    latency_s: Seconds = option(0.0001, help="fixed seconds per transfer (per hop)")
    bandwidth_gb_s: float = option(25.0, help="GB/s of each prefill replica's link (200 Gb/s RDMA ~ 25)")
    lanes: int = option(1, help="transfers a link carries at once; more wait in FIFO order")
    pool_bandwidth_gb_s: float | None = option(None, help="pool mode: GB/s of each decode replica's link from "
                                               "the store; null: bandwidth_gb_s")

    def validate(self) -> None:
        require(self.latency_s >= 0, "latency_s", "a number >= 0", self.latency_s)
        require(self.bandwidth_gb_s > 0, "bandwidth_gb_s", "a number > 0", self.bandwidth_gb_s)
        require(self.lanes >= 1, "lanes", "an integer >= 1", self.lanes)
        require(self.pool_bandwidth_gb_s is None or self.pool_bandwidth_gb_s > 0, "pool_bandwidth_gb_s",
                "a number > 0 or null", self.pool_bandwidth_gb_s)


@dataclass
class ClusterConfig:
    replicas: int = option(1, help="number of replicas (each one GPU group running the policy)")
    router: Literal["round_robin", "least_loaded", "kv_aware", "prefix_affinity", "session_affinity"] = option(
        "round_robin", help="how arrivals pick a replica: round_robin | least_loaded (fewest outstanding tokens) | "
                            "kv_aware (most free + evictable KV blocks) | prefix_affinity (longest cached prefix of "
                            "the request, ties least loaded) | session_affinity (an agentic session stays on the "
                            "replica of its first request, which goes to the least loaded)")
    gpu: str | None = option(None, help="GPU for KV sizing; default: the cost model's gpu")
    tp: int | None = option(None, help="tensor-parallel degree for KV sizing; default: the cost model's tp or 1")
    max_model_len: int | None = option(None, help="longest prompt + output a request may have; default: the model's")
    kv_cache: KVCacheConfig = option(KVCacheConfig(), help="paged KV cache")
    pp_chunk_pipelining: bool = option(True, help="with pipeline stages (cost_model.pp): a prompt's next chunk "
                                       "joins the next micro-batch while its previous one is in flight, as vLLM V1 "
                                       "(num_computed_tokens advanced at scheduling) and SGLang do; false: it waits "
                                       "for the previous chunk's output, as early vLLM V1 (scheduled_req_ids)")
    dp_lockstep: bool = option(True, help="with data-parallel attention (cost_model.data_parallel D > 1): each "
                               "run of D replicas is one deployment whose ranks step together, a step lasting its "
                               "slowest rank's forward and an idle rank running a one-token dummy batch, as vLLM "
                               "(DPEngineCoreProc) and SGLang (DP attention) do; false: each rank steps alone "
                               "(cbsim before issue 28)")
    prefill_schedule_interval: int = option(1, help="vLLM --prefill-schedule-interval N, with dp_lockstep ranks: "
                                             "prompts (new and in progress) run only on every Nth step of the "
                                             "ranks' wave while a running request can decode, unless the last "
                                             "admitting step left prompts waiting; 1 (vLLM's default) = every step")
    mode: Literal["colocated", "pd"] = option("colocated", help="colocated: every replica runs prefill and "
                                              "decode; pd: prefill/decode disaggregation (prefill and decode "
                                              "pools joined by KV links; `replicas` is then unused)")
    prefill: PoolConfig | None = option(None, help="mode pd: the prefill pool (arrivals are routed here by "
                                        "`router`)")
    decode: PoolConfig | None = option(None, help="mode pd: the decode pool")
    link: LinkConfig = option(LinkConfig(), help="mode pd: the KV links between the pools")
    first_token_on: Literal["prefill", "decode"] = option("decode", help="mode pd: the first token is shown "
                                                          "only once its KV has reached the decode replica (TTFT "
                                                          "includes the transfer: every output token comes "
                                                          "from the decode replica, as vLLM's benchmarks/disagg_"
                                                          "benchmarks/disagg_prefill_proxy_server.py sends the "
                                                          "prefill with max_tokens=1 and streams every token from "
                                                          "the decode instance), or when the prefill "
                                                          "replica samples it")
    decode_router: Literal["round_robin", "least_loaded", "prefix_affinity"] = option(
        "least_loaded", help="mode pd: which decode replica with room a prefilled request goes to (prefix_affinity: "
                             "the one with most of its prompt cached, then least loaded)")

    def validate(self) -> None:
        require(1 <= self.replicas <= MAX_REPLICAS, "replicas", f"an integer >= 1 and <= {MAX_REPLICAS}", self.replicas)
        require(self.tp is None or 1 <= self.tp <= 1024, "tp", "an integer >= 1 and <= 1024 or null", self.tp)
        require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "an integer >= 2",
                self.max_model_len)
        require(self.prefill_schedule_interval >= 1, "prefill_schedule_interval", "an integer >= 1 (vLLM: ge=1)",
                self.prefill_schedule_interval)
        if self.mode == "pd":
            require(self.kv_cache.tiers is None, "kv_cache.tiers", "null with mode pd (cbsim does not model KV "
                    "tiers on P/D pools yet)", "a tiers section")
            require(self.prefill is not None, "prefill", "a pool section {replicas, policy} (mode pd)", None)
            require(self.decode is not None, "decode", "a pool section {replicas, policy} (mode pd)", None)
            require(self.prefill_schedule_interval == 1, "prefill_schedule_interval", "1 with mode pd (P/D pools' "
                    "data-parallel ranks step alone in cbsim: no lockstep wave to count steps in)",
                    self.prefill_schedule_interval)


@dataclass
class PreemptionConfig:
    mode: Literal["recompute", "swap", "auto"] = option("recompute", help="recompute: free blocks and prefill "
                                                        "again; swap: move KV to host memory and back; auto: per "
                                                        "victim, whichever the cost model says is faster")
    victim: Literal["last_admitted", "lowest_priority", "shortest_remaining", "lowest_cache_value"] = option(
        "last_admitted", help="which running request to evict: last_admitted (vLLM FCFS); lowest_priority (vLLM "
        "priority); shortest_remaining (fewest output tokens left); lowest_cache_value (fewest computed tokens "
        "that a recompute would have to prefill again, cached shared prefix not counted); see policies/batch.py")
    swap_bandwidth_gb_s: float | None = option(None, help="host link bandwidth for swap, GB/s; null: what the "
                                               "engine's swap achieves (vidur-a100 presets, vLLM V0's per-block "
                                               "swap_blocks: 3.1, vllm PR #11531), else the PCIe 4 x16 peak, 25")
    swap_space_gib: float | None = option(None, help="host swap space per GPU in GiB (vLLM V0 --swap-space, "
                                          "default 4 there); a victim whose KV does not fit in what is left is "
                                          "recomputed instead; null: unbounded")
    swapped_queue: Literal["head", "vllm_v0"] = option("head", help="head: a swapped victim rejoins the head of "
                                                       "the waiting queue like a recompute victim (latest first); "
                                                       "vllm_v0: swapped requests wait FIFO ahead of every other "
                                                       "waiting request, none swaps in during a step that "
                                                       "preempts, and no new prompt is admitted while one is "
                                                       "swapped out (vLLM V0 _schedule_default)")

    def validate(self) -> None:
        require(self.swap_bandwidth_gb_s is None or self.swap_bandwidth_gb_s > 0, "swap_bandwidth_gb_s",
                "a number > 0 or null", self.swap_bandwidth_gb_s)
        require(self.swap_space_gib is None or self.swap_space_gib >= 0, "swap_space_gib",
                "GiB >= 0 or null", self.swap_space_gib)


@dataclass
class AdmissionConfig:
    """Admission signals (sim/admission.py): rejection at arrival (max_predicted_ttft, max_queued_requests)
    and per-step admission limits (decode_reserve, tpot_slack, pd_backpressure); every one off by default."""

    max_predicted_ttft: Seconds | None = option(None, help="reject a request at arrival when its predicted TTFT "
                                              "(prefill tokens queued ahead / recent prefill rate) exceeds this "
                                              "many seconds; null: admit everything")
    window_steps: int = option(32, help="steps with prefill work the recent prefill rate averages over "
                               "(exponentially)")
    probe_tokens: int = option(512, help="cold start: the rate is seeded with one prefill of this many tokens, "
                               "priced by the cost model")
    decode_reserve: bool = option(False, help="keep KV free for the running requests' future decode tokens, "
                                  "SGLang's new_token_ratio (PrefillAdder.rem_total_tokens): each running request "
                                  "reserves min(outputs left, clip_max_new_tokens) x a ratio that decays per step "
                                  "and jumps up after a preemption; an admission also needs room for its own "
                                  "min(outputs left, clip)")
    schedule_conservativeness: float = option(1.0, help="decode_reserve: SGLang --schedule-conservativeness; the "
                                              "ratio starts at min(0.7 x this, 1) and decays to 0.14 of that "
                                              "over 600 steps")
    clip_max_new_tokens: int = option(4096, help="decode_reserve: a request reserves at most this many future "
                                      "tokens (SGLang SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION)")
    tpot_slack: float | None = option(None, help="while any running request is decoding, admit no new request "
                                      "into a step whose predicted time (cost model) exceeds this fraction of "
                                      "metrics.slo.tpot; null: off")
    pd_backpressure: int | None = option(None, help="cluster.mode pd: prefill replicas admit no new prompt while "
                                         "this many prefilled requests or more wait for decode room (the transfer "
                                         "queue); null: off (the KV they hold still limits the prefill side)")
    max_queued_requests: int | None = option(None, help="overload: reject a request arriving while this many wait "
                                             "at its replica (SGLang --max-queued-requests, 'The request queue is "
                                             "full.'); null: no limit")

    def validate(self) -> None:
        require(self.max_predicted_ttft is None or self.max_predicted_ttft > 0, "max_predicted_ttft",
                "a positive number of seconds or null", self.max_predicted_ttft)
        require(self.window_steps >= 1, "window_steps", "an integer >= 1", self.window_steps)
        require(self.probe_tokens >= 1, "probe_tokens", "an integer >= 1", self.probe_tokens)
        require(self.schedule_conservativeness >= 0, "schedule_conservativeness", "a number >= 0",
                self.schedule_conservativeness)
        require(self.clip_max_new_tokens >= 0, "clip_max_new_tokens", "an integer >= 0", self.clip_max_new_tokens)
        require(self.tpot_slack is None or self.tpot_slack > 0, "tpot_slack", "a fraction > 0 or null",
                self.tpot_slack)
        require(self.pd_backpressure is None or self.pd_backpressure >= 1, "pd_backpressure",
                "an integer >= 1 or null", self.pd_backpressure)
        require(self.max_queued_requests is None or self.max_queued_requests >= 1, "max_queued_requests",
                "an integer >= 1 or null", self.max_queued_requests)


@dataclass
class SimConfig:
    fast_forward: bool = option(True, help="advance runs of identical decode steps at once (same results)")
    max_time: Seconds | None = option(None, help="stop the simulation at this simulated time (a duration: 600, "
                                      "600s or 10min; a bare number is seconds)")
    cost_noise: bool = option(False, help="multiply each step time by a factor drawn (seeded) from the cost "
                              "model's residuals (fitted models); turns fast-forward off")

    def validate(self) -> None:
        require(self.max_time is None or self.max_time > 0, "max_time", "a time > 0 (seconds) or null",
                self.max_time)


@dataclass
class OutputConfig:
    dir: str | None = option(None, help="results folder of `cbsim run` (default results/<name>); from Python, "
                             "run_experiment writes only to the out_dir it is given")
    plots: bool = option(False, help="draw the PNG figures (latency CDF, step timeline, KV usage, dashboard): only "
                         "when asked, here or with `cbsim run --plots` (they are most of a short run's time)")
    trace: bool = option(False, help="write trace.json, a Perfetto/Chrome trace of the first metrics.trace_max_steps "
                         "steps (~360 bytes a step: 18 MB at the default 50,000)")
    formats: list[Literal["csv", "parquet"]] = option(["parquet"], help="table file formats: parquet (zstd; "
                                                      "pandas.read_parquet) and/or csv (~4x larger and ~15x "
                                                      "slower to write: 141 MB of steps.csv against 38 MB of "
                                                      "steps.parquet for 50k requests)")
    bench_details: bool = option(False, help="bench.json (the schema of vllm bench serve --save-result) also "
                                 "lists every request's input_lens, output_lens, ttfts, itls, latencies, "
                                 "start_times and errors, as --save-detailed does")
    shapes: int = option(0, help="write shapes.jsonl with this many step shapes sampled from the run "
                         "(held-out batches for `cbsim profile --batches`); 0 = none")

    def validate(self) -> None:
        require(self.shapes >= 0, "shapes", "an integer >= 0 (0 = none)", self.shapes)
        require(self.dir is None or self.dir.strip() != "", "dir", "a folder path or null", self.dir)




@dataclass
class ExperimentConfig:
    name: str = option("experiment", help="experiment name (the default results folder)")
    seed: int = option(0, help="seed of the run's single random generator")
    model: Any = option(DEFAULT_MODEL, help="a model: preset or catalog name (cbsim models), Hugging Face id, path "
                        "to a config.json (or its folder), {config: name-or-path, fields to override}, or "
                        "a mapping of every ModelSpec field")
    cost_model: dict = option(DEFAULT_COST_MODEL, help="step-latency model: "
                              "{type: unit|linear|roofline|fitted|vidur, ...}")
    cluster: ClusterConfig = option(ClusterConfig(), help="replicas and their KV caches")
    policy: dict = option({"name": "sarathi"}, help="scheduling policy: {name: ..., options}")
    preemption: PreemptionConfig = option(PreemptionConfig(), help="what happens when KV runs out")
    admission: AdmissionConfig = option(AdmissionConfig(), help="early rejection of requests at arrival")
    workload: dict = option({}, help="requests: synthetic, explicit list or trace")
    metrics: Any = option(None, help="metric settings: long_prompt_threshold, slo, stall_factor")
    output: OutputConfig = option(OutputConfig(), help="what to write")
    sim: SimConfig = option(SimConfig(), help="simulator switches")
    speculative: Any = option(None, help="speculative decoding {method, num_speculative_tokens, model, acceptance} "
                              "(sim/speculative.py); null: off")
    source: str | None = field(default=None, repr=False, init=False)  # the file it came from
    sections: Sections | None = field(default=None, repr=False, init=False, compare=False)  # parsed once

    def validate(self) -> None:
        check_name(self.name, "name")
        require(self.seed >= 0, "seed", "an integer >= 0 (numpy seeds are non-negative)", self.seed)

    def to_dict(self) -> dict:
        """The experiment as a plain mapping (config.yaml): every field but `source` and `sections`."""
        return {f.name: asdict(value) if is_dataclass(value) else copy.deepcopy(value)
                for f in fields(self) if f.name not in ("source", "sections") for value in [getattr(self, f.name)]
                if not (f.name == "speculative" and value is None)}  # (configs without it read as before)


def check_name(name: str, path: str) -> None:
    """A run or sweep name becomes a folder under results/: one plain path component."""
    require(name.strip() != "" and name not in (".", "..") and not any(c in name for c in "/\\\0")
            and name == name.strip() and len(name.encode("utf-8", "surrogatepass")) <= 200, path,
            "a folder name: not empty, at most 200 bytes (a file system's 255 less the suffixes cbsim adds), "
            "no '/', '\\' or surrounding spaces, not '.' or '..'", name)


MAX_DEPTH = 64  # deepest YAML nesting accepted (experiment files use fewer than 10 levels)


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses duplicate keys and nesting deeper than MAX_DEPTH."""

    depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError("<file>", f"YAML nested at most {MAX_DEPTH} levels deep (line {mark.line + 1} "
                                  "is deeper)", has_got=False)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                repeated = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: PyYAML reports it below
                continue
            if repeated:
                raise ConfigError(str(key), f"each key once per mapping (line {key_node.start_mark.line + 1} "
                                  "repeats it)", has_got=False)
        return super().construct_mapping(node, deep)


def parse_yaml(text: str):
    """A YAML document as Python data (safe types only); ConfigError for duplicate keys or deep nesting,
    YamlBoundsError (a yaml.YAMLError) for a document too large or whose aliases expand too far."""
    return load_yaml(text, _StrictLoader)


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("<file>", "an existing YAML file", str(path))
    if path.stat().st_size > MAX_YAML_BYTES:
        raise ConfigError("<file>", f"a YAML file of at most {MAX_YAML_BYTES // 2**20} MiB", has_got=False,
                          file=str(path))
    try:
        data = parse_yaml(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError("<file>", f"UTF-8 text (byte {err.start} is not)", has_got=False, file=str(path)) from None
    except OSError as err:
        raise ConfigError("<file>", "a readable file", str(err), file=str(path)) from None
    except ConfigError as err:
        raise err.in_file(str(path)) from None
    except yaml.YAMLError as err:
        raise ConfigError("<file>", f"valid YAML ({err})".replace("\n", " "), has_got=False, file=str(path))
    if not isinstance(data, dict):
        raise ConfigError("<root>", "a mapping of experiment keys", data, file=str(path))
    return data


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """`key.path=value` strings (value parsed as YAML) set into a copy of `data`."""
    data = copy.deepcopy(data)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError("--set", "key.path=value", item)
        key, raw = item.split("=", 1)
        try:
            value = parse_yaml(raw)
        except (yaml.YAMLError, ConfigError) as err:
            problem = getattr(err, "problem", None) or getattr(err, "expected", None) or "invalid"
            raise ConfigError(f"--set {key.strip()}", f"a YAML value ({problem})", raw) from None
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(key, f"a mapping at {part}", node)
        node[parts[-1]] = value
    return data


def load_config(source, overrides: list[str] | None = None) -> ExperimentConfig:
    """Parse and validate an experiment from a YAML path, a mapping or an ExperimentConfig."""
    if isinstance(source, ExperimentConfig):
        if not overrides:
            return source
        source, file = source.to_dict(), source.source
    elif isinstance(source, (str, Path)):
        file = str(source)
        source = read_yaml(source)
    else:
        file = None
    try:
        data = apply_overrides(source, overrides)
        data, _ = apply_server(data)  # an engine's flags (server:) become the sections they set
        config = parse(ExperimentConfig, {k: v for k, v in data.items() if k != "source"})
        config.source = file
        validate_sections(config)
    except ConfigError as err:
        raise err.in_file(_blamed(err, file, overrides))
    return config


def _blamed(err: ConfigError, file: str | None, overrides: list[str] | None) -> str | None:
    """Where an error came from: the `--set key=value` that set its key (or a key above or below it),
    else the file."""
    for item in reversed(overrides or []):
        key = item.split("=", 1)[0].strip()
        path = err.path
        if path == key or path.startswith((key + ".", key + " ")) or key.startswith(path + "."):
            return f"--set {item}"
    return file


@dataclass(frozen=True)
class Sections:
    """The sections a registry owns, parsed once when the config is loaded (load_config): the model's
    spec, each pool's cost model and policy ("cluster", or "prefill" and "decode"), the workload. The
    composition root (build.py) builds a run from them instead of parsing the mappings again."""

    key: str  # the mappings they were parsed from, as JSON: a changed mapping is parsed afresh
    model: object  # ModelSpec
    cost_models: dict  # pool -> cost model
    policies: dict  # pool -> PolicySpec (policies/registry.py)
    workload: object  # WorkloadConfig


def validate_sections(config: ExperimentConfig) -> None:
    """Validate the sections owned by registries by parsing them, once: config.sections keeps them."""
    config.sections = _parse_sections(config)
    if not isinstance(config.metrics, MetricsConfig):
        config.metrics = parse(MetricsConfig, config.metrics, "metrics")
    config.speculative = parse_speculative(config)


def parsed_sections(config: ExperimentConfig) -> Sections:
    """The config's parsed sections (parsed now if the config was built or changed after loading)."""
    if config.sections is None or config.sections.key != _sections_key(config):
        config.sections = _parse_sections(config)
    return config.sections


def _sections_key(config: ExperimentConfig) -> str:
    pools = {name: asdict(section) if section is not None else None
             for name in ("prefill", "decode") for section in [getattr(config.cluster, name, None)]}
    return json.dumps([config.model, config.cost_model, config.policy, config.workload, config.cluster.mode,
                       config.cluster.max_model_len, pools], sort_keys=True, default=repr)


def _parse_sections(config: ExperimentConfig) -> Sections:
    model = model_spec(config.model, "model")
    cost_models = {"cluster": load_cost_model(config.cost_model, model)}
    policies = {"cluster": parse_policy(config.policy)}
    if config.cluster.mode == "pd":
        for name in ("prefill", "decode"):
            path = f"cluster.{name}"
            policy = pool_policy(config, name)
            if policy.get("name") == "static":
                raise ConfigError(f"{path}.policy.name", "an iteration-level policy (static batching holds a "
                                  "batch until its longest member finishes, which a P/D pool cannot do)", "static")
            policies[name] = parse_policy(policy, f"{path}.policy")
            try:
                cost_models[name] = load_cost_model(pool_cost_model(config, name), model)
            except ConfigError as err:
                raise err.under(path)
    workload = parse_workload(config.workload, "workload")
    check_lengths(workload, config.cluster.max_model_len or model.max_model_len)
    return Sections(_sections_key(config), model, cost_models, policies, workload)


def pool_policy(config: ExperimentConfig, pool: str) -> dict:
    """The policy mapping of P/D pool `pool` ("prefill" or "decode"): its own, else the top-level one."""
    section = getattr(config.cluster, pool)
    return section.policy if section is not None and section.policy is not None else config.policy


def pool_cost_model(config: ExperimentConfig, pool: str) -> dict:
    """The cost-model mapping of P/D pool `pool`: the top-level one with the pool's keys laid over it."""
    section = getattr(config.cluster, pool)
    overrides = section.cost_model if section is not None and section.cost_model else {}
    return {**config.cost_model, **overrides}


def server_lines(source, overrides=None) -> list[str]:
    """describe() of an experiment file's `server:` block (no lines without one), for `cbsim validate`."""
    _, resolution = apply_server(apply_overrides(read_yaml(source), overrides))
    return describe(resolution) if resolution else []
