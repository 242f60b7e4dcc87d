"""The latency-first scheduler, driven step by step as vLLM's engine core drives it.

vLLM's real scheduler and KV cache manager run here (no model: each step's output is
written by the test), so these tests check what the engine would batch in each step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from cluster.runtime.steplog import STEP_LOG_ENV, read_steps
from workers.engines import scheduler as scheduler_module
from workers.engines.base import BATCH_PRIORITY_BASE
from workers.engines.config import BATCH_PREFILL_ENV, NICE_ENV, SPIN_ENV
from workers.engines.scheduler import (
    MAX_YIELD_STEPS,
    LatencyFirstAsyncScheduler,
    LatencyFirstScheduler,
    SchedulerApiMismatch,
    check_scheduler_api,
    latency_first_scheduler,
)
from workers.engines.steplog import LoggingScheduler

BLOCK = 16
TOKEN_BUDGET = 256


def make_scheduler(model_path: str, factory: Callable[..., Scheduler]) -> Scheduler:
    model = ModelConfig(model=model_path, max_model_len=4096, dtype="float32")
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=TOKEN_BUDGET,
            max_model_len=4096,
            is_encoder_decoder=False,
            policy="priority",
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
    )
    vllm_config.cache_config.num_gpu_blocks = 200
    kv_cache_config = KVCacheConfig(
        num_blocks=200,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32
                ),
            )
        ],
    )
    return factory(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        log_stats=False,
        block_size=BLOCK,
    )


def request(rid: str, prompt_len: int, deadline_ms: int, batch: bool) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=[7] * prompt_len,
        sampling_params=SamplingParams(max_tokens=50, ignore_eos=True),
        pooling_params=None,
        priority=deadline_ms + (BATCH_PRIORITY_BASE if batch else 0),
    )


def step(scheduler: Scheduler) -> dict[str, int]:
    """One engine step: schedule, then every request that finished its prompt samples 1."""
    out: SchedulerOutput = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = scheduler.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens  # schedule() already advanced it
        sampled.append([11] if done else [])
    runner = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={rid: i for i, rid in enumerate(ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )
    scheduler.update_from_output(out, runner)
    return dict(out.num_scheduled_tokens)


@pytest.fixture(params=[LatencyFirstScheduler, LatencyFirstAsyncScheduler])
def scheduler(model_path: str, request: pytest.FixtureRequest) -> Scheduler:
    """Both variants: the synchronous one (the CPU) and the asynchronous one (what the
    hook builds where vLLM schedules asynchronously, most CUDA setups)."""
    return make_scheduler(model_path, request.param)


def start_batch(scheduler: Scheduler, n: int) -> list[str]:
    ids = [f"b{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        scheduler.add_request(request(rid, 20, 1_000 + i, batch=True))
    while any(scheduler.requests[r].num_computed_tokens < 20 for r in ids):
        step(scheduler)
    return ids


def test_interactive_prefill_runs_without_batch_work(scheduler: Scheduler) -> None:
    batch = start_batch(scheduler, 4)
    assert set(step(scheduler)) == set(batch)  # batch decodes as usual
    scheduler.add_request(request("i0", 40, 5_000, batch=False))
    scheduler.add_request(request("b-late", 20, 2_000, batch=True))
    first = step(scheduler)
    assert first == {"i0": 40}  # the interactive prefill alone: no decode, no batch admit
    after = step(scheduler)
    assert set(after) == {*batch, "i0", "b-late"}  # everyone resumes the next step


def test_long_interactive_prompt_keeps_batch_held_over_its_chunks(
    scheduler: Scheduler,
) -> None:
    batch = start_batch(scheduler, 3)
    scheduler.add_request(request("i0", 600, 5_000, batch=False))
    chunks = [step(scheduler) for _ in range(3)]
    assert all(set(c) == {"i0"} for c in chunks)  # three chunks, batch held in each
    assert sum(c["i0"] for c in chunks) == 600
    assert set(step(scheduler)) == {*batch, "i0"}


def test_batch_is_held_back_a_bounded_number_of_steps(scheduler: Scheduler) -> None:
    batch = start_batch(scheduler, 2)
    # A prompt that needs more chunks than the bound: after MAX_YIELD_STEPS steps batch
    # decodes share the steps again, so batch work is never starved.
    scheduler.add_request(request("i0", TOKEN_BUDGET * (MAX_YIELD_STEPS + 2), 5_000, False))
    seen = [step(scheduler) for _ in range(MAX_YIELD_STEPS + 1)]
    assert all(set(s) == {"i0"} for s in seen[:MAX_YIELD_STEPS])
    assert set(batch) <= set(seen[MAX_YIELD_STEPS])


def test_steps_with_batch_work_hold_a_bounded_prefill_while_chats_run(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BATCH_PREFILL_ENV, "48")
    scheduler = make_scheduler(model_path, LatencyFirstScheduler)
    batch = start_batch(scheduler, 3)
    scheduler.add_request(request("i0", 20, 5_000, batch=False))
    assert step(scheduler) == {"i0": 20}  # the chat's prefill, alone
    scheduler.add_request(request("b-long", 200, 2_000, batch=True))
    steps = [step(scheduler) for _ in range(3)]
    # Each step: every running decode (the chat's too), plus at most 48 prompt tokens.
    assert all({*batch, "i0"} <= set(s) for s in steps)
    assert [s["b-long"] for s in steps] == [48, 48, 48]
    # A latency-bound prompt is not capped: it runs whole, in a step without batch work
    # (the other chat keeps decoding).
    scheduler.add_request(request("i1", 200, 6_000, batch=False))
    assert step(scheduler) == {"i0": 1, "i1": 200}


def test_without_chats_batch_prefills_are_not_capped(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BATCH_PREFILL_ENV, "48")
    scheduler = make_scheduler(model_path, LatencyFirstScheduler)
    batch = start_batch(scheduler, 3)
    scheduler.add_request(request("b-long", 200, 2_000, batch=True))
    assert step(scheduler) == {**dict.fromkeys(batch, 1), "b-long": 200}


def test_without_batch_work_it_schedules_like_vllm(model_path: str) -> None:
    ours = make_scheduler(model_path, LatencyFirstScheduler)
    theirs = make_scheduler(model_path, Scheduler)
    for s in (ours, theirs):
        for i in range(5):
            s.add_request(request(f"r{i}", 30 + 50 * i, 1_000 + i, batch=False))
    for _ in range(6):
        assert step(ours) == step(theirs)


def test_the_hook_builds_the_synchronous_variant_on_the_cpu(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The hook would change how this process's vLLM queues wait, and its priority
    # (engine_wait.py).
    monkeypatch.setenv(SPIN_ENV, "1")
    monkeypatch.delenv(NICE_ENV, raising=False)
    assert isinstance(make_scheduler(model_path, latency_first_scheduler), LatencyFirstScheduler)


def test_the_hook_sets_the_engine_core_priority_it_is_given(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SPIN_ENV, "1")
    asked: list[int] = []
    monkeypatch.setattr(scheduler_module, "set_nice", asked.append)
    monkeypatch.delenv(NICE_ENV, raising=False)
    make_scheduler(model_path, latency_first_scheduler)
    assert asked == []  # none asked: the process keeps its own
    monkeypatch.setenv(NICE_ENV, "-7")
    make_scheduler(model_path, latency_first_scheduler)
    assert asked == [-7]


def test_the_hook_builds_the_asynchronous_variant_where_vllm_schedules_asynchronously(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SPIN_ENV, "1")
    monkeypatch.delenv(NICE_ENV, raising=False)

    def hook(*, vllm_config: VllmConfig, **kwargs: object) -> Scheduler:
        vllm_config.scheduler_config.async_scheduling = True
        return latency_first_scheduler(vllm_config=vllm_config, **kwargs)

    assert isinstance(make_scheduler(model_path, hook), LatencyFirstAsyncScheduler)


@pytest.mark.parametrize("factory", [latency_first_scheduler, LoggingScheduler])
def test_with_a_step_log_every_step_is_logged_as_it_was_scheduled(
    model_path: str,
    factory: Callable[..., Scheduler],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """charserve's hook, and vLLM's own scheduler as its server runs it with the log on."""
    monkeypatch.setenv(SPIN_ENV, "1")
    monkeypatch.delenv(NICE_ENV, raising=False)
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path / "log"))
    logged = make_scheduler(model_path, factory)
    plain = make_scheduler(model_path, Scheduler)
    for s in (logged, plain):
        s.add_request(request("a", 30, 1_000, batch=False))
    scheduled = [step(logged)]
    assert scheduled == [step(plain)]  # logging changes no step
    for s in (logged, plain):
        s.add_request(request("b", 20, 1_001, batch=False))
        s.add_request(request("c", 10, 1_002, batch=False))
    for _ in range(3):
        scheduled.append(step(logged))
        assert scheduled[-1] == step(plain)
    steps = read_steps(tmp_path / "log", 0.0, math.inf)
    assert [(x.tokens, x.new, x.new_tokens, x.requests) for x in steps] == [
        (30, 1, 30, 1),
        (31, 2, 30, 3),  # a's decode waited for b's and c's prefills
        (3, 0, 0, 3),
        (3, 0, 0, 3),
    ]
    assert [sum(s.values()) for s in scheduled] == [x.tokens for x in steps]


def test_without_a_step_log_the_hook_builds_its_scheduler_as_it_was(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SPIN_ENV, "1")
    monkeypatch.delenv(NICE_ENV, raising=False)
    monkeypatch.delenv(STEP_LOG_ENV, raising=False)
    assert type(make_scheduler(model_path, latency_first_scheduler)) is LatencyFirstScheduler


def test_the_installed_vllm_has_the_scheduler_api_it_needs() -> None:
    check_scheduler_api()  # raises on a mismatch


def test_a_scheduler_that_renamed_what_it_reads_fails_the_start(model_path: str) -> None:
    class Renamed(Scheduler):
        def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
            # vLLM renamed max_num_active_reqs: overriding it would do nothing.
            self.max_active = self.max_num_running_reqs  # type: ignore[attr-defined]
            return super().schedule(throttle_prefills)

    with pytest.raises(SchedulerApiMismatch, match="max_num_active_reqs"):
        check_scheduler_api(Renamed)

    class OldRequest(Request):
        def __init__(self) -> None:  # a vLLM whose requests have no eligibility step
            self.priority = 0

    with pytest.raises(SchedulerApiMismatch, match=r"Request\.next_decode_eligible_step"):
        check_scheduler_api(request=OldRequest)
