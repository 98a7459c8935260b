"""The event loop and the data it moves: requests, step plans and shapes, the KV cache, replicas."""
