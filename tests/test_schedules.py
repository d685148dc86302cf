"""The lambda schedule (thesis §2.2.7, App. A.7): released presets, the compressed schedule, bad arguments."""

import pytest

from sphereml.heads.schedules import LambdaSchedule


def test_lambda_schedule_values():
    sphereface = LambdaSchedule.sphereface()
    assert sphereface.value(0) == 1000.0
    assert sphereface.value(100) == pytest.approx(1000 / 13)
    assert sphereface.value(10**6) == 5.0
    lsoft = LambdaSchedule.lsoftmax()
    assert lsoft.value(5000) == pytest.approx(1000 * (1 + 2.5e-5 * 5000) ** -35)


def test_reaching_schedule_hits_its_floor_on_time():
    sched = LambdaSchedule.reaching(5.0, steps=100)
    assert sched.value(0) == 1000.0 and sched.value(40) == pytest.approx(5.0) and sched.value(99) == 5.0
    assert sched.value(39) > 5.0
    assert LambdaSchedule.reaching(0.0, steps=100).value(40) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        LambdaSchedule.reaching(5.0, steps=0)


@pytest.mark.parametrize("kwargs,message", [
    ({"base": -1.0}, "base must be a finite number >= 0"),
    ({"gamma": float("nan")}, "gamma must be a finite number >= 0"),
    ({"power": True}, "power must be a finite number >= 0"),
    ({"lambda_min": -0.5}, "lambda_min must be a finite number >= 0"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LambdaSchedule(**kwargs)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        LambdaSchedule.reaching(5.0, steps=True)
