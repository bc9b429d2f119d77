"""float64 under JAX's x64 off: the module's weights and the batch's fields.

JAX runs with x64 off, so float64 reaches the compiled step as float32. Two things torch
does with float64 were lost, silently:

- a module made ``.double()`` (scientific code) trains in float64 in torch; here it trains
  in float32 and its weights come back float64 after ``fit`` at float32 precision:
  :func:`weight_as_jax` says so with a ``RuntimeWarning``;
- a float64 batch field (numpy arrays or Python floats through ``default_collate``) fed to a
  float32 layer: torch raises ``mat1 and mat2 must have the same dtype, but got Double and
  Float``; here it trained. The bridge remembers which fields were float64 on the host
  (:func:`bridge.handed_over`), and :func:`host_dtype_names` gives the traced matmuls and
  convolutions those dtypes, so they refuse it as torch does (:mod:`._ops`) unless the
  module's own weights were float64 (:func:`narrowed_weights`; a float64 non-persistent
  buffer, a constant of the trace, counts as float64 too).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import jax
import torch

import bridge
import jaxcore

_NARROWED: dict[int, weakref.ref[Any]] = {}


def weight_as_jax(t: torch.Tensor) -> Any:
    """A JAX copy of a module's weight or buffer (:func:`bridge.as_jax`); a float64 one is
    narrowed to float32 with a ``RuntimeWarning`` (see the top) and remembered."""
    out = bridge.as_jax(t, name="a weight or buffer")
    if t.dtype != torch.float64 or jax.config.read("jax_enable_x64"):
        return out
    warnings.warn(
        "coreshell: the module holds float64 weights or buffers (module.double(), a float64 "
        "tensor); JAX runs with x64 off, so the compiled step computes them in float32 (torch "
        "computes in float64) and they come back float64 after fit, at float32 precision. "
        "Fix: train in float32 (module.float(), and .float() on float64 batch fields such as "
        "numpy arrays or Python floats from the Dataset).",
        RuntimeWarning,
        stacklevel=4,
    )
    key = id(out)
    _NARROWED[key] = weakref.ref(out, lambda _: _NARROWED.pop(key, None))
    return out


def any_narrowed() -> bool:
    """Whether a float64 module's weights were narrowed (and live): its float32 outputs
    stand for torch's float64 ones."""
    return any(ref() is not None for ref in _NARROWED.values())


def narrowed_weights(params: dict[str, Any]) -> bool:
    """Whether any of ``params`` (a tracer's initial weights) was a float64 weight."""
    return any(_is_narrowed(v) for v in params.values())


def host_dtype_names(tensors: dict[str, Any]) -> dict[str, str]:
    """``{name: dtype}`` of traced operands, a batch field handed over from float64 (and a
    float64 constant) named ``float64``, every other one its own dtype."""
    names = {}
    for name, value in tensors.items():
        origin = bridge.handed_over(_concrete(value))
        wide = origin is not None and origin.dtype == torch.float64
        wide = wide or _is_narrowed(getattr(value, "_elem", value))  # a float64 constant
        names[name] = "float64" if wide else str(value.dtype).removeprefix("torch.")
    return names


def _is_narrowed(array: Any) -> bool:
    ref = _NARROWED.get(id(array))
    return ref is not None and ref() is array


def _concrete(target: Any) -> Any:
    """The JAX array the bridge returned that ``target`` (a torchax tensor, a JAX array or
    tracer) is, where it is one."""
    value = getattr(target, "_elem", target)  # (a torchax tensor's array)
    if isinstance(value, jax.core.Tracer):
        return jaxcore.concrete_of(value)
    return value
