import pytest

from failover.coserve.policy import CoservePolicy, Decision, PressurePolicy

P = PressurePolicy(queue_high=8, queue_low=2, ttft_high_s=1.0, ttft_low_s=0.25, hold_s=5.0)


def test_load_preempts_at_once_and_resumes_only_after_hold():
    c = CoservePolicy(P)
    assert c.observe(0, queue_depth=3, ttft_s=0.1) is Decision.NONE
    assert c.observe(1, queue_depth=9, ttft_s=0.1) is Decision.PREEMPT
    assert c.observe(2, queue_depth=9, ttft_s=0.1) is Decision.NONE  # already preempted
    assert c.observe(3, queue_depth=1, ttft_s=0.1) is Decision.NONE  # calm starts
    assert c.observe(7.9, queue_depth=1, ttft_s=0.1) is Decision.NONE
    assert c.observe(8.0, queue_depth=1, ttft_s=0.1) is Decision.RESUME
    assert not c.preempted


def test_hovering_between_thresholds_neither_evicts_nor_resumes():
    c = CoservePolicy(P)
    c.observe(0, queue_depth=0, ttft_s=2.0)  # ttft trigger
    assert c.reason == "load"
    for t in range(1, 30):  # between low and high: no resume, no churn
        assert c.observe(t, queue_depth=5, ttft_s=0.5) is Decision.NONE
    assert c.preempted
    c.observe(30, queue_depth=0, ttft_s=0.0)
    c.observe(33, queue_depth=3, ttft_s=0.0)  # a blip above low resets the hold
    assert c.observe(36, queue_depth=0, ttft_s=0.0) is Decision.NONE
    assert c.observe(41, queue_depth=0, ttft_s=0.0) is Decision.RESUME


def test_operator_preempt_holds_until_operator_resume():
    c = CoservePolicy(P)
    assert c.operator_preempt() is Decision.PREEMPT
    assert c.observe(100, queue_depth=0, ttft_s=None) is Decision.NONE
    assert c.observe(200, queue_depth=0, ttft_s=None) is Decision.NONE
    assert c.operator_resume(201) is Decision.RESUME
    assert c.operator_resume(202) is Decision.NONE


def test_operator_preempt_during_load_preemption_takes_over():
    c = CoservePolicy(P)
    c.observe(0, queue_depth=20, ttft_s=None)
    assert c.operator_preempt() is Decision.NONE
    assert c.reason == "operator"
    assert c.observe(100, queue_depth=0, ttft_s=None) is Decision.NONE


def test_memory_need_preempts_and_calm_resumes():
    c = CoservePolicy(P)
    assert c.memory_needed() is Decision.PREEMPT
    c.observe(0, queue_depth=0, ttft_s=0)
    assert c.observe(5, queue_depth=0, ttft_s=0) is Decision.RESUME


@pytest.mark.parametrize("kw", [dict(queue_low=8), dict(ttft_low_s=2.0), dict(hold_s=-1)])
def test_bad_thresholds_are_refused(kw):
    with pytest.raises(ValueError):
        PressurePolicy(**kw)
