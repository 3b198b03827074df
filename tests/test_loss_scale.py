"""The dynamic loss scale of the fp16 path: halve on overflow, double after a run of good steps, and
a state that round-trips (resume continues with the same scale)."""

from andrea.schedule.model import LossScale


def test_overflow_halves_and_restarts_the_count():
    s = LossScale(scale=1024.0, growth_interval=3)
    s.update(overflow=False)
    s.update(overflow=True)
    assert s.scale == 512.0 and s.good_steps == 0


def test_growth_after_interval_of_good_steps():
    s = LossScale(scale=8.0, growth_interval=3)
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 8.0
    s.update(overflow=False)
    assert s.scale == 16.0 and s.good_steps == 0


def test_scale_never_drops_below_one():
    s = LossScale(scale=2.0)
    for _ in range(5):
        s.update(overflow=True)
    assert s.scale == 1.0


def test_state_round_trip():
    s = LossScale(scale=4096.0, growth_interval=7)
    for overflow in (False, False, True, False):
        s.update(overflow)
    t = LossScale()
    t.load(s.state())
    assert (t.scale, t.good_steps, t.growth_interval) == (s.scale, s.good_steps, s.growth_interval)
    for overflow in (False,) * 10:
        s.update(overflow)
        t.update(overflow)
    assert t.state() == s.state()
