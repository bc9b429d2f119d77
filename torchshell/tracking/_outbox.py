"""An ordered, bounded outbox of tracking records that spills to a local JSONL file.

The training thread appends records; the delivery thread takes the oldest chunk, sends it and
acknowledges it. Order is kept across the three places a record can be in, oldest first:
the chunk in flight, the spill file, the in-memory tail. When the in-memory tail grows past
``max_in_memory`` records it is appended to the spill file, so memory stays bounded however
long the tracking server is away.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

Record = dict[str, Any]
Chooser = Callable[[Iterator[Record]], int]


class Outbox:
    """A FIFO of JSON-serialisable records: in memory up to a bound, then on disk.

    Args:
        spill_path: the JSONL file that holds records past the in-memory bound.
        max_in_memory: records kept in memory before they are spilled.

    Example:
        >>> import tempfile, pathlib
        >>> box = Outbox(pathlib.Path(tempfile.mkdtemp()) / "spill.jsonl", max_in_memory=2)
        >>> box.extend([{"i": i} for i in range(5)])
        >>> box.spilled_total, len(box)
        (5, 5)
        >>> chunk = box.take(lambda it: 3)
        >>> [r["i"] for r in chunk], box.ack(), len(box)
        ([0, 1, 2], None, 2)
    """

    def __init__(self, spill_path: Path, *, max_in_memory: int = 50_000) -> None:
        self.spill_path = spill_path
        self.max_in_memory = max_in_memory
        self.spilled_total = 0  # records that ever went to disk
        self._lock = threading.Lock()
        self._memory: deque[Record] = deque()
        self._inflight: list[Record] = []
        self._file_count = 0  # undelivered records in the spill file
        self._file_offset = 0  # byte offset of the first undelivered record
        self._next_offset = 0  # where the in-flight chunk read from the file ends
        self._taken_from_file = 0  # how many spill-file records the in-flight chunk came from

    def __len__(self) -> int:
        with self._lock:
            return len(self._inflight) + self._file_count + len(self._memory)

    def extend(self, records: Iterable[Record]) -> None:
        """Appends records at the tail (called from the producing thread)."""
        with self._lock:
            self._memory.extend(records)
            if len(self._memory) > self.max_in_memory:
                self._spill_memory()

    def _spill_memory(self) -> None:
        self.spill_path.parent.mkdir(parents=True, exist_ok=True)
        with self.spill_path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in self._memory)
        self._file_count += len(self._memory)
        self.spilled_total += len(self._memory)
        self._memory.clear()

    def take(self, choose: Chooser) -> list[Record]:
        """The oldest chunk, not yet removed: the chunk in flight again, or a new one.

        Args:
            choose: given an iterator over the oldest records, returns how many form a chunk
                (at least one when there is any).

        Returns:
            The chunk; empty when there is nothing to send. Call :meth:`ack` once delivered.
        """
        with self._lock:
            if self._inflight:
                return list(self._inflight)
            if self._file_count:
                records, ends = self._read_file(choose)
                self._next_offset, self._taken_from_file = ends, len(records)
            else:
                n = choose(iter(self._memory)) if self._memory else 0
                records = [self._memory.popleft() for _ in range(n)]
            self._inflight = records
            return list(records)

    def _read_file(self, choose: Chooser) -> tuple[list[Record], int]:
        with self.spill_path.open("rb") as f:
            f.seek(self._file_offset)
            lines = [f.readline() for _ in range(min(self._file_count, 1000))]
        records = [json.loads(line) for line in lines]
        n = choose(iter(records))
        return records[:n], self._file_offset + sum(len(line) for line in lines[:n])

    def ack(self) -> None:
        """Removes the chunk in flight: it was delivered (or given up on)."""
        with self._lock:
            if self._taken_from_file:
                self._file_count -= self._taken_from_file
                self._file_offset = self._next_offset
                self._next_offset = self._taken_from_file = 0
                if self._file_count == 0:
                    self.spill_path.unlink(missing_ok=True)
                    self._file_offset = 0
            self._inflight = []

    def replace_inflight(self, records: list[Record]) -> None:
        """Shrinks the chunk in flight to its undelivered tail (after a partial delivery)."""
        with self._lock:
            self._inflight = list(records)

    def drain(self) -> list[Record]:
        """Removes and returns everything still queued, oldest first."""
        with self._lock:
            out = list(self._inflight)
            if self._file_count:
                with self.spill_path.open("rb") as f:
                    f.seek(self._next_offset if self._taken_from_file else self._file_offset)
                    out += [json.loads(line) for line in islice(f, None)]
                self.spill_path.unlink(missing_ok=True)
            out += self._memory
            self._inflight, self._memory = [], deque()
            self._file_count = self._file_offset = self._next_offset = self._taken_from_file = 0
            return out
