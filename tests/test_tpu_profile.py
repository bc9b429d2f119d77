"""benchmarks/tpu_profile.py's summary of a profiler trace (a small synthetic one: the real
traces come from a TPU)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from benchmarks.tpu_profile import summary


def _trace(path: Path) -> None:
    meta = [
        {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:TPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 3, "tid": 1, "args": {"name": "XLA Modules"}},
        {"ph": "M", "name": "thread_name", "pid": 3, "tid": 2, "args": {"name": "XLA Ops"}},
    ]
    events = []
    for run in range(3):  # three runs of the step (100 us each), one small eager program
        t = run * 1000.0
        events.append({"ph": "X", "pid": 3, "tid": 1, "ts": t, "dur": 100.0, "name": "jit_step(1)"})
        for name, dur, cat, src in [
            ("fusion.1", 60.0, "convolution fusion", "/x/site-packages/flax/linen/linear.py:287"),
            ("custom-call.2", 30.0, "custom-call", "jaxcore/models/attention.py:220"),
            ("copy.3", 10.0, "data formatting", ""),
        ]:
            args = {"hlo_category": cat, "source": src, "long_name": f"%{name} = bf16[8]"}
            events.append(
                {"ph": "X", "pid": 3, "tid": 2, "ts": t + 1, "dur": dur, "name": name, "args": args}
            )
    events.append({"ph": "X", "pid": 3, "tid": 1, "ts": 5000.0, "dur": 5.0, "name": "jit_add(2)"})
    events.append({"ph": "X", "pid": 3, "tid": 2, "ts": 5001.0, "dur": 5.0, "name": "add.1"})
    events.append({"ph": "X", "pid": 9, "tid": 7, "ts": 0.0, "dur": 9e6, "name": "host work"})
    path.mkdir(parents=True)
    with gzip.open(path / "vm.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_summary_names_the_busiest_program_its_categories_and_source_lines(tmp_path: Path) -> None:
    _trace(tmp_path / "plugins" / "profile" / "1")
    text = summary(tmp_path, top=5)
    assert "jit_step(1): 3 runs, 0.10 ms each" in text
    assert "0.10 ms per run" in text
    assert "convolution fusion" in text and "60.0%" in text  # of the step's op time
    assert "flax/linen/linear.py:287 [convolution fusion]" in text  # the venv prefix cut
    assert "add.1" not in text  # the eager program's op is not the step's


def test_a_trace_without_accelerator_lanes_says_so(tmp_path: Path) -> None:
    path = tmp_path / "plugins" / "profile" / "1"
    path.mkdir(parents=True)
    with gzip.open(path / "vm.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": []}, f)
    assert "no accelerator lanes" in summary(tmp_path, top=5)
