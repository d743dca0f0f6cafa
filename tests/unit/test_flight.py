"""Who a crash convicts: the slots a dead daemon left marked, read as the next one reads them."""

from __future__ import annotations

import struct

from dalid.server.pipelines.flight import (
    _OLD_SLOT,
    _SLOT,
    SLOTS,
    Slot,
    Standing,
    Suspect,
    convicted,
    read_slots,
)

KEY_A, KEY_B = b"a" * 16, b"b" * 16


Marked = tuple[bytes, tuple[int, ...], bytes, bool]


def _file(*slots: Marked, layout: struct.Struct = _SLOT) -> bytes:
    data = bytearray(SLOTS * layout.size)
    for index, (key, pids, name, solo) in enumerate(slots):
        listed = [*pids, *[0] * (8 - len(pids))]
        values = (key, *listed, name, solo) if layout is _SLOT else (key, *listed, name)
        data[index * layout.size : (index + 1) * layout.size] = layout.pack(*values)
    return bytes(data)


def test_the_slots_are_read_as_written_and_an_older_daemons_as_not_solo() -> None:
    data = _file((KEY_A, (10, 11), b"victim", False), (KEY_B, (12,), b"crasher", True))
    assert read_slots(data) == [
        Slot(KEY_A.hex(), (10, 11), "victim", False),
        Slot(KEY_B.hex(), (12,), "crasher", True),
    ]
    old = _file((KEY_B, (12,), b"crasher", False), layout=_OLD_SLOT)
    assert read_slots(old) == [Slot(KEY_B.hex(), (12,), "crasher", False)]


def test_a_crash_convicts_a_solo_run_or_a_lone_trainer_and_puts_others_on_probation() -> None:
    victim = Slot(KEY_A.hex(), (10,), "victim", False)
    crasher = Slot(KEY_B.hex(), (12,), "crasher", False)
    # Several trainers' runs in flight: nobody is blamed outright.
    assert convicted([victim, crasher], 1.0) == [
        Suspect(KEY_A.hex(), 10, "victim", 1.0, Standing.PROBATION),
        Suspect(KEY_B.hex(), 12, "crasher", 1.0, Standing.PROBATION),
    ]
    # A shared pipeline's run for two trainers is several trainers too.
    shared = Slot(KEY_A.hex(), (10, 12), "shared", False)
    assert {s.standing for s in convicted([shared], 1.0)} == {Standing.PROBATION}
    # One trainer's runs alone, of one graph or two: that trainer's, as before probation.
    again = Slot(KEY_A.hex(), (12,), "other", False)
    assert {s.standing for s in convicted([crasher, again], 1.0)} == {Standing.REFUSED}
    # A solo run in flight: the crash is its own, whoever else was marked.
    solo = Slot(KEY_B.hex(), (12,), "crasher", True)
    assert convicted([victim, solo], 1.0) == [
        Suspect(KEY_A.hex(), 10, "victim", 1.0, Standing.PROBATION),
        Suspect(KEY_B.hex(), 12, "crasher", 1.0, Standing.REFUSED),
    ]
    assert convicted([], 1.0) == []
