"""What a worker learns from its prefills, on a clock the test drives."""

from __future__ import annotations

import pytest

from workers.loop.prefill import PER_TOKEN_SAMPLE_TOKENS, PREFILL_FRESH_S, PrefillMeter


def _wave(meter: PrefillMeter, n: int, tokens: int, start_s: float, took_s: float) -> None:
    """``n`` chats of ``tokens`` uncached prompt tokens that start together and all have
    their first token ``took_s`` later (the engine prefills them in one step)."""
    for i in range(n):
        meter.started(f"{start_s}-{i}", tokens, True, start_s)
    for i in range(n):
        meter.first_token(f"{start_s}-{i}", took_s * 1000.0, tokens, start_s + took_s)


def test_a_wave_is_estimated_by_its_tokens_not_its_count() -> None:
    """32 chats of 80 tokens took 1.15 s together: the next wave's last arrival waits for
    the 31 before it at that pace, not 31 times one prefill alone."""
    meter = PrefillMeter()
    _wave(meter, 32, 80, start_s=0.0, took_s=1.15)
    report = meter.report(2.0)
    assert report.prefill_ms_per_token == pytest.approx(1150 / (32 * 80))
    assert report.prefill_queued_ms == 0.0  # nothing awaits its prefill
    for i in range(31):
        meter.started(f"next-{i}", 80, True, 2.0)
    report = meter.report(2.0)
    assert report.prefill_queued_ms == pytest.approx(31 * 80 * 1150 / (32 * 80))
    # One short prefill's time (each shared by at least 16 of the wave) is not multiplied.
    assert report.prefill_ms < 1150 / 16 + 1e-9


def test_short_prompts_alone_teach_no_cost_per_token() -> None:
    """An 80-token prompt alone in a 70 ms step says nothing of a token's cost: its time
    is the step's."""
    meter = PrefillMeter()
    for k in range(10):
        _wave(meter, 1, 80, start_s=float(k), took_s=0.07)
    report = meter.report(10.0)
    assert report.prefill_ms == pytest.approx(70.0)
    assert report.prefill_ms_per_token == 0.0


def test_a_long_prompt_alone_teaches_its_cost() -> None:
    meter = PrefillMeter()
    _wave(meter, 1, 1000, start_s=0.0, took_s=0.5)
    assert meter.report(1.0).prefill_ms_per_token == pytest.approx(0.5)


def test_batch_prefills_neither_queue_before_chats_nor_teach() -> None:
    meter = PrefillMeter()
    _wave(meter, 4, 100, start_s=0.0, took_s=0.2)  # 400 tokens in 200 ms
    assert meter.started("b", 1500, False, 1.0) == 1
    meter.first_token("b", 3000.0, 1500, 4.0)  # a slow batch prefill
    assert meter.started("b2", 1500, False, 4.0) == 1
    assert meter.started("chat", 100, True, 4.0) == 2  # shares the engine with it
    report = meter.report(4.0)
    assert report.prefill_ms_per_token == pytest.approx(0.5)
    assert report.prefill_queued_ms == pytest.approx(100 * 0.5)  # the chat only
    assert report.prefill_ms < 200 / 2  # what the chats taught, shared by 3 or 4


def test_prompt_tokens_cost_what_the_prefix_cache_leaves() -> None:
    """Later turns of personas are mostly in the prefix cache: a prompt token, awaiting
    its prefill or arriving, costs an uncached one's time at the recent uncached share."""
    meter = PrefillMeter()
    _wave(meter, 1, 1000, start_s=0.0, took_s=0.5)  # a first turn, nothing cached
    for k in range(1, 40):  # later turns: 100 of 1,000 tokens uncached
        meter.started(f"t{k}", 1000, True, float(k))
        meter.first_token(f"t{k}", 60.0, 100, k + 0.06)
    meter.started("next", 1000, True, 41.0)
    report = meter.report(41.0)
    assert report.prefill_ms_per_token == pytest.approx(0.5 * 0.1, rel=0.05)
    assert report.prefill_queued_ms == pytest.approx(1000 * report.prefill_ms_per_token)


def test_load_that_never_drains_still_teaches() -> None:
    """Arrivals overlapping without a break: a sample every few thousand tokens."""
    meter = PrefillMeter()
    meter.started("j0", 200, True, 0.0)
    t = 0.0
    for k in range(1, PER_TOKEN_SAMPLE_TOKENS // 200 + 2):
        meter.started(f"j{k}", 200, True, t)  # the next one is waiting already
        t += 0.1
        meter.first_token(f"j{k - 1}", 100.0, 200, t)
    assert meter.pending == 1
    assert meter.report(t).prefill_ms_per_token == pytest.approx(0.5)


def test_a_job_that_ends_before_its_first_token_is_forgotten() -> None:
    meter = PrefillMeter()
    _wave(meter, 1, 1000, start_s=0.0, took_s=0.5)
    meter.started("gone", 1000, True, 1.0)
    assert "gone" in meter and meter.report(1.0).prefill_queued_ms == pytest.approx(500.0)
    assert meter.ended("gone") and not meter.ended("gone")
    assert meter.pending == 0 and meter.report(1.0).prefill_queued_ms == 0.0


def test_the_figures_fade_once_samples_stop() -> None:
    meter = PrefillMeter()
    _wave(meter, 1, 1000, start_s=0.0, took_s=0.5)
    fresh = meter.report(0.5 + PREFILL_FRESH_S)
    later = meter.report(0.5 + PREFILL_FRESH_S + 30.0)
    assert fresh.prefill_ms_per_token == pytest.approx(0.5)
    assert 0.0 < later.prefill_ms_per_token < fresh.prefill_ms_per_token / 2
    assert 0.0 < later.prefill_ms < fresh.prefill_ms / 2
