"""The messages of :mod:`torchshell.torch_model`: which op, which module, which source line."""

from __future__ import annotations

import re
import types
from collections.abc import Mapping
from typing import Any

import jax

from jaxcore._errors import JaxCoreError
from torchshell._errors import TorchModelError
from torchshell.trace._op_fixes import op_fix

DATA_DEPENDENT = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
    jax.errors.NonConcreteBooleanIndexError,  # x[mask] with a traced mask
)
FLAX_ROUTE = (
    "or take the Flax route: write the model in Flax (jaxcore.linen_model) and keep this "
    "nn.Module as its torch twin for export (docs/torch_model.md)."
)


# plain Python errors raised inside an op's lowering (torchax or JAX code under its dispatch)
_OP_FAILURES = (TypeError, ValueError, AttributeError, IndexError, KeyError, NotImplementedError)


def failing_op(err: BaseException) -> str | None:
    """The torch op whose lowering raised ``err`` (a plain Python error under torchax's
    dispatch of that op), else ``None``."""
    if type(err) not in _OP_FAILURES:  # (exactly: JAX's and our own errors subclass them)
        return None
    op = None
    tb: types.TracebackType | None = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "dispatch" and frame.f_code.co_filename.endswith(
            "torchax/tensor.py"
        ):
            func: Any = frame.f_locals.get("func")
            op = func.name() if hasattr(func, "name") else getattr(func, "__name__", str(func))
        tb = tb.tb_next
    return op


def lowering_site(err: BaseException) -> tuple[str, str, str] | None:
    """Where a value read in Python failed *inside* an op's torchax lowering, not in the
    user's code: ``(op, the lowering's line, which arguments are traced)``, else ``None``."""
    from torchshell.trace._paths import traced

    found: tuple[Any, dict[str, Any], str | None] | None = None  # (op, its locals, line)
    tb: types.TracebackType | None = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        name = frame.f_code.co_filename
        if frame.f_code.co_name == "dispatch" and name.endswith("torchax/tensor.py"):
            found = (frame.f_locals.get("func"), frame.f_locals, None)
        elif found is not None and "/torchax/ops/" in name:
            found = (found[0], found[1], f"{name.rsplit('/', 1)[-1]}:{tb.tb_lineno}")
        elif found is not None and "/torchax/" not in name and "/jax/" not in name:
            found = None  # the user's (or torch's) Python again: a read of theirs
        tb = tb.tb_next
    if found is None:
        return None
    func, local, line = found
    if line is None:
        return None
    op = func.name() if hasattr(func, "name") else getattr(func, "__name__", str(func))
    args = local.get("old_args", local.get("args", ()))
    kwargs = local.get("old_kwargs", local.get("kwargs", {})) or {}
    rest = [*list(args)[1:], *kwargs.values()]  # past the data: the op's parameters
    leaves = [x for x in jax.tree.leaves(rest) if hasattr(x, "_elem") or hasattr(x, "parent")]
    if leaves and not any(traced(x) for x in leaves):
        what = (
            "the value is a constant tensor passed where a number is read (not the weights, "
            "the batch or a random draw)"
        )
    elif leaves:
        what = (
            "a tensor argument there is traced: computed from the batch, the weights or a "
            "random draw"
        )
    else:
        what = "an intermediate value of the lowering itself is traced"
    return op, line, what


def is_lowering_error(err: BaseException) -> bool:
    """An error of tracing that :func:`lowering_error` explains."""
    return (
        type(err).__name__ == "OperatorNotFound"
        or isinstance(err, DATA_DEPENDENT)
        or (isinstance(err, AssertionError) and "mixed math" in str(err))
        or failing_op(err) is not None
        or is_raw(err)
    )


def is_raw(err: BaseException) -> bool:
    """An exception of torchax or JAX itself (its type, or raised in their code: torchax's
    ``assert``, ``lax.cond``'s ``TypeError``), which a user must never see raw."""
    if isinstance(err, TorchModelError):
        return False
    if isinstance(err, JaxCoreError):  # coreshell's own (jaxcore's BatchError...): as it is
        return False
    root = type(err).__module__.split(".")[0]
    if root in ("jax", "jaxlib", "torchax"):
        return True
    tb: types.TracebackType | None = err.__traceback__
    last = ""
    while tb is not None:
        last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return any(part in last for part in ("/torchax/", "/jax/", "/jaxlib/"))


def unlowered_op(err: BaseException) -> str | None:
    """The op torchax passed to its own kernel (a namespace it does not lower, such as
    ``torchaudio::rnnt_loss_forward``), where that kernel met a torchax tensor."""
    op = None
    tb: types.TracebackType | None = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if code.co_name == "__torch_dispatch__" and code.co_filename.endswith("torchax/tensor.py"):
            func: Any = frame.f_locals.get("func")
            op = func.name() if hasattr(func, "name") else getattr(func, "__name__", None)
        tb = tb.tb_next
    return op


_SOURCE = re.compile(r"depends on the value of the argument (\w)\[['\"]([^'\"]+)['\"]\]")
_KINDS = {"p": "weight", "s": "buffer"}


def read_source(err: BaseException) -> tuple[str, str] | None:
    """``("buffer"|"weight", state_dict name)`` whose value ``err`` says was read, if any.

    JAX names the traced argument a concrete value depended on (``s['queue_ptr']``: the
    step's model state, ``p[...]``: its params); see ``TorchModel._abstract``.
    """
    found = _SOURCE.search(str(err))
    if found is None or found.group(1) not in _KINDS:
        return None
    return _KINDS[found.group(1)], found.group(2)


def where(err: BaseException, names: Mapping[int, str]) -> tuple[str, str]:
    """The innermost submodule whose ``forward`` was running when ``err`` was raised."""
    path, site = "", ""
    tb: types.TracebackType | None = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code  # a method's first argument, whatever its name
        owner = tb.tb_frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if owner is not None and id(owner) in names:
            path = names[id(owner)] or "<root>"
            path = f"{path} ({type(owner).__name__})"
            site = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return path or "the traced code", site


def lowering_error(err: BaseException, names: Mapping[int, str], train: bool) -> TorchModelError:
    """A :class:`TorchModelError` for ``err`` naming the op, the module path and the line."""
    path, site = where(err, names)
    mode = "train" if train else "eval"
    at = f" at {site}" if site else ""
    if type(err).__name__ == "OperatorNotFound":
        found = re.search(r"name (\S+) has no lowering", str(err))
        op = found.group(1) if found else str(err)
        fix = op_fix(op, err) or (
            "Expected a forward made of ops torchax lowers to JAX. Fix: replace that layer "
            "with an equivalent made of supported ops, "
        )
        return TorchModelError(
            f"torchax cannot lower the op `{op}`, called in module {path}{at} ({mode} mode): "
            f"{fix}{FLAX_ROUTE}"
        )
    if (failed := failing_op(err)) is not None:
        fix = op_fix(failed, err) or (
            "Expected arguments its JAX lowering supports. Fix: call it with other arguments "
            "(or an equivalent op), "
        )
        return TorchModelError(
            f"torchax failed to lower the op `{failed}` with these arguments, called in module "
            f"{path}{at} ({mode} mode): {type(err).__name__}: {err}. {fix}{FLAX_ROUTE}"
        )
    if isinstance(err, jax.errors.NonConcreteBooleanIndexError):
        return TorchModelError(
            f"The forward of module {path}{at} ({mode} mode) indexes with a boolean mask that "
            "is traced (x[mask]: the result's shape depends on the mask's values), which a "
            "compiled JAX step cannot have. Expected shape-static code. Fix: use masks "
            "instead of boolean indexing (torch.where(mask, x, 0), or multiply by the mask), "
            f"{FLAX_ROUTE}"
        )
    if isinstance(err, DATA_DEPENDENT) and (inside := lowering_site(err)) is not None:
        op, line, args = inside
        return TorchModelError(
            f"torchax's lowering of the op `{op}` (at {line}) reads the value of one of its "
            f"arguments in Python, called in module {path}{at} ({mode} mode), and {args}. "
            "Expected Python numbers there (pad amounts, sizes, indices), or tensors "
            "computed only from constants (Python numbers, shapes, untrained buffers), "
            "which stay concrete. Fix: pass Python ints (e.g. from x.shape, or int(t) of a "
            f"constant tensor), {FLAX_ROUTE}"
        )
    if isinstance(err, DATA_DEPENDENT) and (read := read_source(err)) is not None:
        kind, name = read
        fix = (
            "keep it a tensor: index with it (`cols = (ptr + torch.arange(n)) % size; "
            "buf.index_copy_(dim, cols, values)` instead of `buf[:, int(ptr):int(ptr) + n] = "
            "values`; `ptr.add_(n).remainder_(size)`), pick with torch.where"
            if kind == "buffer"
            else "make the computation shape-static (torch.where instead of `if`, masks "
            "instead of boolean indexing)"
        )
        return TorchModelError(
            f"The forward of module {path}{at} ({mode} mode) needs a tensor's value in Python "
            f"({type(err).__name__}): it reads the {kind} `{name}` as a Python number "
            "(`int(t)`, `t.item()`, a slice bound or an `if` on it). In the compiled step the "
            f"{kind} is a traced value that changes as training goes, so no number exists for "
            f"it when the step is traced. Expected tensor arithmetic on it. Fix: {fix}, "
            f"{FLAX_ROUTE}"
        )
    if isinstance(err, DATA_DEPENDENT):
        return TorchModelError(
            f"The forward of module {path}{at} ({mode} mode) needs a tensor's value in Python "
            f"({type(err).__name__}: a number (int/float/shape) computed from the weights or "
            "a random draw), which a compiled JAX step cannot have. Traced bools branch "
            "(lax.cond) and batch scalars are specialised (found on a concrete batch: "
            "torch_model_fns(..., example=batch), or specialise_batch before "
            "jaxcore.init_train_state), but this is neither. Fix: make the computation "
            "shape-static (torch.where instead of `if`, masks instead of boolean indexing), "
            f"{FLAX_ROUTE}"
        )
    if "mixed math" not in str(err) and (op := unlowered_op(err)) is not None:
        return TorchModelError(
            f"torchax has no lowering for the op `{op}`, called in module {path}{at} ({mode} "
            "mode): torchax lowers aten (and torchvision) ops to JAX and hands any other op to "
            "its own C++ kernel, which cannot read traced JAX values (torchax said: "
            f"{type(err).__name__}: {str(err)[:120]}...). "
            + (
                op_fix(op, err)
                or "Expected a forward (and loss) made of ops torchax lowers. Fix: compute it "
                "with torch ops (or a JAX loss_fn), "
            )
            + FLAX_ROUTE
        )
    if is_raw(err) and "cond branches" in str(err):
        return TorchModelError(
            f"A traced Python bool (an `if` on a tensor value) in {path}{at} ({mode} mode) "
            "leads to outcomes that return different shapes or dtypes; each outcome is a "
            f"branch of one lax.cond, and JAX needs them to match ({str(err)[:200]}). "
            "Expected both outcomes to give tensors of the same shapes. Fix: compute both and "
            f"pick with torch.where, or keep the shapes equal, {FLAX_ROUTE}"
        )
    if is_raw(err) and "mixed math" not in str(err):
        failed = failing_op(err) or "an op"
        return TorchModelError(
            f"Tracing module {path}{at} ({mode} mode) failed inside torchax/JAX at {failed}: "
            f"{type(err).__name__}: {err}. Expected a forward torchax can trace. Fix: write "
            f"that line with other torch ops, {FLAX_ROUTE}"
        )
    return TorchModelError(
        f"The forward of module {path}{at} ({mode} mode) mixes a plain CPU torch.Tensor with "
        f"the traced ones ({err}). Fix: register tensors the module keeps as buffers "
        "(self.register_buffer(name, t, persistent=False)) instead of plain attributes, "
        f"{FLAX_ROUTE}"
    )
