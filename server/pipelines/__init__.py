"""Where a batch is run: the DALI pipelines (the runner, sharing of graphs between jobs, the
operator allow-list, the repository of named pipelines), their executors and instances, the runs
that mix batches of several jobs and their planning, cohorts of identical batches, the scheduler
that picks whose batch runs next, and the flight recorder.

Imported by ``jobs/`` and above; imports only ``samples/`` and ``outputs/`` (a run's outputs are
written there), never a stage above it.
"""
