"""How the request handlers send what is not a reply: a result an executor produced later, an
error about a notification, a reply that waited for a build or a reload.

The daemon's loop (``intake/``) gives the core its ``push``; the handlers share it.
"""

from __future__ import annotations

from collections.abc import Callable

from dalid.protocol import Message

Push = Callable[[bytes, Message, int | None], None]
"""push(peer, message, request_id): queues a message for a peer; safe from any thread."""
