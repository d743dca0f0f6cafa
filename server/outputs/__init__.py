"""Where a batch leaves: the output backends' interface (``outputs.py``), the pools of regions
they lease, POSIX shared memory (``shm.py``), CUDA IPC (``cuda.py``, through the one module that
calls CUDA, ``cuda_api.py``), staged GPU outputs (``cuda_staged.py``) and private copies.

The bottom stage: every stage above may import it; it imports nothing of the daemon but
``errors``. GPU types (CuPy) stay here.
"""
