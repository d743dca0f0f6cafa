"""When and with whom a batch runs: each pipeline's executor and its instances, the runs that
mix batches of the jobs sharing a pipeline and their planning (a job's window), the fair
scheduler that picks whose batch comes next, cohorts of identical batches served once, and the
wakes of waiting executors.

Imported by ``jobs/`` (a job's batches wait as pending batches of its pipelines) and above;
imports ``pipelines/``, ``samples/`` and ``outputs/`` (a run's outputs are written there), never
a stage above it.
"""
