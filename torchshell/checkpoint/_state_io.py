"""What a :class:`JaxModule` puts into a Lightning checkpoint dict, and takes back out.

- RNG states of torch, numpy and Python (so a resumed run draws the same augmentations).
- The whole JAX ``TrainState`` as torch tensors, keyed by pytree path, when the checkpoint is
  an ordinary file (Lightning's default ``TorchCheckpointIO``): a plain ``Trainer`` can then
  ``fit(ckpt_path=...)`` exactly. Under :class:`~torchshell.checkpoint.OrbaxCheckpointIO`
  (the CLI) Orbax writes the state beside the dict instead. Tensors and plain types only,
  so Lightning and ``load_from_checkpoint`` read it with ``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import Any

import jax
import numpy as np
import torch

import bridge
from torchshell._errors import CheckpointError

__all__ = ["load_rng", "save_rng", "state_from_tensors", "state_to_tensors"]

STATE_KEY = "coreshell_state"
_RNG_KEY = "coreshell_rng"


def save_rng(checkpoint: dict[str, Any]) -> None:
    """Adds the torch, numpy and Python RNG states to ``checkpoint``."""
    name, keys, *rest = np.random.get_state()
    checkpoint[_RNG_KEY] = {
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(np.asarray(keys).astype(np.int64)), *rest],
        "python": random.getstate(),
    }


def load_rng(checkpoint: dict[str, Any]) -> None:
    """Restores the RNG states :func:`save_rng` wrote (nothing when absent)."""
    rng = checkpoint.get(_RNG_KEY)
    if rng is None:
        return
    torch.set_rng_state(rng["torch"])
    name, keys, *rest = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def state_to_tensors(state: Any) -> dict[str, torch.Tensor]:
    """The JAX state as ``{pytree path: torch.Tensor}`` (host copies, typed keys as data).

    Example:
        >>> import jax.numpy as jnp
        >>> sorted(state_to_tensors({"w": jnp.ones(2), "k": jax.random.key(0)}))
        ["['k']", "['w']"]
    """
    if jax.process_count() > 1:
        raise CheckpointError(
            "Embedding the JAX state in a Lightning checkpoint file needs one process, got "
            f"{jax.process_count()}. Fix: use torchshell.checkpoint.OrbaxCheckpointIO as the "
            "Trainer's checkpoint plugin (the CLI does), which writes sharded state."
        )
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        value = jax.random.key_data(leaf) if _is_key(leaf) else leaf
        out[jax.tree_util.keystr(path)] = bridge.as_torch(value).clone()
    return out


def state_from_tensors(tensors: dict[str, torch.Tensor], template: Any) -> Any:
    """The JAX state back from :func:`state_to_tensors`, placed like ``template``.

    Raises:
        CheckpointError: paths or shapes that do not match ``template`` (another model).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    wanted = {jax.tree_util.keystr(p) for p, _ in flat}
    if wanted != set(tensors):
        only_ckpt = sorted(set(tensors) - wanted)[:3]
        only_model = sorted(wanted - set(tensors))[:3]
        raise CheckpointError(
            f"The checkpoint's JAX state belongs to another model: paths only in the "
            f"checkpoint {only_ckpt}, only in this model {only_model}. Fix: resume with the "
            "model and optimizer it was written with, or start without ckpt_path."
        )
    leaves = []
    for path, ref in flat:
        t = tensors[jax.tree_util.keystr(path)]
        if _is_key(ref):
            data = jax.device_put(bridge.as_jax(t), ref.sharding)
            leaves.append(jax.random.wrap_key_data(data, impl=jax.random.key_impl(ref)))
            continue
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(
                f"The checkpoint's JAX state has {jax.tree_util.keystr(path)} of shape "
                f"{tuple(t.shape)}, this model {tuple(ref.shape)}. Fix: resume with the model "
                "it was written with."
            )
        array = bridge.as_jax(t, name=jax.tree_util.keystr(path))
        leaves.append(jax.device_put(array.astype(ref.dtype), ref.sharding))
    return jax.tree_util.tree_unflatten(treedef, leaves)
