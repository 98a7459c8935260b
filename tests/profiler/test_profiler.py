"""The profiler's measuring half on the CPU: attention backends against a naive loop, the layer's
KV writes, grids, derived features, and the tiny pipeline end to end (CLI and GPU job script)."""
import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cbsim.core.errors import ConfigError  # noqa: E402
from cbsim.profiler.backends import (BackendMismatch, SdpaBackend, TorchFlashBackend,  # noqa: E402
                                     check_backend, make_backend)
from cbsim.profiler.grid import (TILE_MULTIPLES, budget_batches, make_batch, named_grid,  # noqa: E402
                                 random_batches, read_batches, run_order, tile_edge_batches, write_batches)
from cbsim.profiler.layer import (LayerShape, batch_lengths, build_layout, decoder_layer,  # noqa: E402
                                  layer_shape, qkv_projection, random_cache, random_weights, rope_table)
from cbsim.profiler.measurements import (COLUMNS, batch_class, batch_features, parse_decode,  # noqa: E402
                                         parse_prefill)
from cbsim.profiler.run import ProfileConfig, estimate_seconds, plan_batches, run_profile  # noqa: E402
from paths import ROOT

CPU = torch.device("cpu")
TINY = layer_shape("tiny")
GQA3 = LayerShape("gqa3", 192, 6, 2, 32, 256, 100, 1)  # three query heads per KV head

CASES = [
    ((), (1, 7, 40)),  # decodes only
    (((9, 0),), ()),  # a prompt from scratch
    (((5, 23), (12, 4)), ()),  # chunked prefill with history: bottom-right causal alignment
    (((6, 17),), (3, 50)),  # mixed
    (((1, 9),), (1,)),  # a one-token chunk and a first-token decode
]


def naive_attention(q, ks, vs, q_lens, scale, top_left=False):
    """Per sequence in float64: softmax(q k^T) v over keys j <= (n - c) + i for the i-th of c
    queries (j <= i with `top_left`, the wrong alignment for a chunk with history)."""
    out, start = [], 0
    for k, v, c in zip(ks, vs, q_lens):
        n, group = k.shape[0], q.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("chd,nhd->hcn", q[start: start + c].double(), k) * scale
        limit = (0 if top_left else n - c) + torch.arange(c) + 1
        visible = torch.arange(n)[None, :] < limit[:, None]
        weights = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1)
        out.append(torch.einsum("hcn,nhd->chd", weights, v))
        start += c
    return torch.cat(out)


def scatter_sequences(cache, layout, ks, vs):
    """Put each sequence's K/V at position p into page pages[p // size], offset p % size."""
    size = layout.page_size
    for pages, k, v in zip(layout.pages, ks, vs):
        for p in range(k.shape[0]):
            cache.k[pages[p // size], p % size] = k[p]
            cache.v[pages[p // size], p % size] = v[p]


@pytest.mark.parametrize("shape", [TINY, GQA3], ids=["tiny", "gqa3"])
@pytest.mark.parametrize("prefill,decode", CASES)
@pytest.mark.parametrize("contiguous", [False, True])
def test_sdpa_matches_a_naive_loop(shape, prefill, decode, contiguous):
    rng = np.random.default_rng(1)
    gen = torch.Generator().manual_seed(2)
    q_lens, kv_lens = batch_lengths(prefill, decode)
    layout = build_layout(q_lens, kv_lens, 4, 64, contiguous, rng, CPU)
    cache = random_cache(shape, 64, 4, gen, CPU, torch.float32)
    ks = [torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=gen) for n in kv_lens]
    vs = [torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=gen) for n in kv_lens]
    scatter_sequences(cache, layout, ks, vs)
    q = torch.randn(sum(q_lens), shape.num_heads, shape.head_dim, generator=gen)
    backend = SdpaBackend(shape, CPU, torch.float32)
    out = backend.attend(q, cache.k, cache.v, backend.plan(layout))
    expected = naive_attention(q, ks, vs, q_lens, backend.scale)
    assert torch.allclose(out.double(), expected, atol=1e-5, rtol=1e-5)


def fake_flash_varlen(top_left=False):
    """FlashAttention-2's varlen semantics (cu_seqlens_k start, seqused_k length, bottom-right causal)
    as a plain loop, standing in for the CUDA kernel; `top_left` aligns the diagonal wrongly."""
    def op(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, scale=None, seqused_k=None):
        assert causal and dropout == 0.0 and max_q == int((cu_q[1:] - cu_q[:-1]).max())
        out = torch.empty_like(q)
        for i in range(len(cu_q) - 1):
            qs, qe, ks, n = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(seqused_k[i])
            assert n <= max_k and ks + n <= int(cu_k[i + 1]) <= k.shape[0]
            out[qs:qe] = naive_attention(q[qs:qe], [k[ks: ks + n]], [v[ks: ks + n]], [qe - qs], scale, top_left)
        return out, None, None, None, None
    return op


def test_torch_backend_metadata_passes_the_check_with_the_kernel_semantics():
    backend = TorchFlashBackend(TINY, CPU, torch.float32)
    backend._op = fake_flash_varlen()
    assert check_backend(backend, np.random.default_rng(0)) < 1e-4


def test_the_check_catches_a_top_left_causal_diagonal():
    backend = TorchFlashBackend(TINY, CPU, torch.float32)
    backend._op = fake_flash_varlen(top_left=True)
    with pytest.raises(BackendMismatch):
        check_backend(backend, np.random.default_rng(0))


def test_make_backend_names_what_is_missing():
    with pytest.raises(ConfigError, match="one of"):
        make_backend("nope", TINY, CPU, torch.float32)
    with pytest.raises(ConfigError, match="CUDA"):
        make_backend("torch", TINY, CPU, torch.bfloat16)
    assert make_backend("sdpa", TINY, CPU, torch.bfloat16).name == "sdpa"


def test_layouts_place_tokens_on_their_pages():
    rng = np.random.default_rng(3)
    q_lens, kv_lens = batch_lengths([(5, 30)], [17, 1])
    shuffled = build_layout(q_lens, kv_lens, 16, 40, False, rng, CPU)
    flat = [p for seq in shuffled.pages for p in seq]
    assert [len(p) for p in shuffled.pages] == [3, 2, 1] and len(set(flat)) == len(flat)
    assert shuffled.positions.tolist() == [30, 31, 32, 33, 34, 16, 0]
    pages = shuffled.pages
    assert shuffled.slot_mapping.tolist()[:1] == [pages[0][1] * 16 + 14]
    assert shuffled.slot_mapping.tolist()[5:] == [pages[1][1] * 16 + 0, pages[2][0] * 16]
    assert shuffled.last_token.tolist() == [4, 5, 6]
    contiguous = build_layout(q_lens, kv_lens, 16, 40, True, rng, CPU)
    assert [list(p) for p in contiguous.pages] == [[0, 1, 2], [3, 4], [5]]
    with pytest.raises(ValueError):
        build_layout(q_lens, kv_lens, 16, 5, False, rng, CPU)


def test_the_layer_writes_the_new_kv_into_its_slots_and_nowhere_else():
    rng = np.random.default_rng(4)
    gen = torch.Generator().manual_seed(5)
    dtype = torch.float32
    prefill, decode = [(6, 10), (3, 0)], [20, 5]
    q_lens, kv_lens = batch_lengths(prefill, decode)
    layout = build_layout(q_lens, kv_lens, 8, 32, False, rng, CPU)
    weights = random_weights(TINY, gen, CPU, dtype)
    cache = random_cache(TINY, 32, 8, gen, CPU, dtype)
    before_k, before_v = cache.k.clone(), cache.v.clone()
    rope = rope_table(TINY, 64, CPU)
    x = torch.randn(layout.num_tokens, TINY.hidden, generator=gen)
    backend = SdpaBackend(TINY, CPU, dtype)
    out = decoder_layer(TINY, x, weights, cache, layout, backend, backend.plan(layout), rope)
    assert out.shape == x.shape and torch.isfinite(out).all() and not torch.allclose(out, x)
    _, k, v = qkv_projection(TINY, x, weights, layout.positions, rope)
    written = set()
    row = 0
    for pages, q, n in zip(layout.pages, q_lens, kv_lens):
        for p in range(n - q, n):
            page, offset = pages[p // 8], p % 8
            assert torch.equal(cache.k[page, offset], k[row]) and torch.equal(cache.v[page, offset], v[row])
            written.add((page, offset))
            row += 1
    untouched = torch.ones(32, 8, dtype=torch.bool)
    for page, offset in written:
        untouched[page, offset] = False
    assert torch.equal(cache.k[untouched], before_k[untouched])
    assert torch.equal(cache.v[untouched], before_v[untouched])
    assert not torch.equal(cache.k[~untouched], before_k[~untouched])


def test_derived_features_of_a_hand_example():
    prefill, decode = [(4, 10), (2, 0)], [5, 7, 100]
    assert batch_features(prefill, decode) == {
        "prefill": "4:10;2:0", "decode": "5;7;100", "num_prefill_tokens": 6, "num_decode": 3,
        "num_tokens": 9, "sum_c": 6, "sum_c2": 20, "sum_ch": 40, "attn_pairs": 53.0,
        "prefill_kv_read": 16, "decode_kv_read": 112, "max_ctx": 100, "num_seqs": 5,
    }
    assert parse_prefill("4:10;2:0") == ((4, 10), (2, 0)) and parse_decode("5;7;100") == (5, 7, 100)
    assert batch_class(prefill, decode) == "mixed"
    assert batch_class([(8, 0)], []) == "prefill" and batch_class([], [3]) == "decode"
    assert batch_class([(16, 16368)], []) == "long" and batch_class([], [16383]) == "decode"


@pytest.mark.parametrize("name", ["tiny", "h200-8b"])
def test_grids_respect_their_limits_and_cover_every_class(name):
    grid = named_grid(name, np.random.default_rng(0))
    assert all(b.kv_tokens <= grid.max_kv_tokens and b.max_ctx <= grid.max_context
               for b in grid.batches + grid.anchors)
    classes = {batch_class(b.prefill, b.decode) for b in grid.batches}
    assert classes == {"decode", "prefill", "mixed", "long"}
    assert any(len(b.prefill) >= 2 and not b.decode for b in grid.batches)
    assert len({b.decode for b in grid.batches if b.is_decode_only and len(set(b.decode)) > 1}) >= 2


def test_the_h200_grid_is_sized_for_the_device_time():
    config = ProfileConfig(out="unused", device="cuda", model="llama-3-8b", backend="torch", grid="h200-8b")
    order, grid, _ = plan_batches(config, np.random.default_rng(0))
    assert 600 <= len(grid.batches) <= 1000
    assert estimate_seconds(order, layer_shape("llama-3-8b"), config, replicas=4) < 480 / 3
    # with the committed held-out batches the GPU job measures beside the grid
    config = ProfileConfig(out="unused", device="cuda", model="llama-3-8b", backend="torch", grid="h200-8b",
                           batches=str(ROOT / "profiler" / "heldout" / "h200-llama-3-8b.jsonl"))
    order, _, skipped = plan_batches(config, np.random.default_rng(0))
    heldout = [b for b in order if b.source == "heldout"]
    assert skipped == 0 and len(heldout) >= 100
    assert estimate_seconds(order, layer_shape("llama-3-8b"), config, replicas=4) < 480 / 3


def test_budget_and_tile_edge_batches():
    rng = np.random.default_rng(0)
    budget = budget_batches(rng, [256, 512], [16, 300], [0, 100], 50, 40_000, 4096)
    assert sorted(b.num_tokens for b in budget) == [256] * 3 + [512] * 4  # 300 decodes exceed the 256 budget
    assert {batch_class(b.prefill, b.decode) for b in budget} == {"prefill", "mixed"}
    assert [len(b.decode) for b in budget if b.num_tokens == 512 and b.decode] == [16, 300]
    edges = tile_edge_batches(rng, [128, 256], (0, 8), 1024, 32, 100, 10_000, 4096)
    assert sorted(b.num_tokens for b in edges) == [128, 128, 136, 136, 256, 256, 264, 264]
    assert all(b.prefill[0][1] == 1024 and len(b.decode) in (0, 32) for b in edges)
    tight = budget_batches(rng, [512], [16], [4000], 50, 10_000, 4096)  # h + c beyond the context limit
    assert tight == []


def test_the_h200_grid_probes_budgets_and_tile_steps():
    grid = named_grid("h200-8b", np.random.default_rng(0))
    tokens = {}
    for b in grid.batches:
        tokens.setdefault(b.num_tokens, set()).add(batch_class(b.prefill, b.decode))
    for budget in (256, 512, 1024, 2048, 4096, 8192):
        assert {"prefill", "mixed"} <= tokens[budget], budget
    assert TILE_MULTIPLES[0] == 128 and all(m % 128 == 0 for m in TILE_MULTIPLES)
    for m in TILE_MULTIPLES:  # the bottom of each step and just past it, pure prefill and mixed
        assert {"prefill", "mixed"} <= tokens[m] | tokens.get(m + 8, set()) and len(tokens[m + 8]) >= 1


def test_run_order_spreads_anchors_and_heldout_through_the_grid():
    grid = named_grid("tiny", np.random.default_rng(0))
    heldout = random_batches(np.random.default_rng(1), 4, 5000, 1024, source="heldout")
    order = run_order(grid, heldout, np.random.default_rng(2))
    assert len(order) == len(grid.batches) + len(grid.anchors) * grid.anchor_repeats + 4
    first_half = [b.source for b in order[: len(order) // 2]]
    assert {"grid", "anchor", "heldout"} <= set(first_half)


def test_heldout_files_round_trip_and_bad_lines_name_file_and_line(tmp_path):
    path = tmp_path / "shapes.jsonl"
    batches = [make_batch([(3, 4)], [9], "heldout"), make_batch(decode=[1, 2], source="heldout")]
    write_batches(path, batches)
    assert read_batches(path) == batches
    path.write_text('{"prefill": [[3, 4]], "decode": []}\n{"prefill": [[0, 4]]}\n')
    with pytest.raises(ConfigError, match=r"shapes.jsonl: line 2"):
        read_batches(path)


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        return header, [dict(zip(header, row)) for row in reader]


def test_the_tiny_pipeline_end_to_end_through_the_cli(tmp_path):
    import typer
    from typer.testing import CliRunner

    from cbsim.cli.profile import register

    app = typer.Typer()
    register(app)
    app.command("other")(lambda: None)  # two commands, so `profile` is a subcommand as in the main CLI
    shapes = tmp_path / "heldout.jsonl"
    write_batches(shapes, [make_batch([(40, 100)], [30] * 3, "heldout"), make_batch(decode=[99], source="heldout")])
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["profile", "--device", "cpu", "--model", "tiny", "--backend", "sdpa",
                                      "--grid", "tiny", "--out", str(out), "--batches", str(shapes),
                                      "--threads", "1"])
    assert result.exit_code == 0, result.output
    header, rows = read_csv(out / "measurements.csv")
    assert tuple(header) == COLUMNS
    grid = named_grid("tiny", np.random.default_rng(0))
    assert len(rows) == len(grid.batches) + len(grid.anchors) * grid.anchor_repeats + 2
    assert {r["source"] for r in rows} == {"grid", "anchor", "heldout"}
    assert {r["cls"] for r in rows} == {"decode", "prefill", "mixed", "long"}
    for r in rows:
        prefill, decode = parse_prefill(r["prefill"]), parse_decode(r["decode"])
        for key, value in batch_features(prefill, decode).items():
            assert r[key] == str(value), (key, r)
        assert r["cls"] == batch_class(prefill, decode)
        assert 0 < float(r["layer_s_p10"]) <= float(r["layer_s_median"]) <= float(r["layer_s_p90"])
        assert float(r["lm_head_s"]) > 0 and r["graph"] == "0" and r["repeats"] == "10"
        assert float(r["flops"]) > 0 and float(r["bytes"]) > 0 and r["flagged"] in ("0", "1")
    meta = json.loads((out / "metadata.json").read_text())
    for key in ("started", "finished", "environment", "backend", "model", "dtype", "page_size", "replicas",
                "warmup", "repeats", "graphs", "git_revision", "seed", "grid", "ceilings"):
        assert key in meta, key
    assert meta["environment"]["torch"] == torch.__version__ and meta["backend"]["name"] == "sdpa"
    assert meta["model"]["hidden"] == 256 and meta["stop_reason"] == "done" and meta["rows"] == len(rows)
    _, plans = read_csv(out / "overhead.csv")
    assert len(plans) == len(rows)


def test_the_cli_reports_config_errors(tmp_path):
    import typer
    from typer.testing import CliRunner

    from cbsim.cli.profile import register

    app = typer.Typer()
    register(app)
    app.command("other")(lambda: None)
    result = CliRunner().invoke(app, ["profile", "--out", str(tmp_path), "--repeats", "3"])
    assert result.exit_code == 2 and "repeats" in result.output


def test_a_run_stopped_by_max_seconds_keeps_the_rows_it_flushed(tmp_path):
    csv_path = tmp_path / "measurements.csv"

    def rows_on_disk():  # the clock reads the file: time passes only with rows already on disk
        return float(len(read_csv(csv_path)[1])) if csv_path.exists() else 0.0

    config = ProfileConfig(out=str(tmp_path), max_seconds=5, threads=1)
    result = run_profile(config, clock=rows_on_disk)
    assert result.stop_reason == "max_seconds" and result.batches_measured == 5
    header, rows = read_csv(csv_path)
    assert tuple(header) == COLUMNS and [r["batch_id"] for r in rows] == ["0", "1", "2", "3", "4"]
    meta = json.loads((tmp_path / "metadata.json").read_text())
    assert meta["stop_reason"] == "max_seconds" and meta["rows"] == 5 and "finished" in meta


def test_the_gpu_job_runs_its_cpu_equivalent(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "profiler/gpu_job.sh", "--cpu", "--seconds", "10"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header, rows = read_csv(tmp_path / "measurements.csv")
    assert tuple(header) == COLUMNS and rows
    meta = json.loads((tmp_path / "metadata.json").read_text())
    assert meta["stop_reason"] in ("done", "max_seconds") and meta["rows"] == len(rows)
    assert meta["batches_file"] == str(tmp_path / "heldout.jsonl") and read_batches(meta["batches_file"])
    assert "rows from" in (tmp_path / "job.log").read_text()


def test_importing_the_package_and_torch_free_modules_does_not_import_torch():
    code = ("import sys, cbsim.profiler, cbsim.profiler.grid, cbsim.profiler.measurements, "
            "cbsim.cli.profile; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
