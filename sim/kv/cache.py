"""Paged KV cache of one replica, counted in blocks.

Invariant: free_blocks + sum of blocks held by requests == num_blocks, and free_blocks >= 0.
Requests hold whole blocks: ceil(tokens / block_size) (a window: below). The watermark is kept free when a new
request is admitted (not when a running one grows), so admissions cannot immediately force
preemptions. Swapped-out KV lives on the host, unbounded, and is counted separately (with lower KV tiers,
sim/kv/tiers.py, in the cpu tier's room).

With prefix caching (`prefix_caching=True`, see prefix_cache.py) full prompt blocks outlive their
request in a radix tree, shared by reference. Blocks are then free, held, or evictable (cached,
referenced by no request); `available_blocks` = free + evictable is what admission may use, and
`grow` evicts least recently used cached blocks when the free ones run out. A request's
`num_blocks` counts every block it holds, shared ones included; the blocks of a node are counted
once, however many requests share it. So: free + held (requests' own blocks + referenced nodes)
+ evictable == num_blocks, and `used_blocks` (num_blocks - free) counts held and cached blocks.
Eviction happens only inside `grow`, so a run of decode steps that fits in the free blocks
(the replica's fast-forward horizon) leaves the cache, and every admission decision, unchanged.

Sliding-window models (`window`, a profiler.kv_window.WindowPages; cluster.kv_cache.
hybrid_kv_cache_manager): every count (num_blocks, free, watermark, a request's num_blocks, the
step table's kv_blocks_used) is in units of g layer-pages, g = gcd(full, windowed layers): vLLM's
hybrid block; num_blocks = all-layer blocks x num_layers / g. A request holds, during a step that
takes it from c to n computed tokens, `window.held(top, c)` units: `top` = the most blocks it was
ever given room for (ceil(n / block_size), or more for a reservation), less, on windowed layers,
the blocks wholly before the window of its c tokens (vLLM frees them before allocating the step's
new ones). So a request's units SHRINK while it runs: `resize` grows or shrinks them at the step's
start, and the invariant above holds with held counted that way. `blocks_for` (admission tests,
reserves) counts all layers with nothing freed: what a request alone may need in one step (a whole
prompt), so a request that fits_ever can always run. No prefix caching or P/D with a window.

P/D decode side (sim/pd.py): a request whose KV is on its way holds, from its reservation, the
cached units of its prompt that are already here (`claim_cached`) while a holder request keeps
room for the rest; at landing (`receive`) that room becomes the request's own blocks and its
prompt units are cached. A request holds blocks in one cache at a time: `receive` needs it to
have let go of the prefill replica's blocks first.
"""
from __future__ import annotations

from cbsim.sim.kv.window import WindowPages

from cbsim.sim.kv.prefix import PrefixCache
from cbsim.sim.request import Request


class KVCacheError(RuntimeError):
    """An allocation that the plan promised would fit did not: a scheduler bug."""


class KVCache:
    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int = 0,
                 reserve_full_prompt: bool = False, bytes_per_token: float = 0.0,
                 prefix_caching: bool = False, hash_block_size: int | None = None,
                 window: WindowPages | None = None, check_full_input: bool = False):
        """`num_blocks` and `watermark_blocks` in the cache's units (all-layer blocks; with `window`,
        g layer-pages); `bytes_per_token` across all layers. `check_full_input`: an admission needs its
        whole input's blocks free but takes only its chunk's (policies/batch.py BatchBuilder._input_gap)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if window is not None and (prefix_caching or window.block_size != block_size):
            raise ValueError("a window needs the cache's block_size and no prefix caching")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self.reserve_full_prompt = reserve_full_prompt
        self.check_full_input = check_full_input
        self.bytes_per_token = bytes_per_token
        self.free_blocks = num_blocks
        self.host_blocks = 0
        self.prefix = PrefixCache(block_size, hash_block_size or block_size) if prefix_caching else None
        self.evicted_in_step = False  # grow evicted since the replica last cleared it (no fast-forward then)
        self.window = window  # None: every layer holds every block (the hot paths assume it)
        self.units_per_block = window.units_per_block if window is not None else 1
        self._top: dict[int, int] = {}  # window only: request id -> blocks it has room for (WindowPages.held)
        if window is not None:
            self.blocks_for = self._units_for

    @property
    def used_blocks(self) -> int:
        """Blocks not free: held by requests, or cached (evictable) with prefix caching."""
        return self.num_blocks - self.free_blocks

    @property
    def evictable_blocks(self) -> int:
        return self.prefix.evictable_blocks if self.prefix is not None else 0

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation may take: free + evictable."""
        return self.free_blocks + self.prefix.evictable_blocks if self.prefix is not None else self.free_blocks

    @property
    def block_bytes(self) -> float:
        """Bytes of one unit (a block; with a window, g layer-pages)."""
        return self.unit_tokens * self.bytes_per_token

    @property
    def unit_tokens(self) -> float:
        """Tokens (on every layer) one unit holds: block_size; with a window, block_size / units per block."""
        return self.block_size / self.units_per_block if self.window is not None else self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks of `tokens` tokens (with a window, `_units_for`, bound in __init__)."""
        return -(-tokens // self.block_size)

    def _units_for(self, tokens: int) -> int:
        """Units of `tokens` tokens on every layer, nothing freed (blocks x num_layers / g)."""
        return -(-tokens // self.block_size) * self.units_per_block

    # -- sliding window (only with self.window) --------------------------------------------
    def held_for(self, req: Request, computed: int, tokens: int) -> int:
        """Units `req` holds during a step from `computed` to `tokens` computed tokens (or room for
        `tokens`, a reservation): its top grows to cover `tokens`, its window's old blocks are freed."""
        top = max(self._top.get(req.id, 0), -(-tokens // self.block_size))
        return self.window.held(top, computed)

    def resize(self, req: Request, target: int) -> None:
        """Give `req` exactly `target` units (from held_for at its current progress), growing or
        shrinking; called at the step's start, in plan order (the builder counted frees the same way)."""
        extra = target - req.num_blocks
        if extra > self.free_blocks:
            raise KVCacheError(f"request {req.id} needs {extra} blocks, {self.free_blocks} free")
        self.free_blocks -= extra
        req.num_blocks = target
        self._top[req.id] = self.window.top_of(target, req.num_computed_tokens)

    def admission_tokens(self, req: Request, tokens: int, reserve_tokens: int = 0) -> int:
        """Tokens of KV room an admission of `req` takes, `tokens` being its progress after the step: those,
        or the policy's reservation `reserve_tokens` (Orca's prompt + max output) if larger, and with
        reserve_full_prompt at least its whole known input (prompt and outputs so far), as Vidur's
        schedulers and a P/D prefill replica reserve it. The one copy of the rule (BatchBuilder.admit,
        prompt runs)."""
        tokens = max(tokens, reserve_tokens)
        return max(tokens, req.num_tokens) if self.reserve_full_prompt else tokens

    def trim(self, req: Request, target_blocks: int) -> None:
        """Free `req`'s blocks beyond `target_blocks` at a step's end: the lookahead slots of rejected
        draft tokens (speculative decoding). Its prompt blocks are never beyond it, so a prefix cache's
        shared blocks stay; a sliding window resizes at the next step's start instead."""
        extra = req.num_blocks - target_blocks
        if extra > 0 and self.window is None:
            self.free_blocks += extra
            req.num_blocks = target_blocks

    def fits_ever(self, tokens: int) -> bool:
        """Whether a request holding `tokens` tokens could run alone on an empty cache."""
        return self.blocks_for(tokens) <= self.num_blocks - self.watermark_blocks

    def grow(self, req: Request, target_blocks: int) -> None:
        """Give `req` at least `target_blocks` blocks (called at a step's start)."""
        extra = target_blocks - req.num_blocks
        if extra <= 0:
            return
        if extra > self.free_blocks and self.prefix is not None:
            self.free_blocks += self.prefix.evict(extra - self.free_blocks)
            self.evicted_in_step = True
        if extra > self.free_blocks:
            raise KVCacheError(f"request {req.id} needs {extra} blocks, {self.free_blocks} free")
        self.free_blocks -= extra
        req.num_blocks = target_blocks

    def release(self, req: Request) -> None:
        """Free every GPU block of `req` (finish, reject or preemption); with prefix caching its
        cached prompt blocks stay, unreferenced by it (evictable once nobody holds them)."""
        if self.prefix is not None:
            self.free_blocks += req.num_blocks - self.prefix.shared_blocks(req)
            self.prefix.release(req)
        else:
            self.free_blocks += req.num_blocks
            if self.window is not None:
                self._top.pop(req.id, None)
        req.num_blocks = 0

    # -- prefix caching (only with self.prefix) -------------------------------------------
    def acquire_prefix(self, req: Request) -> int:
        """At admission: `req` takes the cached prefix a plan made now would have found (see
        PrefixCache.match); its progress jumps over it. Returns the tokens hit."""
        prefix = self.prefix
        if prefix is None or not prefix.can_hit(req):
            return 0
        path = prefix.match(req)
        prefix.acquire(req, path)
        if prefix.restored_blocks:  # units back from a lower tier: allocated by `settle` after the admissions
            self.free_blocks -= prefix.restored_blocks
        req.num_blocks = len(path) * prefix.unit_blocks
        req.num_computed_tokens = len(path) * prefix.unit_tokens
        return req.num_computed_tokens

    def settle(self) -> None:
        """After a step's admissions: blocks restored from a lower tier beyond the free ones are taken by
        evicting (as `grow` would; not before, so that no admission's planned GPU hit is evicted first)."""
        if self.free_blocks < 0:
            self.free_blocks += self.prefix.evict(-self.free_blocks)
            self.evicted_in_step = True
            if self.free_blocks < 0:
                raise KVCacheError(f"restored prefix units need {-self.free_blocks} blocks more than there are")

    def publish(self, req: Request, computed_tokens: int) -> None:
        """Cache the full units of `req` (prompt, and output where its output_hashes say) that
        `computed_tokens` covers (at the start of the step that computes them; nothing can read them
        before that step ends)."""
        self.free_blocks += self.prefix.publish(req, computed_tokens)

    # -- P/D decode side (sim/pd.py) -----------------------------------------------------
    def cached_prompt(self, req: Request) -> list:
        """The cached units of `req`'s prompt found here (empty without prefix caching). Every full
        prompt unit counts, the last one too: a KV arriving from a prefill replica is complete."""
        return self.prefix.lookup(req) if self.prefix is not None else []

    def claim_cached(self, req: Request, path: list) -> None:
        """At a reservation: `req`, whose KV is still elsewhere, holds `path` (from cached_prompt) so
        that it cannot be evicted before `req` lands; these units are not transferred."""
        if path:
            self.prefix.acquire(req, path, record=False)

    def receive(self, req: Request, holder: Request, target_blocks: int) -> None:
        """At landing: the room `holder` reserved becomes `req`'s own blocks beside the units it
        claimed, `req` holds `target_blocks` in all, and its full prompt units are cached here."""
        if req.num_blocks:
            raise KVCacheError(f"request {req.id} lands holding {req.num_blocks} blocks elsewhere")
        self.release(holder)
        req.num_blocks = self.prefix.shared_blocks(req) if self.prefix is not None else 0
        self.grow(req, target_blocks)
        if self.prefix is not None:
            self.publish(req, req.prompt_len)

    # -- swap ------------------------------------------------------------------------------
    def swap_out(self, req: Request) -> float:
        """Move the request's blocks to the host; returns the bytes moved."""
        moved = req.num_blocks
        self.release(req)
        req.num_swapped_blocks = moved
        self.host_blocks += moved
        if self.prefix is not None and self.prefix.tiers is not None:  # the cpu tier holds it (sim/kv/tiers.py)
            self.prefix.tiers.reserve(moved)
        return moved * self.block_bytes

    def swap_in_bytes(self, req: Request) -> float:
        """Bytes that bring a swapped request's KV back; its blocks are granted by `grow`."""
        return req.num_swapped_blocks * self.block_bytes

    def drop_host_copy(self, req: Request) -> None:
        self.host_blocks -= req.num_swapped_blocks
        if self.prefix is not None and self.prefix.tiers is not None:
            self.prefix.tiers.unreserve(req.num_swapped_blocks)
        req.num_swapped_blocks = 0
