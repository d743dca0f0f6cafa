"""Where a batch leaves: the output-store interface (``store.py``), a job's outputs
(``job_outputs.py``), the DALI output adapter (``run_output.py``), private copies
(``copies.py``), the pools of regions the stores lease (``pool.py``), POSIX shared memory
(``shm.py``), CUDA IPC (``cuda.py``, ``cuda_store.py``, through the one module that calls CUDA,
``cuda_api.py``) and staged GPU outputs (``cuda_staged.py``).

The bottom stage: every stage above may import it; it imports nothing of the daemon but
``errors``. GPU types (CuPy) stay here.
"""
