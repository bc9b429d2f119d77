"""Packaging and architecture rules of DESIGN.md."""

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxcore", "bridge", "torchshell")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(
    tree: ast.AST, name: str, is_package: bool, modules: set[str] | None = None
) -> set[str]:
    """Modules a module imports when it runs (function-local imports included,
    ``if TYPE_CHECKING:`` blocks left out); ``from pkg import sub`` names the submodule
    ``pkg.sub`` alone when it is one of ``modules``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")
                parent = parent if is_package else parent[:-1]
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            subs = {f"{base}.{alias.name}" for alias in node.names}
            known = subs & modules if modules is not None else subs
            found.update(known)
            found.add(base)  # (``from pkg import sub`` runs ``pkg/__init__`` first)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    """``{module: modules of the three packages it imports}`` over jaxcore, bridge, torchshell."""
    files = {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        imports = _runtime_imports(tree, name, path.name == "__init__.py", set(files))
        graph[name] = {m for m in imports if m in files and m != name}
    return graph


def _cycle(graph: dict[str, set[str]], package: str) -> list[str] | None:
    """A cycle of imports among the modules of ``package``, or None."""
    inside = {m: {d for d in deps if d.split(".")[0] == package} for m, deps in graph.items()}
    inside = {m: deps for m, deps in inside.items() if m.split(".")[0] == package}
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(inside.get(m, ())):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (found := walk(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(inside):
        if m not in state and (found := walk(m)):
            return found
    return None


def test_no_import_cycle_inside_a_package():
    graph = _graph()
    for package in PACKAGES:
        assert _cycle(graph, package) is None, f"{package}: " + " -> ".join(
            _cycle(graph, package) or []
        )


def test_cycle_finder_finds_a_function_local_cycle():
    tree = ast.parse("def f():\n    from torchshell.app.cli import main\n")
    assert "torchshell.app.cli" in _runtime_imports(tree, "torchshell.app.doctor", False)
    graph = {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": set()}
    assert _cycle(graph, "p") == ["p.a", "p.b", "p.a"]


def test_the_library_never_imports_the_app():
    graph = _graph()
    library = {m: deps for m, deps in graph.items() if m.startswith("torchshell")}
    offenders = {
        m: sorted(d for d in deps if d == "torchshell.app" or d.startswith("torchshell.app."))
        for m, deps in library.items()
        if not (m == "torchshell.app" or m.startswith("torchshell.app."))
    }
    assert {m: d for m, d in offenders.items() if d} == {}
    # Hydra is the app's: the library takes plain values
    hydra_users = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "torchshell").rglob("*.py")
        if "app" not in p.relative_to(ROOT / "torchshell").parts
        and re.search(r"^\s*(import|from)\s+hydra\b", p.read_text(), re.M)
    }
    assert hydra_users == set()


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
    assert "torchshell/conf/recipe/digits.yaml" in names
    assert "torchshell/app/cli.py" in names and "torchshell/tracking/_logger.py" in names
    assert not any(n.startswith("conf/") for n in names)
    assert any(n.endswith("entry_points.txt") for n in names)
    packages = [n for n in files if n.split("/")[0] in PACKAGES and n.endswith("/__init__.py")]
    missing = [n for n in packages if n not in names]
    assert not missing, f"not in the wheel (list them in pyproject.toml's packages): {missing}"


def test_from_lightning_is_a_jax_module_with_an_adapter_no_port_class():
    """``from_lightning``'s optimizer mapping, checkpoint layout, log names, evaluation, manual
    steps and the user's own hooks are groups its adapter owns (``adapter.optim``, ...,
    ``adapter.hooks``; issue #37): the module is a plain ``JaxModule``, no port class in its
    MRO; ``torchshell.module`` imports the port and the adapters, never the reverse."""
    import lightning as L
    import torch

    from torchshell.module import JaxModule
    from torchshell.port import LightningAdapter

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 2)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = JaxModule.from_lightning(Tiny(), print_summary=False)
    assert type(module) is JaxModule and isinstance(module.adapter, LightningAdapter)
    assert not [c for c in type(module).__mro__ if c.__module__.startswith("torchshell.port")]
    graph = _graph()  # (arrows: module -> port -> adapters, module -> adapters)
    below = {
        "torchshell.port": ("torchshell.module",),
        "torchshell.adapters": ("torchshell.module", "torchshell.port"),
    }
    wrong = {
        m: sorted(d for d in deps if d.startswith(below[package]))
        for package in below
        for m, deps in graph.items()
        if m == package or m.startswith(package + ".")
    }
    assert not {m: d for m, d in wrong.items() if d}, wrong


def test_jax_module_is_one_class_over_lightning_module_no_mixins():
    """``JaxModule`` holds its Lightning hooks itself, each handing over to its adapter or to a
    function of the module (issue #37: no mixin stack, no shared attribute bag): its MRO holds
    one coreshell class, and every module under ``torchshell/module`` defines at most it."""
    import inspect

    import lightning as L

    import torchshell.module as package
    from torchshell.module import JaxModule

    ours = [c for c in JaxModule.__mro__ if c.__module__.startswith("torchshell")]
    assert ours == [JaxModule]
    assert JaxModule.__bases__ == (L.LightningModule,)
    subclasses = [
        (name, cls.__name__)
        for name, mod in inspect.getmembers(package, inspect.ismodule)
        for cls in vars(mod).values()
        if isinstance(cls, type)
        and issubclass(cls, L.LightningModule)
        and cls.__module__ == mod.__name__
        and cls is not JaxModule
    ]
    assert not subclasses, subclasses
