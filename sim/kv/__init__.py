"""The KV cache of a replica: paged blocks (cache.py), prefix caching (prefix.py), sliding-window
pages as vLLM's hybrid KV manager holds them (window.py) and the KV link of P/D hand-offs (link.py)."""
