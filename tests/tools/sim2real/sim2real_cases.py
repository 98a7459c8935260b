"""Small streams on which vLLM 0.32's scheduler differs from cbsim's V1 model before server.version 0.32
(tests/test_sim2real_v032.py pins cbsim on them, tests/test_sim2real_parity.py holds vLLM to the same)."""
from cbsim.tools.sim2real.streams import Limits, Stream, StreamRequest


def stream(limits: Limits, requests) -> Stream:
    """(arrival, prompt_len, output_len) requests with prompts that share nothing."""
    return Stream(0, limits, tuple(StreamRequest(a, tuple(range(3 + 1000 * i, 3 + 1000 * i + p)), o)
                                   for i, (a, p, o) in enumerate(requests)))


# request 1's first chunk fits beside request 0, its whole 400 tokens (25 blocks) do not (30 usable)
FULL_INPUT = stream(Limits(128, 4, 0, 31, enable_prefix_caching=False), [(0, 100, 5), (0, 400, 5)])
# request 0's prompt, ahead of request 1's decodes in admission order, grows and preempts request 1
ADMISSION_ORDER = stream(Limits(2048, 2, 48, 17, enable_prefix_caching=False), [(0, 206, 9), (0, 99, 23)])
# one request alone: long_prefill_token_threshold 48 does not cap it
LONE = stream(Limits(512, 4, 48, 100, enable_prefix_caching=False), [(0, 400, 2)])

# what vLLM 0.32 schedules in the first steps (request -> tokens) and preempts
EXPECTED = {
    "FULL_INPUT": ([{0: 100}, {0: 1}, {0: 1}, {0: 1}, {0: 1}], [(), (), (), (), ()]),
    "ADMISSION_ORDER": ([{0: 48, 1: 48}, {0: 48, 1: 48}, {0: 48, 1: 3}, {0: 48}, {0: 14}], [(), (), (), (1,), ()]),
    "LONE": ([{0: 400}, {0: 1}], [(), ()]),
}
CASES = {"FULL_INPUT": FULL_INPUT, "ADMISSION_ORDER": ADMISSION_ORDER, "LONE": LONE}


def first_steps(steps, n: int):
    return [s.scheduled for s in steps[:n]], [s.preempted for s in steps[:n]]
