"""System metrics (CPU, memory, disk, network, GPU) sampled by MLflow's own monitors.

MLflow's ``SystemMetricsMonitor`` logs synchronously through its own client; here its
monitors feed the asynchronous logger instead, so the samples survive an outage too.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchshell.tracking._logger import AsyncMLflowLogger


def _monitors() -> list[Any]:
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    monitors: list[Any] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    try:
        from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

        monitors.append(GPUMonitor())
    except Exception:  # no NVIDIA GPU or no pynvml: CPU metrics only
        pass
    return monitors


class SystemMetrics:
    """Samples system metrics every ``interval_s`` into ``logger`` as ``system/*`` metrics.

    Args:
        logger: the run's :class:`AsyncMLflowLogger`.
        interval_s: seconds between samples (the step of each sample counts from 0).

    Example:
        >>> import tempfile
        >>> from torchshell.tracking import AsyncMLflowLogger
        >>> lg = AsyncMLflowLogger("demo", tracking_uri=f"sqlite:///{tempfile.mkdtemp()}/m.db")
        >>> sampler = SystemMetrics(lg, interval_s=60.0)
        >>> sampler.sample() > 0, sampler.stop(), lg.close().complete
        (True, None, True)
    """

    def __init__(self, logger: AsyncMLflowLogger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._monitors = _monitors()
        self._step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="system-metrics", daemon=True)
        if logger.enabled:
            self._thread.start()

    def sample(self) -> int:
        """Takes one sample now and queues it; returns the number of metrics queued."""
        values: dict[str, float] = {}
        for monitor in self._monitors:
            try:
                monitor.collect_metrics()
                values |= {f"system/{k}": float(v) for k, v in monitor.aggregate_metrics().items()}
                monitor.clear_metrics()
            except Exception:  # a monitor that fails is skipped
                continue
        self.logger.log_metrics(values, step=self._step)
        self._step += 1
        return len(values)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.logger.closed:
                return
            self.sample()

    def stop(self) -> None:
        """Stops sampling (before the logger is closed)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
