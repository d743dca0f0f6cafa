"""The worker side of a batch: what a DataLoader worker process runs.

Holds the picklable proxy and the collate rule that ends a batch (``worker``), what a sample
may be (``samples``), file paths made absolute (``paths``), where a proxy's batches go
(``target``), submitting over one link without waiting (``submitter``), this process's links
by job, which a daemon restart takes away and gives back (``links``), and the small tensors a
worker's batch carries to the trainer by value (``carry``). A batch enters dalid here.

Imports ``dalid.protocol``, ``dalid.client.link``, ``dalid.client.errors`` and
``dalid.client.refs``; imported by what a user calls (the proxy, the session, the DataLoader)
and by ``reconnect``, never by ``outputs``.
"""
