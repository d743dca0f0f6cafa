"""Where a batch enters: the daemon process around its ZeroMQ socket (``daemon.py``), the I/O
loop that receives a turn of messages (``intake.py``), who is at the other end of a connection
(credentials, the gate), the socket's claim and sharing, the loop's timed chores (``chores.py``),
the metrics endpoint and the heap the loop gives back.

Below ``operations/`` (whose CLI and supervisor start it); it imports ``handling/`` (each decoded
message goes to the core there) and the stages below it, never ``operations/``.
"""
