"""The experiment-file reference, generated from the config dataclasses and the registries.

`cbsim schema` prints it; docs/reference/experiment-file.md embeds it between markers (and
docs/reference/server-flags.md the flag tables of cbsim/server/reference.py), and a test keeps each
page equal to its generator, so every option a user can set is documented with its type, default and
help text.
"""
from __future__ import annotations

import dataclasses

from cbsim.sim.speculative import SpeculativeConfig
from cbsim.config import (AdmissionConfig, ClusterConfig, ExperimentConfig, KVCacheConfig, KVTierConfig,
                          KVTiersConfig, LinkConfig, OutputConfig, PoolConfig, PreemptionConfig, SimConfig)
from cbsim.policies.registry import load_all
from cbsim.sim.costmodels import COST_MODELS, load_cost_model  # noqa: F401
from cbsim.sim.costmodels import _builtin  # noqa: F401  (registers the built-in cost models)
from cbsim.core.errors import ConfigError
from cbsim.core.schema import field_help
from cbsim.server.reference import flags_markdown
from cbsim.sim.metrics import MetricsConfig, SLOConfig
from cbsim.workloads import arrivals, lengths, prefixes, trace_source
from cbsim.workloads.config import WorkloadConfig

BEGIN = "<!-- BEGIN GENERATED REFERENCE (cbsim schema) -->"
BEGIN_FLAGS = "<!-- BEGIN GENERATED REFERENCE (server flags) -->"
END = "<!-- END GENERATED REFERENCE -->"


def _table(cls) -> list[str]:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, kind, default, text in field_help(cls):
        if dataclasses.is_dataclass(default):
            default = "(section)"
        shown = "—" if default is None else f"`{default}`" if default != "(required)" else "required"
        kind = kind.replace("|", " or ")
        rows.append(f"| `{name}` | {kind} | {shown} | {text.replace('|', '/')} |")
    return rows


def _section(title: str, cls, note: str = "") -> list[str]:
    lines = [f"## {title}", ""]
    if note:
        lines += [note, ""]
    return lines + _table(cls) + [""]


def reference_markdown() -> str:
    """Markdown tables of every config section, policy and cost model."""
    lines = _section("top level", ExperimentConfig)
    for title, cls in (("cluster", ClusterConfig), ("cluster.kv_cache", KVCacheConfig),
                       ("cluster.kv_cache.tiers", KVTiersConfig), ("cluster.kv_cache.tiers.levels[i]", KVTierConfig),
                       ("cluster.prefill / cluster.decode (mode: pd)", PoolConfig), ("cluster.link", LinkConfig),
                       ("preemption", PreemptionConfig), ("admission", AdmissionConfig), ("sim", SimConfig),
                       ("output", OutputConfig),
                       ("metrics", MetricsConfig), ("metrics.slo", SLOConfig), ("workload", WorkloadConfig),
                       ("workload.trace", trace_source.TraceConfig),
                       ("workload.shared_prefix", prefixes.SharedPrefixConfig), ("speculative", SpeculativeConfig)):
        lines += _section(f"`{title}`", cls)
    for kind, table in (("arrival", arrivals.ARRIVALS), ("length", lengths.LENGTHS)):
        for name, cls in table.items():
            lines += _section(f"workload {kind} `type: {name}`", cls)
    for name, cls in sorted(load_all().items()):
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        lines += _section(f"policy `name: {name}`", cls.Config, doc)
    for name, cls in sorted(COST_MODELS.items()):
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        lines += _section(f"cost model `type: {name}`", cls.Config, doc)
    return "\n".join(lines).rstrip() + "\n"


def embed(text: str, file: str | None = None) -> str:
    """`text` with each generated section it holds (experiment reference, server flags) rewritten
    between its markers; ConfigError (naming `file`) when it holds none."""
    sections = [(begin, render) for begin, render in ((BEGIN, reference_markdown), (BEGIN_FLAGS, flags_markdown))
                if begin in text]
    if not sections or any(text.split(begin, 1)[1].find(END) < 0 for begin, _ in sections):
        raise ConfigError("<page>", f"a page holding a generated section: {BEGIN} (or {BEGIN_FLAGS}) ... {END}",
                          file=file, has_got=False)
    for begin, render in sections:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(END, 1)
        text = f"{head}{begin}\n{render()}{END}{tail}"
    return text
