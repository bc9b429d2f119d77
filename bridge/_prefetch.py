"""Device prefetch: hand the next batch to JAX on a background thread while a step runs."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from jax.sharding import Sharding

from bridge._batch import to_jax
from bridge._errors import PrefetchError
from bridge._stats import TransferStats
from bridge._tree import PyTree

_POLL_S = 0.1


class _End:
    """Marks the end of the source iterator."""


class _Raised:
    """Carries an exception from the producer thread to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher(Iterator[PyTree]):
    """Iterator over ``to_jax(batch, ...)`` of a source iterator, ``size`` batches ahead.

    One daemon thread pulls from the source and transfers; the consumer gets the batches in
    the source's order. An exception raised by the source (or by the transfer) is re-raised
    in the consumer at the position it happened, with its original traceback. ``close()``
    (or leaving a ``with`` block, or dropping the iterator) stops the thread.

    Use :func:`prefetch` to build one.
    """

    def __init__(
        self,
        source: Iterable[PyTree],
        size: int,
        sharding: Sharding | None,
        transfer_kwargs: dict[str, Any],
    ) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=self._produce,
            args=(iter(source), sharding, transfer_kwargs),
            name="bridge-prefetch",
            daemon=True,
        )
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _produce(
        self, source: Iterator[PyTree], sharding: Sharding | None, kwargs: dict[str, Any]
    ) -> None:
        try:
            for batch in source:
                if not self._put(to_jax(batch, sharding, **kwargs)):
                    return
        except BaseException as error:  # handed to the consumer, which re-raises it
            self._put(_Raised(error))
            return
        self._put(_End())

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> PyTree:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise StopIteration from None
        if isinstance(item, _End):
            self.close()
            raise StopIteration
        if isinstance(item, _Raised):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stops the producer thread and drops batches not yet consumed."""
        self._done = True
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self._stop.set()


def prefetch(
    iterator: Iterable[PyTree],
    size: int = 2,
    sharding: Sharding | None = None,
    *,
    pad_to: int | None = None,
    strict: bool = False,
    stats: TransferStats | None = None,
) -> Prefetcher:
    """Transfers batches to JAX ahead of the consumer, on a background thread.

    While the current step runs, the next ``size`` batches are pulled from ``iterator``
    (e.g. a DataLoader) and handed over with :func:`bridge.to_jax`, so their transfer (and
    the loader's own work in the main process) overlaps the step. Order is kept; the
    loader's exceptions are re-raised in the consumer.

    Args:
        iterator: any iterable of batches (pytrees of torch tensors).
        size: batches held ahead (memory grows with it); at least 1.
        sharding: passed to :func:`bridge.to_jax`.
        pad_to: passed to :func:`bridge.to_jax`.
        strict: passed to :func:`bridge.to_jax`.
        stats: passed to :func:`bridge.to_jax` (updated from the background thread).

    Returns:
        A :class:`Prefetcher`: an iterator of transferred batches with ``close()``.

    Raises:
        PrefetchError: when ``size`` is not a positive int.

    Example:
        >>> import torch
        >>> batches = [{"x": torch.full((2,), float(i))} for i in range(3)]
        >>> with prefetch(batches) as it:
        ...     [float(b["x"][0]) for b in it]
        [0.0, 1.0, 2.0]
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise PrefetchError(
            f"prefetch(size=...) is how many batches to hold ahead and must be an int >= 1; "
            f"got {size!r}. Fix: use size=2 (the default) or larger."
        )
    return Prefetcher(
        iterator, size, sharding, {"pad_to": pad_to, "strict": strict, "stats": stats}
    )
