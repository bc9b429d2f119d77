"""Precision policy: params stay float32; the forward/backward pass computes in a chosen dtype.

Floating params and floating batch fields are cast to the compute dtype inside the step, so
gradients flow back through the cast and arrive in float32; model outputs are cast back to
float32 before the loss, and updates apply to the float32 params.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcore._errors import ConfigError

PyTree = Any

_DTYPES = {
    "fp32": jnp.float32,
    "float32": jnp.float32,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "fp16": jnp.float16,
    "float16": jnp.float16,
}


def resolve_dtype(dtype: Any) -> Any:
    """A JAX dtype from a name (``fp32``, ``bf16``, ...), a dtype, or ``None`` (no cast).

    Example:
        >>> import jax.numpy as jnp
        >>> resolve_dtype("bf16") == jnp.bfloat16
        True
    """
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ConfigError(
                f"Unknown compute dtype {dtype!r}; expected one of {sorted(_DTYPES)}. "
                "Fix: set precision.compute_dtype to float32 or bfloat16."
            )
        return _DTYPES[dtype]
    return jnp.dtype(dtype)


def cast_floating(tree: PyTree, dtype: Any) -> PyTree:
    """Casts the floating leaves of ``tree`` to ``dtype`` (no-op when ``dtype`` is ``None``).

    Example:
        >>> import jax.numpy as jnp
        >>> t = cast_floating({"x": jnp.ones(2), "y": jnp.ones(2, jnp.int32)}, jnp.bfloat16)
        >>> str(t["x"].dtype), str(t["y"].dtype)
        ('bfloat16', 'int32')
    """
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)
