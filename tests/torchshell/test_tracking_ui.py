"""Where MLflow's UI shows coreshell's telemetry: after the user's own metrics (issue #54).

MLflow 3.17.2's run page (its bundled JavaScript, ``mlflow/server/js/build``) charts, in the
Model metrics tab, every metric whose key does not start with ``system/``, and the others in
the System metrics tab. Charts are grouped in sections named by the key's path before its
last ``/`` (``train/loss`` -> ``train``); named sections come sorted, then "Model metrics"
(keys with no ``/``), then "System metrics" (keys ``system/NAME``, one ``/``). So coreshell
names its telemetry ``system/coreshell.GROUP.NAME`` (``torchshell.adapters._logs.OWN``): in
the System metrics tab, and in the "System metrics" section after everything else wherever
both kinds are charted (the experiment's chart view). Before, ``coreshell/bridge/copies``
made the sections ``coreshell/bridge``, ``coreshell/compile``, ``coreshell/perf``, sorted
before ``test``, ``train`` and ``val``.

:func:`sections` is that rule in Python; the first test checks that the installed bundle
still holds it. Run as a script for a screenshot of a run's page (headless Chromium, from
Debian's ``chromium`` package): ``python -m tests.torchshell.test_tracking_ui STORE RUN_ID
OUT.png`` (``STORE``: the run's ``sqlite:///...`` URI).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import mlflow

SYSTEM = "system/"


def sections(keys: Iterable[str], tab: str = "model") -> list[tuple[str, list[str]]]:
    """The chart sections of MLflow's run page tab (``model`` or ``system``), in order, with
    their keys sorted (``getBaseChartAndSectionConfigs`` and ``extractChartSectionName``).

    Example:
        >>> sections(["val/loss", "epoch", "train/loss", "system/coreshell.perf.steps_per_s"])
        [('train', ['train/loss']), ('val', ['val/loss']), ('Model metrics', ['epoch'])]
    """
    shown = sorted(k for k in keys if k.startswith(SYSTEM) == (tab == "system"))
    named: dict[str, list[str]] = {}
    for key in shown:
        prefix = "/".join(key.split("/")[:-1])
        name = (
            "Model metrics" if prefix == "" else "System metrics" if prefix == "system" else prefix
        )
        named.setdefault(name, []).append(key)
    last = ("Model metrics", "System metrics")
    order = sorted(n for n in named if n not in last) + [n for n in last if n in named]
    return [(n, named[n]) for n in order]


def test_the_installed_mlflow_ui_charts_system_keys_apart_and_last():
    """The rules :func:`sections` mirrors, in the installed MLflow's bundle."""
    build = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    text = "".join(p.read_text(errors="replace") for p in build.glob("*.js"))
    assert 'const B="system/",j="System metrics",V="",q="Model metrics"' in text
    # the run page's tabs: "model" shows the keys not starting with system/, "system" the rest
    tabs = r'filterMetricNames:e=>\{const t=e\.startsWith\(\w+\.qt\);return"model"===n\?!t:t\}'
    assert re.search(tabs, text)
    # a section is the path before the last "/"; "" is Model metrics, "system" System metrics
    assert "split(t).slice(0,-1).join(t);return o===i.QB?i.NN:o+t===i.qt?i.rx:o}" in text
    # named sections sorted, then Model metrics, then System metrics
    assert "[...Object.keys(w).filter(e=>e!==i.NN&&e!==i.rx).sort(),...[i.NN,i.rx]" in text


def test_coreshell_telemetry_comes_after_the_users_metrics():
    """A run's keys as coreshell logs them: the Model metrics tab opens on the user's
    sections, coreshell's figures are in the System metrics section (last in the experiment
    view, where both tabs' keys are charted together)."""
    from torchshell.adapters._logs import OWN

    user = ["train/loss", "train/accuracy", "train/lr", "val/loss", "test/accuracy", "epoch"]
    ours = [
        f"{OWN}{k}"
        for k in (
            "bridge.copied_bytes",
            "bridge.copies",
            "compile.compile_seconds",
            "perf.steps_per_s",
            "export.parity_max_abs_diff",
        )
    ]
    keys = user + ours + ["system/cpu_utilization_percentage"]
    assert [n for n, _ in sections(keys)] == ["test", "train", "val", "Model metrics"]
    assert sections(keys, "system") == [("System metrics", [*sorted(ours), keys[-1]])]
    both = [n for n, _ in sections(keys, "model") + sections(keys, "system")]
    assert both[-1] == "System metrics"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_MLFLOW_SERVER = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--workers", "1"]
# as root (here) Chromium needs --no-sandbox; the virtual time lets the page's scripts load
_HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
_HEADLESS += ["--window-size=1400,1600", "--virtual-time-budget=30000"]


def screenshot(store: str, run_id: str, out: Path, tab: str = "model-metrics") -> Path:
    """A headless Chromium screenshot of the run's page (``tab``) served by ``mlflow
    server`` on 127.0.0.1 from ``store``."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium: apt-get install chromium (Debian's package)")
    port = _free_port()
    client = mlflow.MlflowClient(store)
    experiment = client.get_run(run_id).info.experiment_id
    server = subprocess.Popen(
        [*_MLFLOW_SERVER, "--backend-store-uri", store, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        url = f"http://127.0.0.1:{port}/#/experiments/{experiment}/runs/{run_id}/{tab}"
        subprocess.run(
            [chromium, *_HEADLESS, f"--screenshot={out}", url],
            check=True,
            capture_output=True,
            timeout=180,
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
    return out


if __name__ == "__main__":
    store_uri, run, png = sys.argv[1:4]
    for page in ("model-metrics", "system-metrics"):
        path = Path(png).with_name(f"{Path(png).stem}-{page}.png")
        print(screenshot(store_uri, run, path, page))
