"""What an operator meets: the ``dalid`` command line (``cli.py``), its configuration file,
the control commands (status, reload, stop) and their views, the supervisor that keeps one
daemon per GPU, its devices and crash reports.

The top layer: it may import every stage below (it starts the daemon of ``intake/``); nothing
in the daemon imports it, only ``dalid.server.__main__`` and the ``dalid`` entry point.
"""
