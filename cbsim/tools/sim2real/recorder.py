"""Record every step of a vLLM V1 engine core: what it scheduled and how long it took.

Works on an engine core in this process (vllm.v1.engine.core.EngineCore: `LLMEngine` or `LLM` with
VLLM_ENABLE_V1_MULTIPROCESSING=0, `llm_engine.engine_core.engine_core`), on a CPU here or on a GPU, and
inside `vllm serve`'s engine-core process through vLLM's plugin mechanism (plugin.py).
It wraps two methods of that core, changing nothing they do:

- `scheduler.schedule`: its SchedulerOutput gives, per scheduled request, the tokens it runs and the
  tokens it had computed before (a prefill chunk [c, h], or a decode with context h + 1), the prefix-cache
  hit of each admitted request, the preempted requests, and the waiting and running counts after it;
- `step_fn` (EngineCore.step, what each engine iteration calls): its wall time is the step's time_s.

The interval timed is the whole engine iteration, from entering `step_fn` to its return: schedule(),
the forward pass and sampling (model_executor.execute_model / sample_tokens), and update_from_output().
That is one step of cbsim's replica (its cost model plus engine terms); the frontend (the output
processor, detokenizing) lies outside it. A step that schedules nothing is not recorded.

`steps_rows()` is the table `cbsim calibrate --steps` reads (profiler/step_table.py: prefill, decode,
time_s); `trace_rows()` keeps everything.
"""
from __future__ import annotations

import json
import time
from pathlib import Path


class StepRecorder:
    """Wraps an EngineCore; `rows` grows by one dict per non-empty step, or, with a `sink`, each row goes to
    the sink as its step ends and none is kept (a long-running server: plugin.py)."""

    def __init__(self, core, sink=None):
        self.core = core
        self.sink = sink
        self.rows: list[dict] = []
        self.enabled = True
        self._pending: dict | None = None
        scheduler = core.scheduler
        self._schedule, self._step = scheduler.schedule, core.step_fn
        scheduler.schedule = self._on_schedule
        core.step_fn = self._on_step

    def _on_schedule(self, *args, **kwargs):
        out = self._schedule(*args, **kwargs)
        if self.enabled and out.total_num_scheduled_tokens:
            self._pending = _describe(self.core.scheduler, out)
        return out

    def _on_step(self, *args, **kwargs):
        self._pending = None
        start = time.perf_counter()
        result = self._step(*args, **kwargs)
        end = time.perf_counter()
        if self._pending is not None:
            self._pending.update(start=start, time_s=end - start)
            if self.sink is None:
                self.rows.append(self._pending)
            else:
                self.sink(self._pending)
            self._pending = None
        return result

    def clear(self) -> None:
        self.rows = []

    def steps_rows(self) -> list[dict]:
        """The calibration table's rows (profiler/step_table.py's keys)."""
        return [steps_row(row) for row in self.rows]

    def write(self, folder: Path) -> None:
        """steps.jsonl (for `cbsim calibrate --steps`) and trace.jsonl (every recorded field)."""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.steps_rows()))
        (folder / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.rows))


def steps_row(row: dict) -> dict:
    """A recorded step as the calibration table's row (profiler/step_table.py's keys)."""
    return {"prefill": row["prefill"], "decode": row["decode"], "time_s": row["time_s"]}


def _describe(scheduler, out) -> dict:
    """One step's composition from vLLM's SchedulerOutput (before the step runs)."""
    before: dict[str, int] = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens))
    prefill, decode, rows = [], [], []
    for req_id, n in out.num_scheduled_tokens.items():
        h = before[req_id]
        prompt = scheduler.requests[req_id].num_prompt_tokens
        if n == 1 and h >= prompt:
            decode.append(h + 1)
        else:
            prefill.append([n, h])
        rows.append([req_id, n, h])
    hits = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs if new.num_computed_tokens}
    hits.update((r, before[r]) for r in cached.resumed_req_ids if before.get(r))
    running, waiting = scheduler.get_request_counts()
    return {"prefill": prefill, "decode": decode, "requests": rows, "prefix_hit_tokens": hits,
            "preempted": sorted(out.preempted_req_ids or ()), "num_running": running, "num_waiting": waiting,
            "kv_usage": scheduler.kv_cache_manager.usage}
