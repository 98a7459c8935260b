"""One Llama decoder layer at per-GPU shard shapes, over a paged KV cache.

The layer is RMSNorm -> QKV GEMM -> RoPE -> KV write -> attention -> O-proj -> residual ->
RMSNorm -> gate/up GEMM -> SiLU*mul -> down GEMM -> residual; the LM head (final RMSNorm,
vocabulary GEMM, greedy sampling) is a separate function because it runs once per step.

Invariant of a batch layout: sequences come in order (prefill chunks first, then decodes).
Sequence i has q_len new tokens at positions [kv_len - q_len, kv_len); position p lives in
slot pages[i][p // page_size] * page_size + p % page_size of the cache. The layer writes the
new tokens' K and V to their slots before attention reads the sequence's pages, so attention
sees the cached history plus the chunk itself (bottom-right causal alignment).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from cbsim.core.errors import ConfigError


@dataclass(frozen=True)
class LayerShape:
    """Per-GPU shapes of one decoder layer (a tensor-parallel shard divides heads, MLP and vocab)."""

    name: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    num_layers: int
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one layer: QKV, O, gate/up, down and two norms."""
        qkv = self.hidden * (self.q_size + 2 * self.kv_size)
        mlp = 3 * self.hidden * self.intermediate
        return qkv + self.q_size * self.hidden + mlp + 2 * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K plus V bytes one token occupies in one layer's cache."""
        return 2 * self.kv_size * dtype_bytes


SHARDS: dict[str, LayerShape] = {
    s.name: s
    for s in (
        LayerShape("llama-3-8b", 4096, 32, 8, 128, 14336, 128256, 32),
        LayerShape("llama-3-70b-tp2", 8192, 32, 4, 128, 14336, 64128, 80),
        LayerShape("llama-3-70b-tp4", 8192, 16, 2, 128, 7168, 32064, 80),
        LayerShape("llama-3-70b-tp8", 8192, 8, 1, 128, 3584, 16032, 80),
        LayerShape("tiny", 256, 4, 2, 64, 512, 1000, 2),
    )
}


def layer_shape(name: str) -> LayerShape:
    """The per-GPU layer shape of a model configuration; ConfigError for an unknown name."""
    if name not in SHARDS:
        raise ConfigError("model", "one of " + ", ".join(SHARDS), name)
    return SHARDS[name]


def batch_lengths(prefill, decode) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(q_lens, kv_lens) of a batch: a chunk (c, h) is (c, h + c), a decode row ctx is (1, ctx)."""
    q_lens = tuple(int(c) for c, _ in prefill) + (1,) * len(decode)
    kv_lens = tuple(int(c) + int(h) for c, h in prefill) + tuple(int(x) for x in decode)
    return q_lens, kv_lens


def pages_needed(kv_lens, page_size: int) -> int:
    """Cache pages a batch occupies (each sequence rounds up to whole pages)."""
    return sum(-(-n // page_size) for n in kv_lens)


def layer_flops(shape: LayerShape, prefill, decode) -> float:
    """Floating-point operations of one layer: the four GEMMs plus QK^T and PV over the causal pairs."""
    tokens = sum(c for c, _ in prefill) + len(decode)
    gemm = 2 * tokens * (shape.layer_params - 2 * shape.hidden)
    pairs = sum(c * (h + (c + 1) / 2) for c, h in prefill) + sum(decode)
    return float(gemm + 4 * shape.num_heads * shape.head_dim * pairs)


def layer_bytes(shape: LayerShape, prefill, decode, dtype_bytes: int) -> float:
    """Least HBM traffic of one layer: weights once, KV read and written, GEMM activations in and out."""
    tokens = sum(c for c, _ in prefill) + len(decode)
    kv_read = sum(c + h for c, h in prefill) + sum(decode)
    per_token_kv = shape.kv_bytes_per_token(dtype_bytes)
    acts = shape.hidden * 4 + shape.q_size * 2 + 2 * shape.kv_size + 3 * shape.intermediate
    return float(shape.layer_params * dtype_bytes + (kv_read + tokens) * per_token_kv
                 + tokens * acts * dtype_bytes)


@dataclass
class PagedLayout:
    """Where every sequence of a batch lives in the paged cache (see the module invariant)."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_size: int
    pages: tuple[tuple[int, ...], ...]
    block_table: torch.Tensor  # int32 [num_seqs, max_pages], unused entries 0
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    last_token: torch.Tensor  # int64 [num_seqs]: row of each sequence's last token

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)


def build_layout(q_lens, kv_lens, page_size: int, num_pages: int, contiguous: bool,
                 rng: np.random.Generator, device) -> PagedLayout:
    """Assign cache pages to a batch: shuffled pages, or one run of consecutive pages per sequence
    in sequence order (for kernels that take a contiguous KV region per sequence)."""
    counts = [-(-n // page_size) for n in kv_lens]
    total = sum(counts)
    if total > num_pages:
        raise ValueError(f"batch needs {total} pages, the cache has {num_pages}")
    order = np.arange(total) if contiguous else rng.permutation(num_pages)[:total]
    bounds = np.concatenate(([0], np.cumsum(counts)))
    pages = tuple(tuple(int(p) for p in order[bounds[i]:bounds[i + 1]]) for i in range(len(counts)))
    table = np.zeros((len(counts), max(counts, default=1)), dtype=np.int32)
    positions, slots, last = [], [], []
    for i, (q, n) in enumerate(zip(q_lens, kv_lens)):
        table[i, :counts[i]] = pages[i]
        pos = np.arange(n - q, n)
        positions.append(pos)
        slots.append(table[i, pos // page_size].astype(np.int64) * page_size + pos % page_size)
        last.append(sum(q_lens[: i + 1]) - 1)
    return PagedLayout(
        tuple(q_lens), tuple(kv_lens), page_size, pages,
        torch.from_numpy(table).to(device),
        torch.from_numpy(np.concatenate(positions)).to(device),
        torch.from_numpy(np.concatenate(slots)).to(device),
        torch.tensor(last, dtype=torch.int64, device=device),
    )


@dataclass
class LayerWeights:
    norm1: torch.Tensor
    wqkv: torch.Tensor  # [q + 2 kv, hidden]
    wo: torch.Tensor  # [hidden, q]
    norm2: torch.Tensor
    wgu: torch.Tensor  # [2 intermediate, hidden]
    wdown: torch.Tensor  # [hidden, intermediate]


@dataclass
class KVCache:
    k: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    v: torch.Tensor


@dataclass
class LMHead:
    norm: torch.Tensor
    weight: torch.Tensor  # [vocab, hidden]


def _randn(shape, std: float, gen, device, dtype) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)


def random_weights(shape: LayerShape, gen: torch.Generator, device, dtype) -> LayerWeights:
    """Random weights scaled 1/sqrt(fan_in) so activations stay of order one."""
    h, i = shape.hidden, shape.intermediate
    norm = lambda: 1.0 + _randn((h,), 0.1, gen, device, dtype)  # noqa: E731
    return LayerWeights(
        norm(), _randn((shape.q_size + 2 * shape.kv_size, h), h ** -0.5, gen, device, dtype),
        _randn((h, shape.q_size), shape.q_size ** -0.5, gen, device, dtype),
        norm(), _randn((2 * i, h), h ** -0.5, gen, device, dtype),
        _randn((h, i), i ** -0.5, gen, device, dtype),
    )


def random_cache(shape: LayerShape, num_pages: int, page_size: int, gen, device, dtype) -> KVCache:
    """A cache filled with random K and V, so history reads see real (never zero) data."""
    dims = (num_pages, page_size, shape.num_kv_heads, shape.head_dim)
    return KVCache(_randn(dims, 1.0, gen, device, dtype), _randn(dims, 1.0, gen, device, dtype))


def random_lm_head(shape: LayerShape, gen, device, dtype) -> LMHead:
    return LMHead(1.0 + _randn((shape.hidden,), 0.1, gen, device, dtype),
                  _randn((shape.vocab, shape.hidden), shape.hidden ** -0.5, gen, device, dtype))


def rope_table(shape: LayerShape, max_pos: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, float32 [max_pos, head_dim / 2], of Llama's rotary embedding."""
    half = shape.head_dim // 2
    inv = 1.0 / (shape.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, head_dim] with cos/sin [T, 1, head_dim / 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def qkv_projection(shape: LayerShape, x, w: LayerWeights, positions, rope):
    """First half of the layer up to the KV write: normed QKV GEMM with RoPE on q and k."""
    t = x.shape[0]
    h = F.rms_norm(x, (shape.hidden,), w.norm1, shape.eps)
    q, k, v = F.linear(h, w.wqkv).split([shape.q_size, shape.kv_size, shape.kv_size], dim=-1)
    cos = rope[0].index_select(0, positions).to(x.dtype)[:, None, :]
    sin = rope[1].index_select(0, positions).to(x.dtype)[:, None, :]
    q = apply_rope(q.view(t, shape.num_heads, shape.head_dim), cos, sin)
    k = apply_rope(k.view(t, shape.num_kv_heads, shape.head_dim), cos, sin)
    return q, k, v.view(t, shape.num_kv_heads, shape.head_dim)


def write_kv(cache: KVCache, k, v, slot_mapping) -> None:
    """Store the new tokens' K and V into their cache slots."""
    cache.k.view(-1, *cache.k.shape[2:]).index_copy_(0, slot_mapping, k)
    cache.v.view(-1, *cache.v.shape[2:]).index_copy_(0, slot_mapping, v)


def decoder_layer(shape: LayerShape, x, w: LayerWeights, cache: KVCache, layout: PagedLayout,
                  backend, meta, rope) -> torch.Tensor:
    """One decoder layer over x [T, hidden]; writes the batch's K/V into `cache`; returns [T, hidden]."""
    q, k, v = qkv_projection(shape, x, w, layout.positions, rope)
    write_kv(cache, k, v, layout.slot_mapping)
    attn = backend.attend(q, cache.k, cache.v, meta)
    x = x + F.linear(attn.reshape(x.shape[0], shape.q_size), w.wo)
    h = F.rms_norm(x, (shape.hidden,), w.norm2, shape.eps)
    gate, up = F.linear(h, w.wgu).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w.wdown)


def lm_head(shape: LayerShape, hidden_last, head: LMHead) -> torch.Tensor:
    """Final RMSNorm, vocabulary GEMM and greedy sampling of one row per sequence."""
    h = F.rms_norm(hidden_last, (shape.hidden,), head.norm, shape.eps)
    return F.linear(h, head.weight).argmax(dim=-1)


def softmax_scale(shape: LayerShape) -> float:
    return 1.0 / math.sqrt(shape.head_dim)
