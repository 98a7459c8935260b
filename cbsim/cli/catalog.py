"""`cbsim models` and `cbsim gpus`: the models and GPUs an experiment can name, with what they price to.

Invariant: the tables are computed from the same ModelSpec / GPUSpec objects the cost models and the
KV sizing use (sim/costmodels/catalog/specs.py, hf_config.py, gpus.py); nothing here is a second copy of a number.
"""
from __future__ import annotations

import typer

from cbsim.sim.costmodels.catalog.gpus import GPU_CATALOG, SOURCES
from cbsim.sim.costmodels.catalog.hf_config import catalog_names, catalog_spec
from cbsim.sim.costmodels.catalog.specs import GPU_PRESETS, MODEL_PRESETS


def model_rows(tp: int = 1) -> list[dict]:
    """One row per preset and catalog model: sizes per token and per GPU at tensor parallelism `tp`."""
    rows = []
    for origin, names, get in (("preset", tuple(MODEL_PRESETS), MODEL_PRESETS.__getitem__),
                               ("catalog", catalog_names(), catalog_spec)):
        for name in names:
            m = get(name)
            kind = ("MLA+" if m.is_mla else "") + (f"MoE {m.experts_per_token}/{m.num_experts}" if m.is_moe else "dense")
            if m.sliding_window:
                kind += f", window {m.sliding_window} on {m.sliding_layers}/{m.num_layers} layers"
            rows.append({"name": name, "origin": origin, "kind": kind, "params": m.params(),
                         "active_params": m.active_params(), "kv_bytes_per_token": m.kv_bytes_per_token(tp),
                         "weight_bytes_per_gpu": m.weight_bytes(tp), "precision": m.precision,
                         "layers": m.num_layers, "max_model_len": m.max_model_len})
    return rows


def gpu_rows() -> list[dict]:
    """One row per GPU preset and catalog entry, with its source."""
    return [{"name": name, "memory_gib": g.memory_bytes / 2**30, "bf16_tflops": g.bf16_flops / 1e12,
             "fp8_tflops": g.fp8_flops / 1e12, "memory_tb_s": g.hbm_bandwidth / 1e12,
             "link_gb_s": g.link_bandwidth / 1e9, "topology": g.topology,
             "inter_node_gb_s": g.inter_node_bandwidth / 1e9, "fitted": g.family or "-", "source": SOURCES[name]}
            for name, g in {**GPU_PRESETS, **GPU_CATALOG}.items()]


def register(app: typer.Typer) -> None:
    @app.command()
    def models(tp: int = typer.Option(1, "--tp", help="tensor-parallel degree for the per-GPU columns")):
        """List the model presets and the catalog of Hugging Face configs (parameters, KV bytes per token)."""
        typer.echo(f"{'name':<18} {'kind':<38} {'params':>9} {'active':>9} {'KV/token':>10} "
                   f"{f'weights/GPU@tp{tp}':>16}  precision")
        for r in model_rows(tp):
            typer.echo(f"{r['name']:<18} {r['kind']:<38} {r['params'] / 1e9:>8.2f}B {r['active_params'] / 1e9:>8.2f}B "
                       f"{r['kv_bytes_per_token'] / 1024:>7.1f}KiB {r['weight_bytes_per_gpu'] / 2**30:>13.1f}GiB  "
                       f"{r['precision']}")
        typer.echo("model: takes a name above, a path to a config.json (or its folder), or a mapping; "
                   "{config: <name>, weight_dtype: fp8, kv_dtype: fp8} changes the precision.")

    @app.command()
    def gpus(sources: bool = typer.Option(False, "--sources", help="print the datasheet behind each row")):
        """List the GPU presets and catalog: dense peaks, memory, links (vendor datasheets)."""
        typer.echo(f"{'name':<15} {'memory':>8} {'bf16':>9} {'fp8':>9} {'mem bw':>9} {'link':>9} "
                   f"{'topology':<16} {'network':>9}  fitted")
        for r in gpu_rows():
            fp8 = f"{r['fp8_tflops']:>6.0f}TF" if r["fp8_tflops"] else f"{'-':>8}"
            net = f"{r['inter_node_gb_s']:>5.0f}GB/s" if r["inter_node_gb_s"] else f"{'-':>9}"
            typer.echo(f"{r['name']:<15} {r['memory_gib']:>5.0f}GiB {r['bf16_tflops']:>7.0f}TF {fp8} "
                       f"{r['memory_tb_s']:>5.2f}TB/s {r['link_gb_s']:>5.0f}GB/s {r['topology']:<16} {net}  "
                       f"{r['fitted']}")
            if sources:
                typer.echo(f"    {r['source']}")
        typer.echo("dense peaks (sparse datasheet figures halved), links and network one direction per GPU; "
                   "fitted: whose GEMM/all-reduce constants apply (- : H100's, unvalidated).")
