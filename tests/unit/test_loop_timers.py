"""How long the daemon's loop sleeps between its timed chores (Note [The loop's timers] in
dalid.server.intake.chores): until the first one is due, not a fixed tick."""

from __future__ import annotations

from dalid.server.intake.chores import sleep_ms


def test_with_nothing_but_the_reap_due_the_loop_sleeps_until_the_reap() -> None:
    # It used to wake every 500 ms, with nothing due at one wake in two.
    assert sleep_ms(100.0, 101.0) == 1001
    assert sleep_ms(100.0, 101.0, None, None) == 1001


def test_the_first_thing_due_wakes_it() -> None:
    # The metrics' snapshot, the idle timeout, a cut connection's grace: whichever comes first.
    assert sleep_ms(100.0, 101.0, 100.25, None) == 251
    assert sleep_ms(100.0, 101.0, None, 100.5) == 501
    assert sleep_ms(100.0, 101.0, 100.75, 100.5, cut_in=0.1) == 101


def test_what_is_overdue_is_done_at_once() -> None:
    assert sleep_ms(100.0, 99.5) == 0
    assert sleep_ms(100.0, 101.0, cut_in=0.0) == 1
