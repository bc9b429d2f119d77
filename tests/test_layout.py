"""Packaging and architecture rules of DESIGN.md."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(package: str) -> set[str]:
    pattern = re.compile(r"^\s*(?:import|from)\s+([a-zA-Z_]\w*)", re.M)
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        found |= set(pattern.findall(path.read_text()))
    return found


def test_package_rules():
    assert not _imports("jaxcore") & {
        "torch",
        "torchaudio",
        "lightning",
        "mlflow",
        "hydra",
        "bridge",
        "torchshell",
    }
    assert not _imports("bridge") & {"lightning", "mlflow", "hydra", "torchshell"}


def test_wheel_ships_conf_inside_torchshell(tmp_path: Path):
    # Build from a copy of the tracked sources: setuptools writes build/ beside the sources.
    src = tmp_path / "src"
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("coreshell-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "torchshell/conf/config.yaml" in names
    assert "torchshell/conf/data/digits.yaml" in names
    assert not any(n.startswith("conf/") for n in names)
    assert any(n.endswith("entry_points.txt") for n in names)
