"""cbsim against a real vLLM V1 engine (issue 27): scheduler parity with vLLM's own Scheduler, the step
recorder and workload driver around its engine core, and `cbsim sim2real`. Every module that needs vLLM
imports it lazily: cbsim's core has no vllm dependency (.ci/install_vllm_cpu.sh builds the engine's venv)."""
