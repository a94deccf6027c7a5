"""The test hooks of p2p/faults.py: read from the environment once, bad values named, and paced
inner steps that wait as an accelerator would yet stop at once when the node stops."""

import threading
import time

import pytest

from p2p import faults

pytestmark = pytest.mark.timeout(30)


def test_the_variables_are_read_and_bad_values_name_their_variable():
    f = faults.from_environ({faults.ENV: "gather@3:4", faults.HOLD_ENV: "2.5", faults.STEP_ENV: "0.25"})
    assert (f.phase, f.round, f.members, f.hold_seconds, f.step_seconds) == ("gather", 3, 4, 2.5, 0.25)
    assert f.any and not f.stop and not faults.from_environ({}).any
    assert faults.from_environ({faults.ENV: "reduce@4:4/stop"}) == faults.Faults("reduce", 4, 4, stop=True)
    for env, bad in [(faults.STEP_ENV, "-1"), (faults.STEP_ENV, "nan"), (faults.STEP_ENV, "fast"),
                     (faults.HOLD_ENV, "inf"), (faults.ENV, "explode@1"), (faults.ENV, "reduce@4/pause")]:
        with pytest.raises(ValueError, match=env):
            faults.from_environ({env: bad})


def test_paced_steps_wait_first_and_a_stop_cuts_the_wait_short():
    stop = threading.Event()
    asked = []

    def should_stop():
        asked.append(time.monotonic())
        return stop.is_set()

    assert faults.NO_FAULTS.paced(should_stop, stop) is should_stop  # unpaced: the same callable
    paced = faults.Faults(step_seconds=0.2).paced(should_stop, stop)
    t0 = time.monotonic()
    assert paced() is False and asked[-1] - t0 >= 0.2
    threading.Timer(0.1, stop.set).start()
    t0 = time.monotonic()
    slow = faults.Faults(step_seconds=60).paced(should_stop, stop)
    assert slow() is True and asked[-1] - t0 < 30
