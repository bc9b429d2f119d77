"""Start-up: importing coreshell's packages loads only what they use (issue 41)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# heavy packages a Flax run does not use: the model zoo's (transformers, torchvision), the
# torch-model path's tracer (torchax) and the speech recipe's features (torchaudio)
UNUSED = ("transformers", "torchvision", "torchax", "torchaudio")


def _loaded_after(statement: str) -> list[str]:
    """The packages of ``UNUSED`` in ``sys.modules`` after ``statement`` in a fresh process."""
    shown = f"print(json.dumps(sorted(set({UNUSED!r}) & set(sys.modules))))"
    code = f"import json, sys\n{statement}\n{shown}"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "statement",
    [
        "import torchshell",
        "import torchshell.app.cli",  # what `coreshell` runs before it reads the config
        "import torchshell.data, torchshell.export, torchshell.torch_model, jaxcore, bridge",
    ],
)
def test_importing_coreshell_loads_no_unused_heavy_package(statement: str):
    assert _loaded_after(statement) == []
