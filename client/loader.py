"""A torch DataLoader whose batches come out with dalid references replaced by tensors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from torch.utils import data as torchdata


class Producer(Protocol):
    def produce_data(self, obj: Any) -> Any: ...


class _ProducingIterator:
    """Wraps torch's loader iterator; each batch goes through ``produce_data`` on its way out."""

    def __init__(self, inner: Iterator[Any], producer: Producer) -> None:
        self._inner = inner
        self._producer = producer

    def __iter__(self) -> _ProducingIterator:
        return self

    def __next__(self) -> Any:
        return self._producer.produce_data(next(self._inner))

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]


class DataLoader(torchdata.DataLoader):
    """``torch.utils.data.DataLoader`` with a dalid session (or DALIServer) as first argument.

    Works with any ``num_workers``, including 0, and with persistent workers.
    """

    def __init__(self, session: Producer, dataset: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.session = session

    def __iter__(self) -> _ProducingIterator:  # type: ignore[override]
        return _ProducingIterator(super().__iter__(), self.session)
