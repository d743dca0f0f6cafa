"""Receiving outputs: a batch's regions of the daemon's memory turned into torch tensors.

Holds the interface (``outputs``) and one backend per kind of output memory: shared memory
(``shm``), CUDA IPC (``cuda``), GPU outputs staged through shared memory (``cuda_staged``), and
private copies (``copies``); ``cuda_device`` is the only module of the client that makes CUDA
calls (through torch and CuPy), so that tests can put a simulated GPU in its place. This is
where a batch's outputs leave dalid for the training loop.

Imports ``dalid.protocol``, ``dalid.client.errors`` and the link's type; imported by
``reconnect`` (a session's generation maps its daemon's outputs), never by the worker side.
"""
