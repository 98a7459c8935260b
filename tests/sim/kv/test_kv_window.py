"""Sliding-window KV pages as vLLM's hybrid KV cache manager holds and budgets them (issue 11, the
sizing side): hand-computed Mistral-7B (every layer windowed) and Gemma-2-27B (every other layer),
models without a window exactly as cbsim's cache charges them, and the per-layer bound."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.sim.kv.window import bytes_held, kv_cache_tokens, max_concurrency, pages_held, pages_per_request
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.costmodels.catalog.specs import ModelSpec

MISTRAL, GEMMA, LLAMA = model_spec("mistral-7b"), model_spec("gemma-2-27b"), model_spec("llama-3.1-8b")


def test_mistral_holds_the_window_not_the_history():
    # 10,000 tokens, blocks of 16: 625 blocks; 10,000 - 4,096 + 1 = 5,905 tokens skipped = 369 whole blocks freed
    assert pages_held(MISTRAL, 10_000, 16) == 32 * (625 - 369)
    assert bytes_held(MISTRAL, 10_000, 16) == 32 * 256 * 16 * 4096  # 4 KiB per token and layer (8 KV heads x 128, bf16)
    assert pages_held(MISTRAL, 4096, 16) == 32 * 256  # the window itself: nothing freed yet
    assert pages_held(MISTRAL, 4097, 16) == 32 * 257  # one token past: 2 tokens skipped, no whole block
    # vLLM's budget per request of 32,768 tokens with 8,192 batched tokens: cdiv(4095 + 8192, 16) + 1 = 769 pages a layer
    assert pages_per_request(MISTRAL, 16, 32_768, 8192) == 32 * 769
    assert max_concurrency(MISTRAL, 10_000, 16, 32_768, 8192) == 10_000 * 32 / (32 * 769)
    assert kv_cache_tokens(MISTRAL, 10_000, 16, 32_768, 8192) == int(10_000 / 769 * 32_768)


def test_gemma_frees_only_its_windowed_half():
    assert GEMMA.sliding_layers == 23 and GEMMA.num_layers == 46
    assert pages_held(GEMMA, 8000, 16) == 23 * 500 + 23 * (500 - (8000 - 4095) // 16)
    budget = pages_per_request(GEMMA, 16, 8192, 2048)  # the window + a batch already covers max_model_len
    assert budget == 23 * 512 + 23 * (math.ceil(min(4095 + 2048, 8192) / 16) + 1)


def test_without_a_window_it_is_what_the_cache_charges_today():
    for tokens in (1, 15, 16, 17, 100_000):
        assert pages_held(LLAMA, tokens, 16) == 32 * math.ceil(tokens / 16)
        assert bytes_held(LLAMA, tokens, 16, tp=2) == math.ceil(tokens / 16) * 16 * LLAMA.kv_bytes_per_token(2)
    assert kv_cache_tokens(LLAMA, 5000, 16, 131_072, 8192) == 5000 * 16


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(1, 200_000), block=st.sampled_from([1, 16, 32, 64, 256]), window=st.integers(1, 70_000),
       sliding=st.integers(1, 8))
def test_a_windowed_layer_holds_its_window_and_no_more(tokens, block, window, sliding):
    m = ModelSpec("w", 256, 8, 4, 2, 64, 512, 1000, 300_000, sliding_window=window, sliding_layers=sliding)
    full_pages = 8 * math.ceil(tokens / block)
    held = pages_held(m, tokens, block)
    windowed = (held - (8 - sliding) * math.ceil(tokens / block)) / sliding
    assert windowed <= math.ceil((window - 1) / block) + 1 and windowed <= math.ceil(tokens / block)
    assert windowed * block >= min(tokens, window - 1)  # the tokens the next query reads are all held
    assert held <= full_pages
