"""Checkpoints of a :class:`JaxModule` run: the JAX state through Orbax, the loop through Lightning.

Each checkpoint is a directory written atomically (a temporary directory, then a rename)::

    epoch=0-step=100.ckpt/
        state/            Orbax: the whole jaxcore TrainState (saved asynchronously: its
                          arrays under 1 MB packed into one per dtype, the layout in
                          Orbax's custom metadata; :mod:`._packed_state`)
        lightning.pt      Lightning's loop, callback and DataLoader state; RNG states
                          (tensors and plain types only: loaded with weights_only=True)
        export/model.safetensors, config.yaml   written by an ``on_save``/``export`` hook
        manifest.json     sha256 of every file above, written last

Saves are asynchronous (one JAX process): the state is first copied on its devices (the
next train step donates the state's buffers, so the write must own its copy), Orbax writes
the copy in the background, and a commit thread runs the ``export`` hook on the same copy
(the torch weights), then writes the manifest and renames the directory when Orbax is done;
the step loop goes on meanwhile. The next save, a removal of
the checkpoint being written, the end of fit and every reader in this process (``verify``,
``latest_checkpoint``) wait for it. A kill at any point leaves ``.tmp-*``/``.old-*``
directories no reader picks; the next run's start sweeps them.

With several JAX processes (``torchshell.distributed``) saves are synchronous: every process
writes its shards of the state into the same directory; process 0 writes the other files and
commits the rename.
"""

from torchshell.checkpoint._orbax import (
    MANIFEST,
    CheckpointOnSigterm,
    OrbaxCheckpointIO,
    latest_checkpoint,
    restore_state,
    save_state,
    sweep_leftovers,
    verify,
)

__all__ = [
    "MANIFEST",
    "CheckpointOnSigterm",
    "OrbaxCheckpointIO",
    "latest_checkpoint",
    "restore_state",
    "save_state",
    "sweep_leftovers",
    "verify",
]
