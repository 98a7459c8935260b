"""Attention time of one layer for the `vidur` cost model: published tables, or a calibrated roofline.

Both kinds answer the same three questions, in seconds for one layer on one GPU (TP shard):
  decode(B, Kd)        B decode rows whose contexts sum to Kd, in one kernel
  decode_many(B, Kd[]) the same for a run of steps; element k equals decode(B, Kd[k]) exactly
  prefill(c, h)        one prefill chunk of c new tokens over h cached ones
A batch's prefill attention is the sum over its chunks (one varlen kernel does the chunks' work
one after another; Vidur instead folds the chunks into one equivalent chunk).

`table`: Vidur's attention.csv medians. Decode is interpolated in (batch size, mean context),
as Vidur keys it; prefill in (chunk, history) over the measured triangle c + h <= max_model_len,
growing with the causal pair count c (h + (c + 1) / 2) beyond it. `roofline`: where no table
exists, fixed + bytes / (eff_bw * HBM bandwidth) for decode and fixed + FLOPs / (eff * peak) +
per-token-per-head work for prefill, with the constants calibrated on the A100 table
(vidur_data.calibrate_roofline) and the target GPU's datasheet bandwidth and FLOP/s.
"""
from __future__ import annotations

import numpy as np

from cbsim.sim.costmodels.curves import Grid, RaggedRows, isotonic_table


def causal_pairs(c: float, h: float) -> float:
    """Query-key pairs of a chunk of c tokens after h cached ones."""
    return c * (h + (c + 1) / 2)


class TableAttention:
    __slots__ = ("spec", "_decode", "_prefill")

    def __init__(self, spec: dict, monotone: bool = True):
        self.spec = spec
        dec = spec["decode"]
        z = np.asarray(dec["ms"], dtype=np.float64) * 1e-3
        self._decode = Grid(dec["batch_size"], dec["kv"], isotonic_table(z) if monotone else z)
        pre = spec["prefill"]
        m = np.array([[np.nan if v is None else v for v in row] for row in pre["ms"]], dtype=np.float64) * 1e-3
        if monotone:
            m = isotonic_table(m)
        kv = np.asarray(pre["kv"], dtype=np.float64)
        rows = []
        for line in m:
            valid = int(np.count_nonzero(~np.isnan(line)))
            rows.append((kv[:valid], line[:valid]))
        self._prefill = RaggedRows(pre["chunk"], rows, causal_pairs)

    def decode(self, batch: int, kv_sum: int) -> float:
        if batch == 0:
            return 0.0
        return self._decode.at(batch, kv_sum / batch)

    def decode_row(self, batch: int, outer: tuple[float, float, float] | None = None):
        """kv_sum -> decode(batch, kv_sum) for one batch size (the grid's row looked up once); with `outer`
        = (k, c, d): kv_sum -> k * (c + (0.0 + decode(batch, kv_sum))) + d in one call (Grid.row)."""
        if batch == 0:
            value = 0.0 if outer is None else outer[0] * (outer[1] + (0.0 + 0.0)) + outer[2]
            return lambda kv_sum: value
        return self._decode.row(batch, per=batch, outer=outer)

    def decode_many(self, batch: int, kv_sum: np.ndarray) -> np.ndarray:
        if batch == 0:
            return np.zeros(len(kv_sum))
        return self._decode.many(batch, kv_sum / batch)

    def prefill(self, c: int, h: int) -> float:
        return self._prefill.at(c, h)


class RooflineAttention:
    __slots__ = ("spec", "_d0", "_dk", "_p0", "_pp", "_pt")

    def __init__(self, spec: dict, monotone: bool = True):
        self.spec = spec
        bw, peak = spec["hbm_bandwidth"], spec["peak_flops"]
        self._d0 = spec["decode_fixed_s"]
        self._dk = spec["kv_bytes_per_token"] / (spec["decode_bw_eff"] * bw)
        self._p0 = spec["prefill_fixed_s"]
        self._pp = spec["flops_per_pair"] / (spec["prefill_flop_eff"] * peak)
        self._pt = spec["prefill_per_token_head_s"] * spec["q_heads"]

    def decode(self, batch: int, kv_sum: int) -> float:
        if batch == 0:
            return 0.0
        return self._d0 + kv_sum * self._dk

    def decode_row(self, batch: int, outer: tuple[float, float, float] | None = None):
        """kv_sum -> decode(batch, kv_sum) for one batch size; with `outer` = (k, c, d): kv_sum -> k * (c +
        (0.0 + decode(batch, kv_sum))) + d."""
        if outer is None:
            return lambda kv_sum: self.decode(batch, kv_sum)
        k, c, d = outer
        return lambda kv_sum: k * (c + (0.0 + self.decode(batch, kv_sum))) + d

    def decode_many(self, batch: int, kv_sum: np.ndarray) -> np.ndarray:
        if batch == 0:
            return np.zeros(len(kv_sum))
        return self._d0 + kv_sum * self._dk

    def prefill(self, c: int, h: int) -> float:
        return self._p0 + causal_pairs(c, h) * self._pp + c * self._pt


def make_attention(spec: dict, monotone: bool = True):
    """The attention model a profile's `attention` section describes."""
    kinds = {"table": TableAttention, "roofline": RooflineAttention}
    if spec.get("kind") not in kinds:
        raise ValueError(f"unknown attention kind {spec.get('kind')!r}")
    return kinds[spec["kind"]](spec, monotone)
