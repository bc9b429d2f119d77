"""torch's dtype refusals in a traced step: matmuls and convolutions whose operands differ in
dtype raise as torch raises (``mat1 and mat2 must have the same dtype``), where JAX would
promote silently (a bf16 batch into an fp32 ``nn.Linear``); :func:`reduced_compute` marks the
traced calls that compute in a reduced dtype (bf16-mixed, a ``torch.autocast`` region,
``bf16-true``), where fp32 buffers may meet bf16 inputs as under torch's autocast.
:func:`_module_site` names the user's module a refusal happened in (the other refusals of
``trace/`` use it too).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import torch

from torchshell._errors import TorchModelError
from torchshell.trace._autocast import mixed_precision
from torchshell.trace._float64 import host_dtype_names, narrowed_weights

__all__ = ["install_dtype_checks", "reduced_compute"]

# -- refusals ---------------------------------------------------------------------------

_TORCH_NAMES = {"float32": "Float", "float64": "Double", "float16": "Half"}
_TORCH_NAMES |= {"bfloat16": "BFloat16", "int32": "Int", "int64": "Long"}


def _dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def _module_site() -> str:
    """The innermost ``nn.Module`` whose method is running, by its path in the traced one
    (``encoder.0 (Linear)``), and the line it runs."""
    from torchshell.trace._paths import Bound

    found: list[tuple[torch.nn.Module, str]] = []
    root: torch.nn.Module | None = None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if isinstance(owner, Bound) and root is None:
            root = owner.m  # the module the tracer was given
        elif (
            isinstance(owner, torch.nn.Module)
            and root is None
            and (not found or found[-1][0] is not owner)  # (not its ``_call_impl`` frames)
        ):
            found.append((owner, f"{code.co_filename}:{frame.f_lineno}"))
        frame = frame.f_back  # type: ignore[assignment]
    if not found:
        return "the traced code"
    inner, site = found[0]
    root = root if root is not None else found[-1][0]
    path = next((n for n, m in root.named_modules() if m is inner), "") or "<root>"
    caller = f", called from {found[1][1]}" if len(found) > 1 else ""
    return f"module {path} ({type(inner).__name__}) at {site}{caller}"


def _same_dtypes(name: str, names: Sequence[str], func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` (a lowering of op ``name``, arguments ``names``) refusing tensor operands of
    different dtypes."""
    conv = "conv" in name

    @functools.wraps(func)
    def checked(*args: Any, **kwargs: Any) -> Any:
        given = {**dict(zip(names, args, strict=False)), **kwargs}  # (defaults not given)
        tensors = {k: v for k, v in given.items() if hasattr(v, "dtype") and hasattr(v, "shape")}
        if len({_dtype_name(v) for v in tensors.values()}) > 1 and not _REDUCED.get():
            raise _mixed(name, tensors, conv)
        hosts = host_dtype_names(tensors)  # a float64 batch field (JAX: float32)
        if len(set(hosts.values())) > 1 and not _REDUCED.get():
            raise _mixed(name, tensors, conv, hosts)
        return func(*args, **kwargs)

    return checked


_REDUCED: contextvars.ContextVar[bool] = contextvars.ContextVar("reduced_compute", default=False)


@contextlib.contextmanager
def reduced_compute(params: Any, params0: Any) -> Iterator[None]:
    """Marks a traced call whose params are cast from the module's dtype (bf16 compute): as
    under ``torch.autocast``, :func:`_same_dtypes` then lets fp32 buffers meet bf16 inputs.
    So does Lightning's ``precision="bf16-true"`` context (torch's default dtype bfloat16,
    the batch cast to it), where a trace on the float32 weights alone (the first batch's
    look for host reads) meets the bfloat16 batch the compiled step casts the weights to.

    Example:
        >>> with reduced_compute({"w": jnp.ones(2, jnp.bfloat16)}, {"w": jnp.ones(2)}):
        ...     _REDUCED.get()
        True
    """
    lowered = any(
        k in params0
        and jnp.dtype(v.dtype) in (jnp.bfloat16, jnp.float16)
        and jnp.dtype(params0[k].dtype) == jnp.float32
        for k, v in params.items()
    )
    cast = torch.get_default_dtype() == torch.bfloat16 or any(
        k in params0 and jnp.dtype(v.dtype) != jnp.dtype(params0[k].dtype)
        for k, v in params.items()
    )
    token = _REDUCED.set(cast or narrowed_weights(params0))  # (a .double() module)
    # float32 weights computed in bfloat16: precision="bf16-mixed", torch's autocast region
    mixed = mixed_precision(lowered and torch.get_default_dtype() == torch.float32)
    try:
        with mixed:
            yield
    finally:
        _REDUCED.reset(token)


def _mixed(
    op: str, tensors: dict[str, Any], conv: bool, dtypes: dict[str, str] | None = None
) -> TorchModelError:
    dtypes = dtypes or {k: _dtype_name(v) for k, v in tensors.items()}
    first, *rest = dtypes
    other = next(k for k in rest if dtypes[k] != dtypes[first])
    a, b = (_TORCH_NAMES.get(dtypes[k], dtypes[k]) for k in (first, other))
    said = (
        f"Input type ({a}) and {other} type ({b}) should be the same"
        if conv
        else f"mat1 and mat2 must have the same dtype, but got {a} and {b}"
    )
    listed = ", ".join(f"{k} {v}" for k, v in dtypes.items())
    return TorchModelError(
        f"`{op}` in {_module_site()} got operands of different dtypes ({listed}); plain "
        f"torch raises '{said}', and coreshell does not promote them silently. Expected "
        f"the input in the layer's dtype ({dtypes[other]} here). Fix: cast the batch field "
        f"in the Dataset or collate (x.to(torch.{dtypes[other]})), or at the top of "
        f"forward, or cast the module to the input's dtype (module.to(torch.{dtypes[first]}))."
    )


# aten ops (``x @ w``, ``torch.bmm``, the convolutions), as ``name.overload``
# fmt: off
_DTYPE_CHECKED = (
    "mm.default", "addmm.default", "bmm.default", "baddbmm.default", "addbmm.default",
    "matmul.default", "linear.default", "dot.default", "mv.default", "addmv.default",
    "convolution.default", "conv1d.default", "conv2d.default", "conv3d.default",
    "conv1d.padding", "conv2d.padding", "conv3d.padding", "conv_transpose1d.default",
    "conv_transpose2d.input", "conv_transpose3d.input",
)
# fmt: on


_FUNCTIONS: dict[Callable[..., Any], str] = {
    torch.nn.functional.linear: "F.linear",
    torch.conv1d: "F.conv1d",
    torch.conv2d: "F.conv2d",
    torch.conv3d: "F.conv3d",
    torch.conv_transpose1d: "F.conv_transpose1d",
    torch.conv_transpose2d: "F.conv_transpose2d",
    torch.conv_transpose3d: "F.conv_transpose3d",
}


def install_dtype_checks(env: Any, put: Callable[..., None]) -> None:
    """Wraps whatever lowers each matmul and convolution in ``env`` (registered before this
    runs) with the dtype check; ``put(op, func, jax_fn=, needs_env=, view=)`` registers."""
    aten = torch.ops.aten
    for name in _DTYPE_CHECKED:
        packet, overload = name.split(".")
        op = getattr(getattr(aten, packet), overload)
        found = env._ops.get(op) or env._ops.get(op.overloadpacket)
        found = found or env._decomps.get(op) or env._decomps.get(op.overloadpacket)
        if found is not None:
            names = [a.name for a in op._schema.arguments]
            put(op, _same_dtypes(op._schema.name, names, found.func), jax_fn=found.is_jax_function,
                needs_env=found.needs_env, view=found.is_view_op)  # fmt: skip
    # torch functions torchax runs before any aten op: ``F.linear`` (its own JAX einsum,
    # which promotes), ``F.conv*d`` (torch's C++ check raised a bare RuntimeError)
    for function, name in _FUNCTIONS.items():
        found = env._ops.get(function)
        func = found.func if found is not None else function
        jax_fn = found.is_jax_function if found is not None else False
        needs_env = found.needs_env if found is not None else False
        put(function, _same_dtypes(name, ("input", "weight", "bias"), func), jax_fn=jax_fn,
            needs_env=needs_env)  # fmt: skip
