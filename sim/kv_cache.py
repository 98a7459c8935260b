"""Paged KV cache of one replica, counted in blocks.

Invariant: free_blocks + sum of blocks held by requests == num_blocks, and free_blocks >= 0.
Requests hold whole blocks: ceil(tokens / block_size). The watermark is kept free when a new
request is admitted (not when a running one grows), so admissions cannot immediately force
preemptions. Swapped-out KV lives on the host, unbounded, and is counted separately.
"""
from __future__ import annotations

from .request import Request


class KVCacheError(RuntimeError):
    """An allocation that the plan promised would fit did not: a scheduler bug."""


class KVCache:
    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int = 0,
                 reserve_full_prompt: bool = False, bytes_per_token: float = 0.0):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self.reserve_full_prompt = reserve_full_prompt
        self.bytes_per_token = bytes_per_token
        self.free_blocks = num_blocks
        self.host_blocks = 0

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def block_bytes(self) -> float:
        return self.block_size * self.bytes_per_token

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def fits_ever(self, tokens: int) -> bool:
        """Whether a request holding `tokens` tokens could run alone on an empty cache."""
        return self.blocks_for(tokens) <= self.num_blocks - self.watermark_blocks

    def grow(self, req: Request, target_blocks: int) -> None:
        """Give `req` at least `target_blocks` blocks (called at a step's start)."""
        extra = target_blocks - req.num_blocks
        if extra <= 0:
            return
        if extra > self.free_blocks:
            raise KVCacheError(f"request {req.id} needs {extra} blocks, {self.free_blocks} free")
        self.free_blocks -= extra
        req.num_blocks = target_blocks

    def release(self, req: Request) -> None:
        """Free every GPU block of `req` (finish, reject or recompute preemption)."""
        self.free_blocks += req.num_blocks
        req.num_blocks = 0

    def swap_out(self, req: Request) -> float:
        """Move the request's blocks to the host; returns the bytes moved."""
        moved = req.num_blocks
        self.release(req)
        req.num_swapped_blocks = moved
        self.host_blocks += moved
        return moved * self.block_bytes

    def swap_in_bytes(self, req: Request) -> float:
        """Bytes that bring a swapped request's KV back; its blocks are granted by `grow`."""
        return req.num_swapped_blocks * self.block_bytes

    def drop_host_copy(self, req: Request) -> None:
        self.host_blocks -= req.num_swapped_blocks
        req.num_swapped_blocks = 0
