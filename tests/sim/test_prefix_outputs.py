"""Output blocks in the prefix cache (sim/kv/prefix.py): a request whose `output_hashes` continue its chain
caches the full blocks its output completes, as vLLM V1 caches every full block a request computes, so a
later prompt that repeats the output hits them; without them only prompt blocks are cached."""
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.sim.kv.prefix import PrefixCache
from cbsim.sim.request import Request
from cbsim.workloads.prefixes import content_id, hash_chain

from test_prefix import run_prefix

SARATHI = {"name": "sarathi", "token_budget": 512, "max_num_seqs": 8}


def turns(prompt: int, output: int, added: int, with_outputs: bool) -> list[Request]:
    """An agent's two turns: the second's prompt is the first's prompt + output + `added` tokens, one
    content id per 16-token block of the context (as workloads/agentic.py names them)."""
    context = hash_chain(content_id(4, 0, j) for j in range((prompt + output + added) // 16))
    first = Request(0, 0.0, prompt, output, prefix_hashes=context[:prompt // 16],
                    output_hashes=context[prompt // 16:(prompt + output) // 16] if with_outputs else None)
    second = Request(1, 1000.0, prompt + output + added, 4, prefix_hashes=context)
    return [first, second]


def test_the_next_turn_hits_the_blocks_of_the_previous_output():
    """40 prompt + 30 output tokens compute 69: four full blocks, two of them completed by the output. The
    next turn (80 tokens) hits all four with output_hashes, the two prompt blocks without."""
    hits = {}
    for with_outputs in (True, False):
        run = run_prefix(SARATHI, turns(40, 30, 10, with_outputs))
        hits[with_outputs] = run.caches[0].prefix.hit_tokens[1]
    assert hits == {True: 64, False: 32}


def test_a_block_the_last_output_token_would_fill_is_not_cached():
    """vLLM never computes the last sampled token: 32 prompt + 17 output tokens compute 48, three blocks."""
    run = run_prefix(SARATHI, turns(32, 17, 40, True))
    assert run.caches[0].prefix.hit_tokens[1] == 48


@settings(max_examples=60, deadline=None)
@given(prompt=st.integers(1, 100), output=st.integers(1, 60), computed=st.integers(0, 200),
       generated=st.integers(0, 60))
def test_publish_covers_full_blocks_of_sampled_tokens_only(prompt, output, computed, generated):
    """Draft tokens beyond the sampled ones (speculative steps) are never cached: vLLM caps what it caches
    at request.num_tokens (kv_cache_manager.py allocate_slots)."""
    generated = min(generated, output)
    chain = hash_chain(content_id(4, 1, j) for j in range((prompt + output) // 16))
    req = Request(0, 0.0, prompt, output, prefix_hashes=chain[:prompt // 16],
                  output_hashes=chain[prompt // 16:] or None)
    req.num_output_tokens = generated
    cache = PrefixCache(16, 16)
    cache.publish(req, computed)
    assert len(cache.held(req)) == min(computed, prompt + generated) // 16


def test_output_hashes_that_do_not_follow_the_prompt_chain_are_ignored():
    """A chain that stops short of the prompt's full blocks (a system prompt only) cannot go on with outputs."""
    chain = hash_chain(content_id(1, 0, j) for j in range(2))
    req = Request(0, 0.0, 64, 64, prefix_hashes=chain, output_hashes=(11, 12, 13))
    assert PrefixCache(16, 16).num_units(req) == 2


def test_fast_forward_caches_output_blocks_as_stepping_does():
    """Decode runs publish the output blocks at their end (sim/step_apply.py commit_run): the hits and the
    times are those of stepping one by one. Six agents of three turns 200 s apart (id 6t + a), each turn's
    prompt its history + 20 tokens."""
    def requests():
        out, contexts = [], [30 + 7 * agent for agent in range(6)]
        for turn in range(3):
            for agent in range(6):
                context, output = contexts[agent], 25 + 11 * ((agent + turn) % 4)
                chain = hash_chain(content_id(4, agent, j) for j in range((context + output) // 16))
                out.append(Request(len(out), 200.0 * turn + agent, context, output,
                                   prefix_hashes=chain[:context // 16], output_hashes=chain[context // 16:] or None))
                contexts[agent] = context + output + 20
        return out

    reqs = requests()
    for blocks, later_turns_hitting_outputs in ((60, 11), (200, 12)):  # 60: one history is evicted
        runs = [run_prefix(SARATHI, requests(), num_blocks=blocks, fast_forward=ff) for ff in (False, True)]
        stepped, leapt = (run.caches[0].prefix for run in runs)
        assert stepped.hit_tokens == leapt.hit_tokens
        assert [r.completion_time for r in runs[0].requests] == [r.completion_time for r in runs[1].requests]
        beyond = [r.id for r in reqs[6:] if stepped.hit_tokens[r.id] > reqs[r.id - 6].prompt_len // 16 * 16]
        assert len(beyond) == later_turns_hitting_outputs


def test_a_lookup_without_a_limit_stops_at_the_prompt():
    """Routers and a P/D decode replica ask how much of the prompt is cached: never output units."""
    chain = hash_chain(content_id(4, 2, j) for j in range(5))
    req = Request(0, 0.0, 32, 50, prefix_hashes=chain[:2], output_hashes=chain[2:])
    req.num_output_tokens = 50
    cache = PrefixCache(16, 16)
    cache.publish(req, 81)
    assert len(cache.held(req)) == 5 and len(cache.lookup(req)) == 2 and len(cache.lookup(req, 5)) == 5
