"""Serve a few requests on the tiny engine with its engine core in a process of its own (as `vllm serve`
runs it), CBSIM_RECORD_STEPS set by the caller: the plugin (cbsim/tools/sim2real/plugin.py) records there.
Run as a script by test_sim2real_plugin.py; prints the number of output tokens."""
import os
import sys

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    from cbsim.tools.sim2real.vllm_scheduler import TINY_MODEL, offline_hub

    offline_hub()
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(TINY_MODEL), skip_tokenizer_init=True,
                                                   load_format="dummy", max_model_len=1024, block_size=32,
                                                   max_num_batched_tokens=256, gpu_memory_utilization=0.1))
    for i, n in enumerate(int(a) for a in sys.argv[1:]):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=list(range(3 + i, 3 + i + n))),
                           SamplingParams(max_tokens=5, ignore_eos=True, detokenize=False))
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    engine.engine_core.shutdown()
    print("output tokens", tokens)
