"""KV pages of sliding-window models as vLLM's hybrid KV cache manager holds them (the sizing side).

Invariant: counts are layer-pages (one layer's K and V for `block_size` tokens, the unit vLLM's
hybrid manager allocates: a KV cache group's block table per layer pattern, every group drawing from
one pool of equal pages). A model without a window holds num_layers x ceil(n / block_size) pages
for n tokens, exactly what cbsim's KV cache charges today (ceil(n / block_size) all-layer blocks).

vLLM V1 (vllm/v1/core/single_type_kv_cache_manager.py, SlidingWindowManager): after n computed
tokens the next token sees the last `w` of them, so get_num_skipped_tokens(n) = max(0, n - w + 1)
tokens are never read again and remove_skipped_blocks frees every block entirely before them
(replaced by the null block; the block table keeps its indices). A windowed layer therefore holds

    ceil(n / bs) - floor(max(0, n - w + 1) / bs)   pages   (at most cdiv(w - 1, bs) + 1)

and a full-attention layer ceil(n / bs). The pool's sizing (vllm/v1/core/kv_cache_utils.py):
`get_max_concurrency_for_kv_cache_config` divides the pool's pages by what one request of
max_model_len may need, each group's `max_memory_usage_bytes`: a full layer cdiv(max_model_len, bs)
pages, a windowed one (SlidingWindowSpec) cdiv(min(w - 1 + max_num_batched_tokens, max_model_len),
bs) + 1 (the step's new tokens are allocated before the old blocks are freed; +1 because the window
need not start on a block boundary); "GPU KV cache size: N tokens" is that concurrency x
max_model_len. (vLLM pads groups to equal layer counts; Gemma-2, Mistral and Qwen windows need no
padding. With --disable-hybrid-kv-cache-manager windowed layers are allocated like full ones: the
capacity cbsim's cache has today.)

The simulated cache (sim/kv/cache.py) charges these pages when a `WindowPages` is given to it
(cluster.kv_cache.hybrid_kv_cache_manager, on by default as in vLLM): it counts in units of
g = gcd(full layers, windowed layers) layer-pages, vLLM's hybrid block when its groups need no
padding (Mistral-7B: g = 32, one unit is one all-layer block; Gemma-2-27B: g = 23, two units a
block), and a request holds, during a step that takes it from `computed` to `tokens` computed
tokens, the units of `pages_held(model, tokens, bs, computed)`: vLLM's allocate_slots first calls
remove_skipped_blocks(num_computed_tokens), then allocates the blocks of the step's new tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from cbsim.core.errors import ConfigError

from cbsim.sim.costmodels.catalog.specs import ModelSpec


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pages_held(model: ModelSpec, tokens: int, block_size: int, computed: int | None = None) -> int:
    """Layer-pages a request of `tokens` computed tokens holds (windowed layers freed as vLLM frees them);
    with `computed`: during the step that takes it from `computed` to `tokens` (freed for `computed`)."""
    blocks = _cdiv(tokens, block_size)
    full = model.num_layers - model.sliding_layers
    if not model.sliding_window:
        return model.num_layers * blocks
    skipped = max(0, (tokens if computed is None else computed) - model.sliding_window + 1) // block_size
    return full * blocks + model.sliding_layers * (blocks - skipped)


def bytes_held(model: ModelSpec, tokens: int, block_size: int, tp: int = 1) -> int:
    """KV bytes one GPU holds for such a request (pages x one layer's page on this GPU)."""
    page = block_size * model.kv_bytes_per_token(tp) // model.num_layers
    return pages_held(model, tokens, block_size) * page


def pages_per_request(model: ModelSpec, block_size: int, max_model_len: int, max_num_batched_tokens: int) -> int:
    """Layer-pages vLLM budgets for one request of max_model_len (max_memory_usage_bytes summed over layers)."""
    full = model.num_layers - model.sliding_layers
    pages = full * _cdiv(max_model_len, block_size)
    if model.sliding_window:
        window = min(model.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        pages += model.sliding_layers * (_cdiv(window, block_size) + 1)
    return pages


def max_concurrency(model: ModelSpec, num_blocks: int, block_size: int, max_model_len: int,
                    max_num_batched_tokens: int) -> float:
    """Requests of max_model_len the pool of `num_blocks` all-layer blocks holds at once, as vLLM counts them."""
    return num_blocks * model.num_layers / pages_per_request(model, block_size, max_model_len, max_num_batched_tokens)


def kv_cache_tokens(model: ModelSpec, num_blocks: int, block_size: int, max_model_len: int,
                    max_num_batched_tokens: int) -> int:
    """vLLM's "GPU KV cache size: N tokens": max_concurrency x max_model_len (without a window, and
    block_size dividing max_model_len: num_blocks x block_size)."""
    return int(max_concurrency(model, num_blocks, block_size, max_model_len, max_num_batched_tokens) * max_model_len)


@dataclass(frozen=True, slots=True)
class WindowPages:
    """A windowed model's pages in the simulated cache's units (g layer-pages, g = gcd(full, windowed)).

    `top` is the blocks a request has allocated (ceil of the highest token it was given room for);
    its windowed layers hold them less the blocks wholly before the window of its `computed` tokens.
    """

    window: int  # tokens the windowed layers attend to (ModelSpec.sliding_window)
    block_size: int  # tokens per page
    full: int  # full-attention layers / g
    sliding: int  # windowed layers / g
    group: int  # g: layer-pages per unit

    @classmethod
    def of(cls, model: ModelSpec, block_size: int) -> WindowPages | None:
        """The model's window in the cache's units, or None if it has none."""
        if not model.sliding_window:
            return None
        full = model.num_layers - model.sliding_layers
        g = gcd(full, model.sliding_layers)
        return cls(model.sliding_window, block_size, full // g, model.sliding_layers // g, g)

    @property
    def units_per_block(self) -> int:
        """Units in one all-layer block (num_layers / g)."""
        return self.full + self.sliding

    def skipped_blocks(self, computed: int) -> int:
        """Blocks of a windowed layer freed once `computed` tokens are computed (get_num_skipped_tokens)."""
        return max(0, computed - self.window + 1) // self.block_size

    def held(self, top: int, computed: int) -> int:
        """Units of a request with `top` blocks allocated and `computed` tokens computed."""
        return (self.full + self.sliding) * top - self.sliding * self.skipped_blocks(computed)

    def top_of(self, units: int, computed: int) -> int:
        """The `top` that `held(top, computed)` == `units` (exact)."""
        top, rest = divmod(units + self.sliding * self.skipped_blocks(computed), self.full + self.sliding)
        if rest:
            raise ValueError(f"{units} units are no whole number of blocks at {computed} computed tokens")
        return top


def cache_window(model: ModelSpec, block_size: int, hybrid: bool, prefix_caching: bool, pd: bool) -> WindowPages | None:
    """The window the simulated cache charges (cluster.kv_cache.hybrid_kv_cache_manager), or None:
    the model has none, or the key is false. Prefix caching and P/D hand-offs count whole blocks, so
    a window is refused with them (set the key false to run them as vLLM without the hybrid manager)."""
    window = WindowPages.of(model, block_size) if hybrid else None
    if window is None:
        return None
    for on, key in ((prefix_caching, "cluster.kv_cache.prefix_caching"), (pd, "cluster.mode")):
        if on:
            raise ConfigError("cluster.kv_cache.hybrid_kv_cache_manager", f"false with {key} (model {model.name} has "
                              f"a {model.sliding_window}-token sliding window; the simulated cache frees its pages "
                              "only without prefix caching and P/D)", True)
    return window
