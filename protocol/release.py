"""Which dalid a process runs: its release and the directory its code was loaded from.

A daemon says both in its ``welcome``, so that a trainer notices that the daemon on its socket
is not of its own installation (another checkout's environment that started the default
daemon first, an older release left running) and says so, naming both.
"""

from __future__ import annotations

from pathlib import Path


def release() -> str:
    """dalid's release, as installed ("" when dalid runs from a tree it was not installed
    from)."""
    # Here, not with the protocol: importing it is a fair part of a control command's start.
    from importlib import metadata

    try:
        return metadata.version("dalid")
    except metadata.PackageNotFoundError:
        return ""


def installation() -> str:
    """The directory dalid's code is loaded from: the checkout of an editable install, else
    the ``dalid`` folder of its site-packages."""
    return str(Path(__file__).resolve().parent.parent)
