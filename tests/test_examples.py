"""The runnable examples of docs/ run here, on tiny settings."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_port_lightning_example_trains_and_exports():
    spec = importlib.util.spec_from_file_location("port", ROOT / "examples/port_lightning.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["port"] = module  # Flax modules are dataclasses: their module must be known
    spec.loader.exec_module(module)
    assert module.main(max_steps=150) > 0.85
