"""What a pipeline is and whether it may run: its serialized graph and which registrations may
share it (``sharing.py``), the operator allow-list, the repository of named pipelines and its
reloads, the DALI runner that feeds a run and collects its outputs, the output sizes a batch's
inputs fix (``sizes.py``), and the flight recorder of what was running when a daemon died.

Imported by ``runs/`` (an executor runs its pipeline's runner) and above; imports only
``samples/`` (the runner pads a batch's file paths), never a stage above it.
"""
