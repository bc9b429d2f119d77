"""An opt-in Prometheus endpoint of a training run: what an operator scrapes and alerts on.

:class:`PrometheusMetrics` is a Lightning callback. On process 0 it serves ``/metrics`` from
its own registry (``prometheus_client``'s HTTP server, a daemon thread) for the length of
``fit``, bound to ``127.0.0.1`` unless told otherwise, and stops the server when fit ends.
The gauges are read from what the run already computes, on the host: the optimizer step after
every batch; loss, samples/s, the data-wait fraction and recompiles at each logging step
(``trainer.callback_metrics``, which :class:`~torchshell.JaxModule` fills); the seconds since
the newest committed checkpoint are computed at scrape time from its manifest.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
from lightning.pytorch import Callback
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from torchshell._errors import TrackingError
from torchshell.adapters._logs import OWN
from torchshell.checkpoint import _files as files

# gauge name -> (help text, the keys in trainer.callback_metrics it follows, first found wins:
# the Flax/torch path's model loss is train/loss, the Lightning port's system/coreshell.train.loss)
_FROM_LOGS = {
    "coreshell_train_loss": (
        "Training loss at the last logging step.",
        ("train/loss", f"{OWN}train.loss"),
    ),
    "coreshell_samples_per_second": (
        "Training samples per second.",
        (f"{OWN}perf.samples_per_s",),
    ),
    "coreshell_data_wait_fraction": (
        "Fraction of wall time the loop waited for the DataLoader.",
        (f"{OWN}perf.data_wait_fraction",),
    ),
    "coreshell_recompiles": (
        "Recompilations of the train step.",
        (f"{OWN}compile.recompiles",),
    ),
}


def _checkpoint_age(directory: Path | None) -> float:
    """Seconds since the newest committed checkpoint in ``directory`` (NaN when none)."""
    if directory is None:
        return math.nan
    for path in files.candidates(directory):
        manifest = path / files.MANIFEST
        try:
            return max(0.0, time.time() - manifest.stat().st_mtime)
        except FileNotFoundError:  # being removed, or not committed: the previous one
            continue
    return math.nan


class PrometheusMetrics(Callback):
    """Serves the run's gauges for Prometheus on ``http://HOST:PORT/metrics`` during ``fit``.

    Gauges: ``coreshell_step``, ``coreshell_train_loss``, ``coreshell_samples_per_second``,
    ``coreshell_data_wait_fraction``, ``coreshell_recompiles``,
    ``coreshell_seconds_since_checkpoint`` (NaN before the first committed checkpoint).
    Only process 0 serves (``jax.process_index() == 0``); elsewhere it does nothing.

    Args:
        port: the TCP port (``0``: a free one, see :attr:`port` once started).
        host: the address to bind; ``127.0.0.1`` keeps it on this machine.
        checkpoint_dir: where the run's checkpoints go (``ckpt.dir``), or None.

    Example:
        >>> import urllib.request
        >>> prom = PrometheusMetrics(port=0)
        >>> prom.start()
        >>> prom.set_step(7)
        >>> url = f"http://127.0.0.1:{prom.port}/metrics"
        >>> b"coreshell_step 7.0" in urllib.request.urlopen(url, timeout=10).read()
        True
        >>> prom.stop()
    """

    def __init__(
        self, port: int, *, host: str = "127.0.0.1", checkpoint_dir: str | Path | None = None
    ) -> None:
        if not 0 <= port < 65536:
            raise TrackingError(
                f"tracking.prometheus_port must be a TCP port (0-65535; 0 picks a free one) "
                f"or null (off); got {port}. Fix: pass e.g. tracking.prometheus_port=9090."
            )
        self.port = port
        self.host = host
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.registry = CollectorRegistry()
        self._step = Gauge("coreshell_step", "Optimizer steps done.", registry=self.registry)
        self._gauges = {
            keys: Gauge(name, text, registry=self.registry)
            for name, (text, keys) in _FROM_LOGS.items()
        }
        for gauge in self._gauges.values():
            gauge.set(math.nan)
        age = Gauge(
            "coreshell_seconds_since_checkpoint",
            "Seconds since the newest committed checkpoint (NaN: none yet).",
            registry=self.registry,
        )
        age.set_function(lambda: _checkpoint_age(self.checkpoint_dir))
        self._server: Any = None
        self._thread: Any = None

    @property
    def running(self) -> bool:
        """Whether the HTTP server is up."""
        return self._server is not None

    def start(self) -> None:
        """Starts the HTTP server (in a daemon thread); a no-op when running already."""
        if self._server is not None:
            return
        try:
            self._server, self._thread = start_http_server(
                self.port, addr=self.host, registry=self.registry
            )
        except OSError as err:
            raise TrackingError(
                f"Could not serve Prometheus metrics on {self.host}:{self.port}: "
                f"{err.strerror or err}. Fix: pick a free port (tracking.prometheus_port=, "
                "0 for any), or tracking.prometheus_port=null to turn it off."
            ) from err
        self.port = int(self._server.server_port)

    def stop(self) -> None:
        """Stops the HTTP server and frees its port."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(timeout=10)

    def set_step(self, step: int) -> None:
        """Sets ``coreshell_step``."""
        self._step.set(step)

    def update(self, metrics: dict[str, Any]) -> None:
        """Sets the gauges that follow ``metrics`` (a logging step's values)."""
        for keys, gauge in self._gauges.items():
            key = next((k for k in keys if k in metrics), None)
            if key is not None:
                gauge.set(float(metrics[key]))

    # -- Lightning hooks ---------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and jax.process_index() == 0:
            self.start()
            print(f"coreshell: Prometheus metrics on http://{self.host}:{self.port}/metrics")
            sys.stdout.flush()

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self._server is not None:
            self._step.set(trainer.global_step)
            self.update(trainer.callback_metrics)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.stop()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.stop()


__all__ = ["PrometheusMetrics"]
