"""Asynchronous checkpoints: the loop goes on during the write, donated buffers are never
read, the commit is still atomic, removals and errors wait for it, leftovers are swept."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from torchshell._errors import CheckpointError
from torchshell.checkpoint import (
    CheckpointOnSigterm,
    OrbaxCheckpointIO,
    latest_checkpoint,
    restore_state,
    verify,
)
from torchshell.checkpoint import _files as files

# Big enough that the background write outlasts the steps run meanwhile (32 MiB).
N = 8_000_000


@jax.jit
def _init() -> dict[str, jax.Array]:
    return {"w": jnp.arange(N, dtype=jnp.float32), "n": jnp.int32(0)}


@jax.jit
def _step_fn(s: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {"w": s["w"] * 1.5 + 1.0, "n": s["n"] + 1}


_step = jax.jit(_step_fn, donate_argnums=0)  # like jaxcore's train step: the state is donated


class _Run:
    """A state that steps with donation and an OrbaxCheckpointIO that saves it."""

    def __init__(self) -> None:
        self.state = _step(_init())
        self.io = OrbaxCheckpointIO(lambda: self.state, lambda _: None)

    def host(self) -> tuple[np.ndarray, int]:
        return np.array(self.state["w"]), int(self.state["n"])


def test_async_save_owns_its_copy_while_the_loop_donates_the_state(tmp_path: Path):
    run = _Run()
    expected_w, expected_n = run.host()
    path = tmp_path / "epoch=0-step=1.ckpt"
    run.io.save_checkpoint({"step": 1}, path)
    assert not path.exists()  # returned before the commit: the write goes on in the background
    saved = run.state
    for _ in range(5):  # the loop goes on while the state is written
        run.state = _step(run.state)
    assert saved["w"].is_deleted()  # the step really donated the buffers that were saved
    run.io.wait_until_finished()
    assert verify(path) is None
    restored = restore_state(path / "state", run.state)
    assert int(restored["n"]) == expected_n
    assert np.array_equal(np.asarray(restored["w"]), expected_w)  # bit-identical
    run.io.teardown()


def test_readers_and_the_next_save_wait_for_the_save_in_flight(tmp_path: Path):
    run = _Run()
    first, second = tmp_path / "epoch=0-step=1.ckpt", tmp_path / "epoch=0-step=2.ckpt"
    run.io.save_checkpoint({"step": 1}, first)
    assert verify(first) is None  # a reader in this process waits for the commit
    run.state = _step(run.state)
    run.io.save_checkpoint({"step": 2}, second)
    assert latest_checkpoint(tmp_path) == second
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, second.name]
    run.io.teardown()


def test_an_old_checkpoint_is_removed_only_after_the_new_one_is_committed(tmp_path: Path):
    run = _Run()
    old, new = tmp_path / "epoch=0-step=1.ckpt", tmp_path / "epoch=0-step=2.ckpt"
    run.io.save_checkpoint({"step": 1}, old)
    run.io.save_checkpoint({"step": 2}, new)
    run.io.remove_checkpoint(old)  # Lightning with ckpt.keep=1, while `new` is written
    assert (old / files.MANIFEST).is_file() or (new / files.MANIFEST).is_file()
    run.io.wait_until_finished()
    assert not old.exists() and verify(new) is None
    assert [p.name for p in tmp_path.iterdir()] == [new.name]
    run.io.teardown()


def test_a_background_failure_is_raised_at_the_next_save_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    run = _Run()
    previous = tmp_path / "epoch=0-step=1.ckpt"
    run.io.save_checkpoint({"step": 1}, previous)
    run.io.wait_until_finished()

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "commit", full)
    run.io.save_checkpoint({"step": 2}, tmp_path / "epoch=0-step=2.ckpt")
    with pytest.raises(CheckpointError) as err:
        run.io.save_checkpoint({"step": 3}, tmp_path / "epoch=0-step=3.ckpt")
    msg = str(err.value)
    assert "step=2" in msg and "No space left" in msg and "Fix:" in msg
    assert [p.name for p in tmp_path.iterdir()] == [previous.name]
    assert verify(previous) is None
    run.io.teardown()


def test_leftovers_of_killed_saves_and_removals_are_swept_at_the_next_start(tmp_path: Path):
    run = _Run()
    intact = tmp_path / "epoch=0-step=1.ckpt"
    run.io.save_checkpoint({"step": 1}, intact)
    run.io.teardown()
    killed_save = tmp_path / ".tmp-epoch=0-step=2.ckpt-0123abcd"
    (killed_save / "state").mkdir(parents=True)
    (killed_save / "lightning.pt").write_bytes(b"half")
    killed_removal = tmp_path / ".old-epoch=0-step=0.ckpt-89abcdef"
    killed_removal.mkdir()
    (killed_removal / "lightning.pt").write_bytes(b"")
    messages: list[str] = []
    callback = CheckpointOnSigterm(tmp_path)
    # What Lightning calls at the start of fit (the callback is always on in `coreshell train`).
    callback.setup(None, None, "fit")
    assert [p.name for p in tmp_path.iterdir()] == [intact.name]
    assert verify(intact) is None
    files.sweep(tmp_path, log=messages.append)
    assert messages == []  # nothing left to sweep


def test_the_export_hook_runs_off_the_training_thread_on_the_saved_copy(tmp_path: Path):
    """The torch export of a checkpoint is written in the commit thread from the device copy
    being saved: the training thread returns before it, and it sees the state at the save,
    not the state the loop donated meanwhile."""
    run = _Run()
    expected_w, expected_n = run.host()
    seen: dict[str, Any] = {}
    started = threading.Event()

    def export(directory: Path, state: Any) -> None:
        started.set()
        seen["thread"] = threading.current_thread()
        (directory / "export").mkdir()
        np.save(directory / "export" / "w.npy", np.asarray(state["w"]))
        seen["n"] = int(state["n"])

    run.io = OrbaxCheckpointIO(lambda: run.state, lambda _: None, export=export)
    path = tmp_path / "epoch=0-step=1.ckpt"
    run.io.save_checkpoint({"step": 1}, path)
    for _ in range(5):  # the loop donates the live state meanwhile
        run.state = _step(run.state)
    run.io.wait_until_finished()
    assert started.is_set() and seen["thread"] is not threading.main_thread()
    assert seen["n"] == expected_n
    assert np.array_equal(np.load(path / "export" / "w.npy"), expected_w)
    assert verify(path) is None  # the export's file is in the manifest
    assert "export/w.npy" in (path / files.MANIFEST).read_text()

    def broken(directory: Path, state: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    run.io = OrbaxCheckpointIO(lambda: run.state, lambda _: None, export=broken)
    run.io.save_checkpoint({"step": 2}, tmp_path / "epoch=0-step=2.ckpt")
    with pytest.raises(CheckpointError, match=r"step=2.*No space left"):
        run.io.teardown()  # the end of fit raises the background failure
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # nothing partial


def _mixed_state(width: int = 16) -> dict[str, Any]:
    """Small and large arrays of several dtypes, a scalar and a typed PRNG key."""
    k = jax.random.key(3)
    return {
        "params": {
            "w": jax.random.normal(k, (width, 8)),
            "b": jnp.arange(8, dtype=jnp.float32),
            "emb": jax.random.normal(k, (300_000,)),  # 1.2 MB: saved as it is
        },
        "half": jnp.linspace(0, 1, 6, dtype=jnp.bfloat16),
        "step": jnp.int32(7),
        "rng": jax.random.key(11),
        "norms": [jnp.full((4,), float(i)) for i in range(30)],
    }


def test_small_arrays_are_saved_packed_and_restored_bit_identically(tmp_path: Path):
    """Orbax's cost is per array: the async save writes small arrays as one per dtype
    (here 5 arrays for 6 leaves + 30 small ones), with the layout in the checkpoint's
    metadata."""
    import orbax.checkpoint as ocp

    state = _mixed_state()
    io = OrbaxCheckpointIO(lambda: state, lambda _: None)
    path = tmp_path / "epoch=0-step=7.ckpt"
    io.save_checkpoint({"step": 7}, path)
    io.teardown()
    with ocp.StandardCheckpointer() as ckptr:
        saved = ckptr.metadata((path / "state").absolute()).item_metadata.tree
    assert len(jax.tree.leaves(saved)) == 5  # float32, bfloat16, int32, uint32 (key), the big
    template = jax.tree.map(lambda x: x, _mixed_state())
    template["params"]["w"] = template["params"]["w"] * 0
    restored = restore_state(path / "state", template)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(CheckpointError, match=r"shapes differ.*params/w \(16, 8\) vs \(32, 8\)"):
        restore_state(path / "state", _mixed_state(width=32))
