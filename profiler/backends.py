"""Attention backends behind one small interface, and the numerical check against the reference.

A backend turns a batch layout into its own metadata once per step (`plan`, the CPU-side work an
engine does before the forward) and then computes attention for q [T, q_heads, head_dim] over the
paged cache (`attend`), after the layer wrote the batch's new K/V. Causal masking is bottom-right
aligned: the j-th new token of a chunk with history h sees keys 0 .. h + j.

`sdpa` is the reference (CPU and GPU): it gathers each sequence's pages and calls
scaled_dot_product_attention with an explicit mask. Every other backend is compared with it by
`check_backend` before it is timed.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from cbsim.core.errors import ConfigError

from cbsim.profiler.layer import LayerShape, build_layout, random_cache, softmax_scale


class AttentionBackend:
    """Interface. Attributes say what layout the kernel needs:

    contiguous_kv: each sequence's pages must be one consecutive run (no block table);
    page_multiple: the page size must be a multiple of this;
    supports_graph: `attend` with fixed metadata can be captured in a CUDA graph;
    dtypes: the data types the kernel takes (None: any).
    """

    name = "base"
    contiguous_kv = False
    page_multiple = 1
    supports_graph = True
    dtypes: tuple | None = (torch.bfloat16, torch.float16)

    def __init__(self, shape: LayerShape, device: torch.device, dtype: torch.dtype):
        self.shape = shape
        self.device = device
        self.dtype = dtype
        self.scale = softmax_scale(shape)

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on `device` here, or None when it can."""
        return None

    def version(self) -> str:
        return torch.__version__

    def plan(self, layout):
        """Per-step metadata for `attend`; called once per batch, before the forward."""
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta) -> torch.Tensor:
        """Attention output [T, q_heads, head_dim]; called once per layer forward."""
        raise NotImplementedError


def _cu(lengths, device) -> torch.Tensor:
    return torch.tensor(np.concatenate(([0], np.cumsum(lengths))), dtype=torch.int32, device=device)


@dataclass
class _SdpaSeq:
    start: int
    q_len: int
    kv_len: int
    pages: torch.Tensor
    mask: torch.Tensor | None  # None: plain causal (q_len == kv_len) or one query


class SdpaBackend(AttentionBackend):
    """The reference: gather each sequence's pages, one scaled_dot_product_attention per sequence,
    with an explicit bottom-right mask for a chunk that has history."""

    name = "sdpa"
    dtypes = None

    def plan(self, layout):
        seqs, start = [], 0
        for i, (q, n) in enumerate(zip(layout.q_lens, layout.kv_lens)):
            pages = layout.block_table[i, : len(layout.pages[i])].long()
            mask = None
            if 1 < q < n:
                mask = torch.ones(q, n, dtype=torch.bool, device=self.device).tril(diagonal=n - q)
            seqs.append(_SdpaSeq(start, q, n, pages, mask))
            start += q
        return seqs

    def attend(self, q, k_cache, v_cache, meta):
        out = torch.empty_like(q)
        for s in meta:
            k = k_cache.index_select(0, s.pages).flatten(0, 1)[: s.kv_len].transpose(0, 1)
            v = v_cache.index_select(0, s.pages).flatten(0, 1)[: s.kv_len].transpose(0, 1)
            qi = q[s.start: s.start + s.q_len].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qi[None], k[None], v[None], attn_mask=s.mask,
                is_causal=s.mask is None and s.q_len > 1, scale=self.scale, enable_gqa=True)
            out[s.start: s.start + s.q_len] = o[0].transpose(0, 1)
        return out


@dataclass
class _VarlenMeta:
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    seqused_k: torch.Tensor | None = None
    block_table: torch.Tensor | None = None


class TorchFlashBackend(AttentionBackend):
    """PyTorch's built-in FlashAttention-2 varlen op; each sequence's KV is one contiguous region
    of the flattened cache, starting at cu_k[i], of length seqused_k[i]."""

    name = "torch"
    contiguous_kv = True

    def __init__(self, shape, device, dtype):
        super().__init__(shape, device, dtype)
        self._op = torch.ops.aten._flash_attention_forward

    @classmethod
    def unavailable(cls, device):
        return None if device.type == "cuda" else "a CUDA device (use sdpa on the CPU)"

    def plan(self, layout):
        starts = [p[0] * layout.page_size for p in layout.pages]
        for i in range(1, len(starts)):
            if starts[i] < starts[i - 1] + layout.kv_lens[i - 1]:
                raise ValueError("the 'torch' backend needs ordered contiguous regions per sequence")
        bounds = starts + [starts[-1] + len(layout.pages[-1]) * layout.page_size]
        return _VarlenMeta(
            _cu(layout.q_lens, self.device), torch.tensor(bounds, dtype=torch.int32, device=self.device),
            max(layout.q_lens), max(layout.kv_lens),
            seqused_k=torch.tensor(layout.kv_lens, dtype=torch.int32, device=self.device))

    def attend(self, q, k_cache, v_cache, meta):
        k = k_cache.view(-1, *k_cache.shape[2:])
        v = v_cache.view(-1, *v_cache.shape[2:])
        return self._op(
            q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, 0.0, True, False,
            scale=self.scale, seqused_k=meta.seqused_k)[0]


class FlashAttnBackend(AttentionBackend):
    """flash_attn_varlen_func with a block table (FlashAttention-2 wants pages of 256 multiples)."""

    name = "flash_attn"
    page_multiple = 256

    def __init__(self, shape, device, dtype):
        super().__init__(shape, device, dtype)
        import flash_attn
        from flash_attn import flash_attn_varlen_func

        self._fn = flash_attn_varlen_func
        self._version = flash_attn.__version__

    @classmethod
    def unavailable(cls, device):
        return _missing("flash_attn", device)

    def version(self) -> str:
        return self._version

    def plan(self, layout):
        return _VarlenMeta(_cu(layout.q_lens, self.device), _cu(layout.kv_lens, self.device),
                           max(layout.q_lens), max(layout.kv_lens), block_table=layout.block_table)

    def attend(self, q, k_cache, v_cache, meta):
        return self._fn(q, k_cache, v_cache, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k,
                        softmax_scale=self.scale, causal=True, block_table=meta.block_table)


class FlashInferBackend(AttentionBackend):
    """FlashInfer's paged prefill wrapper (NHD layout); `plan` is its CPU-side scheduling."""

    name = "flashinfer"
    supports_graph = False  # graph capture needs the wrapper's fixed-buffer mode

    def __init__(self, shape, device, dtype):
        super().__init__(shape, device, dtype)
        import flashinfer

        self._version = flashinfer.__version__
        workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    @classmethod
    def unavailable(cls, device):
        return _missing("flashinfer", device)

    def version(self) -> str:
        return self._version

    def plan(self, layout):
        counts = [len(p) for p in layout.pages]
        indices = torch.tensor([p for seq in layout.pages for p in seq], dtype=torch.int32, device=self.device)
        last = [n - (c - 1) * layout.page_size for n, c in zip(layout.kv_lens, counts)]
        self._wrapper.plan(
            _cu(layout.q_lens, self.device), _cu(counts, self.device), indices,
            torch.tensor(last, dtype=torch.int32, device=self.device),
            self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim, layout.page_size,
            causal=True, sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        return self._wrapper

    def attend(self, q, k_cache, v_cache, meta):
        return meta.run(q, (k_cache, v_cache))


def _missing(module: str, device: torch.device) -> str | None:
    if device.type != "cuda":
        return "a CUDA device (use sdpa on the CPU)"
    return None if importlib.util.find_spec(module) else f"the {module} package installed"


BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (SdpaBackend, TorchFlashBackend, FlashAttnBackend, FlashInferBackend)
}


def make_backend(name: str, shape: LayerShape, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend called `name`; ConfigError when unknown or unavailable on this machine."""
    if name not in BACKENDS:
        raise ConfigError("backend", "one of " + ", ".join(BACKENDS), name)
    cls = BACKENDS[name]
    reason = cls.unavailable(device)
    if reason:
        raise ConfigError("backend", f"{reason} for {name!r}", name)
    if cls.dtypes is not None and dtype not in cls.dtypes:
        raise ConfigError("dtype", f"bfloat16 or float16 for the {name!r} backend", str(dtype))
    return cls(shape, device, dtype)


class BackendMismatch(RuntimeError):
    """A backend's attention differs from the sdpa reference beyond the tolerance."""


CHECK_BATCHES = (  # (prefill chunks (c, h), decode contexts): chunks with history, GQA, mixes
    ((), (1, 17, 300)),
    (((37, 0),), ()),
    (((16, 500), (100, 3)), ()),
    (((64, 700), (1, 40)), (33, 1024, 5)),
    (((300, 1200),), (2000,) * 3),
)

TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def check_backend(backend: AttentionBackend, rng: np.random.Generator, batches=CHECK_BATCHES,
                  page_size: int | None = None) -> float:
    """Compare `backend` with sdpa in float32 on random batches; return the largest error
    |out - ref| / (1 + |ref|). Raises BackendMismatch above the tolerance of the backend's dtype."""
    shape, device, dtype = backend.shape, backend.device, backend.dtype
    page = page_size or max(16, backend.page_multiple)
    gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**62)))
    reference = SdpaBackend(shape, device, torch.float32)
    worst = 0.0
    for prefill, decode in batches:
        q_lens = tuple(c for c, _ in prefill) + (1,) * len(decode)
        kv_lens = tuple(c + h for c, h in prefill) + tuple(decode)
        num_pages = sum(-(-n // page) for n in kv_lens) + 3
        cache = random_cache(shape, num_pages, page, gen, device, dtype)
        layout = build_layout(q_lens, kv_lens, page, num_pages, backend.contiguous_kv, rng, device)
        q = torch.randn((sum(q_lens), shape.num_heads, shape.head_dim), generator=gen,
                        device=device).to(dtype)
        out = backend.attend(q, cache.k, cache.v, backend.plan(layout)).float()
        ref = reference.attend(q.float(), cache.k.float(), cache.v.float(), reference.plan(layout))
        err = float(((out - ref).abs() / (1 + ref.abs())).max())
        worst = err if math.isnan(err) else max(worst, err)
        if math.isnan(worst):
            break
    if not worst <= TOLERANCE[dtype]:
        raise BackendMismatch(f"backend {backend.name} differs from sdpa by {worst:.3g} "
                              f"(tolerance {TOLERANCE[dtype]:.3g} for {dtype})")
    return worst
