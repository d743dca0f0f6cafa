"""The daemon's training jobs: their registry (``jobs.py``), quotas and the memory reserved for
them, the batches each has in flight (admission, batch ids, rates) and their input memory.

Imported by ``handling/`` and above; imports ``runs/`` (a job's batches wait as its pipelines'
pending batches), ``samples/`` and ``outputs/``, never a stage above it.
"""
