"""Finding batch references in nested structures and replacing them with tensors.

Lists, dicts and objects with attributes are updated in place, tuples and named tuples are
rebuilt, as DALI's proxy does; everything else is left as it is. Shared and cyclic structures
are visited once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .refs import DALIOutputBatchRef, DALIPipelineRunRef

_LEAVES = (str, bytes, bytearray, memoryview, int, float, complex, bool, type(None))

Resolver = Callable[[list[DALIPipelineRunRef]], dict[int, tuple[Any, ...]]]


def _children(obj: Any) -> Any:
    if isinstance(obj, list | tuple):
        return obj
    if isinstance(obj, dict):
        return obj.values()
    if _is_plain_object(obj):
        return vars(obj).values()
    return ()


def _is_plain_object(obj: Any) -> bool:
    # Tensors and arrays have attributes too, but never hold references.
    module = type(obj).__module__
    return hasattr(obj, "__dict__") and not module.startswith(("torch", "numpy"))


def find_runs(obj: Any) -> list[DALIPipelineRunRef]:
    """The distinct pipeline runs referenced anywhere in ``obj``, in the order first met."""
    runs: dict[int, DALIPipelineRunRef] = {}
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, _LEAVES) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, DALIOutputBatchRef):
            runs.setdefault(id(item.pipe_run_ref), item.pipe_run_ref)
            continue
        stack.extend(reversed(list(_children(item))))
    return list(runs.values())


def replace_refs(obj: Any, resolve: Resolver) -> Any:
    """``obj`` with each batch reference replaced by ``resolve``'s output for it."""
    runs = find_runs(obj)
    if not runs:
        return obj
    outputs = resolve(runs)
    memo: dict[int, Any] = {}

    def replace(item: Any) -> Any:
        if isinstance(item, _LEAVES):
            return item
        if id(item) in memo:
            return memo[id(item)]
        if isinstance(item, DALIOutputBatchRef):
            result = outputs[id(item.pipe_run_ref)][item.output_idx]
        elif isinstance(item, list):
            memo[id(item)] = item
            item[:] = [replace(value) for value in item]
            result = item
        elif isinstance(item, dict):
            memo[id(item)] = item
            for key in list(item):
                item[key] = replace(item[key])
            result = item
        elif isinstance(item, tuple):
            values = [replace(value) for value in item]
            if hasattr(item, "_fields"):
                result = type(item)(*values)
            elif type(item) is tuple:
                result = tuple(values)
            else:
                result = type(item)(values)
        elif _is_plain_object(item):
            memo[id(item)] = item
            for name, value in list(vars(item).items()):
                setattr(item, name, replace(value))
            result = item
        else:
            result = item
        memo[id(item)] = result
        return result

    return replace(obj)
