"""When and with whom a batch runs. Its parts, each the one owner of its state:

- a pipeline: ``executor.py`` (builds it, its members), ``dali_instances.py`` (its DALI
  instances and their count, decided by ``instances.py`` from ``meters.py``), ``run_loop.py``
  (an instance's runs and their recovery), ``delivery.py`` (a run's outputs to its jobs),
  ``run_gate.py`` (the daemon's gate into DALI: a pipeline on probation runs alone);
- its next run: ``run_planner.py`` (forming runs), ``job_window.py`` (a job's window),
  ``slots.py`` (the scheduler's slots an instance holds), ``scheduler.py`` (the fair
  scheduler), ``runs.py`` (batches, members, runs);
- cohorts of identical batches served once: ``cohorts.py`` (the thread-safe cohort),
  ``cohort_state.py`` (what it does under its lock), ``cohort_cache.py``, ``cohort_leases.py``,
  ``cohort_windows.py``, ``cohort_charges.py``, ``cohort_figures.py``, ``cohort_entries.py``,
  ``cohort_matching.py``, ``cohort_registry.py`` (the daemon's cohorts by name);
- ``wakes.py``: the wakes of waiting executors.

Imported by ``jobs/`` (a job's batches wait as pending batches of its pipelines) and above;
imports ``pipelines/``, ``samples/`` and ``outputs/`` (a run's outputs are written there), never
a stage above it.
"""
