"""The batch ids a connection may submit under: each connection's own range, in order.

A submitter chooses its batch's id, so that it can hand the batch on without waiting for the
daemon (SPEC.md, "Submitting a batch"). The daemon gives each connection, in its ``welcome``, a
range no other connection of the daemon has (``batch_id_base``) and takes from it only ids
above the last one taken. So an id names one batch of one connection for the daemon's life: a
peer cannot reuse an id, its own or another's, and no batch of one job can name another's.
"""

from __future__ import annotations

import itertools

from dalid.protocol import BATCH_IDS_PER_CONNECTION, ErrorCode

from ..errors import RequestRefused

_bases = itertools.count(BATCH_IDS_PER_CONNECTION, BATCH_IDS_PER_CONNECTION)


class BatchIds:
    """The range of one connection and the last id taken from it. Used from the I/O thread."""

    def __init__(self) -> None:
        self.base = next(_bases)
        self._last = self.base

    def take(self, batch_id: int) -> None:
        """Takes ``batch_id`` for a new batch of this connection, or refuses it."""
        if not self._last < batch_id < self.base + BATCH_IDS_PER_CONNECTION:
            if self.base < batch_id <= self._last:
                why = "was taken already (each batch needs an id of its own)"
            else:
                why = (
                    f"is not this connection's: its ids are {self.base} + 1, + 2, ... "
                    "(welcome.batch_id_base)"
                )
            raise RequestRefused(
                ErrorCode.INVALID_BATCH,
                f"batch id {batch_id} {why}; this connection's next id is above {self._last}",
            )
        self._last = batch_id
