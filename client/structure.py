"""Finding batch references in nested structures and replacing them with tensors.

Only what holds a reference is touched: lists, dicts and objects with attributes are updated in
place, tuples, named tuples and frozen dataclasses are rebuilt, as DALI's proxy does. Anything
without a reference below it is returned as it is. Shared and cyclic structures are visited once.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Callable, Iterable
from typing import Any

from .refs import DALIOutputBatchRef, DALIPipelineRunRef

_LEAVES = (str, bytes, bytearray, memoryview, int, float, complex, bool, type(None))
_NOT_CONTAINERS = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    enum.Enum,
)

Resolver = Callable[[list[DALIPipelineRunRef]], dict[int, tuple[Any, ...]]]


def _is_plain_object(obj: Any) -> bool:
    # Tensors and arrays have attributes too, but never hold references.
    if isinstance(obj, _NOT_CONTAINERS) or not hasattr(obj, "__dict__"):
        return False
    return not type(obj).__module__.startswith(("torch", "numpy"))


def _is_frozen_dataclass(obj: Any) -> bool:
    params = getattr(type(obj), "__dataclass_params__", None)
    return params is not None and bool(params.frozen)


def _children(obj: Any) -> Iterable[Any]:
    if isinstance(obj, list | tuple):
        return obj
    if isinstance(obj, dict):
        return obj.values()
    if _is_plain_object(obj):
        attributes: dict[str, Any] = vars(obj)
        return attributes.values()
    return ()


def _scan(item: Any, runs: dict[int, DALIPipelineRunRef], holds: dict[int, bool]) -> bool:
    """Whether ``item`` holds a reference; records runs in order and the answer per object."""
    if isinstance(item, _LEAVES):
        return False
    key = id(item)
    if key in holds:
        return holds[key]
    if isinstance(item, DALIOutputBatchRef):
        runs.setdefault(id(item.pipe_run_ref), item.pipe_run_ref)
        holds[key] = True
        return True
    holds[key] = False  # until proven otherwise; also ends cycles
    found = False
    for child in _children(item):
        found = _scan(child, runs, holds) or found
    holds[key] = found
    return found


def find_runs(obj: Any) -> list[DALIPipelineRunRef]:
    """The distinct pipeline runs referenced anywhere in ``obj``, in the order first met."""
    runs: dict[int, DALIPipelineRunRef] = {}
    _scan(obj, runs, {})
    return list(runs.values())


def replace_refs(obj: Any, resolve: Resolver) -> Any:
    """``obj`` with each batch reference replaced by ``resolve``'s output for it."""
    runs: dict[int, DALIPipelineRunRef] = {}
    holds: dict[int, bool] = {}
    if not _scan(obj, runs, holds):
        return obj
    return _replace(obj, resolve(list(runs.values())), holds, {})


# A module-level function, not a closure: a recursive closure is a reference cycle, which would
# keep the produced tensors (and so the daemon's regions) alive until the cyclic GC runs.
def _replace(
    item: Any, outputs: dict[int, tuple[Any, ...]], holds: dict[int, bool], memo: dict[int, Any]
) -> Any:
    key = id(item)
    if not holds.get(key, False):
        return item
    if key in memo:
        return memo[key]
    result: Any
    if isinstance(item, DALIOutputBatchRef):
        result = outputs[id(item.pipe_run_ref)][item.output_idx]
    elif isinstance(item, list):
        memo[key] = item
        item[:] = [_replace(value, outputs, holds, memo) for value in item]
        result = item
    elif isinstance(item, dict):
        memo[key] = item
        for name in list(item):
            item[name] = _replace(item[name], outputs, holds, memo)
        result = item
    elif isinstance(item, tuple):
        values = [_replace(value, outputs, holds, memo) for value in item]
        if hasattr(item, "_fields"):
            result = type(item)(*values)
        elif type(item) is tuple:
            result = tuple(values)
        else:
            result = type(item)(values)
    elif _is_frozen_dataclass(item):
        changes = {
            field.name: _replace(getattr(item, field.name), outputs, holds, memo)
            for field in dataclasses.fields(item)
        }
        result = dataclasses.replace(item, **changes)
    else:
        memo[key] = item
        for name, value in list(vars(item).items()):
            setattr(item, name, _replace(value, outputs, holds, memo))
        result = item
    memo[key] = result
    return result


def take_rows(obj: Any, batch_size: int, rows: list[int], untouched: set[int]) -> Any:
    """``obj`` with each field that has one row per sample made of the rows ``rows``, in order.

    Such a field is a tensor or numpy array whose first dimension is ``batch_size``, or a list
    or tuple of ``batch_size`` plain values (strings, numbers): what torch's default collate
    makes of labels, file names and the like. Leaving rows out drops samples; repeating one
    stands it in for another. Containers are updated in place or rebuilt as in
    :func:`replace_refs`; objects whose id is in ``untouched`` (the outputs of the batch, which
    the daemon already made so) are returned as they are.
    """
    import numpy as np
    import torch

    index = torch.tensor(rows, dtype=torch.long)

    def per_sample(item: Any) -> bool:
        if isinstance(item, torch.Tensor | np.ndarray):
            return item.ndim > 0 and item.shape[0] == batch_size
        return (
            isinstance(item, list | tuple)
            and not hasattr(item, "_fields")
            and len(item) == batch_size
            and all(isinstance(value, _LEAVES) for value in item)
        )

    def visit(item: Any, memo: dict[int, Any]) -> Any:
        key = id(item)
        if key in untouched or isinstance(item, _LEAVES):
            return item
        if key in memo:
            return memo[key]
        result: Any
        if per_sample(item):
            if isinstance(item, torch.Tensor):
                result = item.index_select(0, index.to(item.device))
            elif isinstance(item, np.ndarray):
                result = item[rows]
            else:
                result = type(item)([item[row] for row in rows])
        elif isinstance(item, list):
            memo[key] = item
            item[:] = [visit(value, memo) for value in item]
            result = item
        elif isinstance(item, dict):
            memo[key] = item
            for name in list(item):
                item[name] = visit(item[name], memo)
            result = item
        elif isinstance(item, tuple):
            values = [visit(value, memo) for value in item]
            if hasattr(item, "_fields"):
                result = type(item)(*values)
            else:
                result = tuple(values) if type(item) is tuple else type(item)(values)
        elif _is_frozen_dataclass(item):
            changes = {f.name: visit(getattr(item, f.name), memo) for f in dataclasses.fields(item)}
            result = dataclasses.replace(item, **changes)
        elif _is_plain_object(item):
            memo[key] = item
            for name, value in list(vars(item).items()):
                setattr(item, name, visit(value, memo))
            result = item
        else:
            result = item
        memo[key] = result
        return result

    return visit(obj, {})
