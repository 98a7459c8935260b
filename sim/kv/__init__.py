"""The KV cache of a replica: paged blocks (cache.py), prefix caching (prefix.py), sliding-window
pages as vLLM's hybrid KV manager holds them (window.py), the KV link of P/D hand-offs (link.py), and the
lower tiers behind the prefix cache (tiers.py) with their transfers (tier_traffic.py)."""
