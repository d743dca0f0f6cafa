"""What a batch carries, read without DALI: file paths and packed samples, image sizes and their
limits, bad samples and the causes told to their job.

Imported by ``pipelines/`` and above (and by the configuration, for the image limits); imports
nothing else of the daemon.
"""
