"""Which inputs of a pipeline carry file paths (SPEC.md, "Files").

A registration names its ``path_inputs``: the external_source inputs that feed
``fn.io.file.read`` directly, whose samples are paths the daemon opens. The trainer finds them
in the pipelines it registers, and the daemon in the pipelines of its repository; both ask this
function, so both sides draw the line in the same place. DALI is imported only when it is
called: the protocol itself does not need DALI.
"""

from __future__ import annotations

from typing import Any

# The operator that reads files named by its input (fn.io.file.read).
FILE_READER = "io__file__Read"


def path_inputs(pipeline: Any) -> tuple[str, ...]:
    """The external_source names of a DALI ``pipeline`` whose samples are file paths, in the
    order the pipeline defines them."""
    from nvidia.dali.external_source import ExternalSource

    ops = pipeline._ops or ()
    sources = {op.name for op in ops if isinstance(op._op, ExternalSource)}
    fed = {
        node.source.name
        for op in ops
        if getattr(op._op, "schema_name", "") == FILE_READER
        for node in op.inputs
        if node.source is not None
    }
    return tuple(name for name in (op.name for op in ops) if name in sources & fed)
