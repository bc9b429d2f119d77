"""The doctor's shape checks: the twin on the sample batch, both models on every bucket."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchshell.app._doctor_checks import FAIL, OK, Check, _abstract_state, _fmt


def _variable_axes(twin: Any, count: int) -> list[set[int]]:
    """Per input, the axes the twin declares free (``dynamic_axes``): the batch by default."""
    axes = getattr(twin, "dynamic_axes", None) or [{0: "batch"}] * count
    return [set(spec) for spec in axes] + [{0}] * max(count - len(axes), 0)


def _run_twin(twin: Any, args: Sequence[Any]) -> Any:
    import torch

    with torch.no_grad():
        return twin.eval()(*args)


def _sample_checks(batch: dict[str, Any], module: Any, twin: Any, inputs: Sequence[str]) -> Check:
    fields = ", ".join(f"{k}: {_fmt(v)}" for k, v in batch.items())
    problems = []
    missing = [k for k in inputs if k not in batch]
    if missing:
        problems.append(
            f"the model reads {list(inputs)} but the batch has {sorted(batch)} (missing "
            f"{missing}). Fix: rename the fields in the Dataset/collate or set model.inputs"
        )
    make = getattr(twin, "example_input", None)
    if callable(make) and not missing:
        example = make()
        example = tuple(example) if isinstance(example, (tuple, list)) else (example,)
        free = _variable_axes(twin, len(example))
        for name, want, axes in zip(inputs, example, free, strict=False):
            got = batch[name]
            same = (
                got.dtype == want.dtype
                and got.dim() == want.dim()
                and all(got.shape[i] == want.shape[i] for i in range(got.dim()) if i not in axes)
            )
            if not same:
                problems.append(
                    f"field {name!r}: the torch twin expects {_fmt(want)} (axes "
                    f"{sorted(axes)} free), the data gives {_fmt(got)}. Fix: make the "
                    "Dataset produce that shape and dtype, or change the model config to the "
                    "data's"
                )
        if not problems:  # the twin itself on two real rows: what the export will serve
            try:
                _run_twin(twin, [batch[k][:2] for k in inputs])
            except Exception as err:  # any error here is the finding
                problems.append(
                    f"the torch twin does not run on the data's batch ({type(err).__name__}: "
                    f"{err}). Fix: make the twin's forward accept the data's shapes"
                )
    if problems:
        return Check("sample batch", FAIL, f"{fields}; " + "; ".join(problems))
    return Check("sample batch", OK, fields)


def _bucketed(batch: dict[str, Any], buckets: Sequence[int]) -> tuple[int, list[str]]:
    """The sample batch's bucket (its axis-1 size among ``buckets``) and the fields with it."""
    for size in buckets:
        names = [k for k, v in batch.items() if v.dim() >= 2 and v.shape[1] == size]
        if names:
            return size, names
    return 0, []


def _to_bucket(t: Any, size: int) -> Any:
    """``t`` cropped or zero-padded (False for a mask) along axis 1 to ``size``."""
    import torch

    if t.shape[1] >= size:
        return t[:, :size].contiguous()
    pad = torch.zeros((t.shape[0], size - t.shape[1], *t.shape[2:]), dtype=t.dtype)
    return torch.cat([t, pad], dim=1)


def _buckets(
    data: Any, batch: dict[str, Any], module: Any, twin: Any, inputs: Sequence[str], jbatch: Any
) -> Check | None:
    """The JAX model (traced, no FLOPs) and the torch twin (two rows) on every length bucket.

    Returns:
        None for data without length buckets.
    """
    import jax

    buckets = tuple(getattr(data, "buckets", None) or ())
    if not buckets:
        return None
    size, names = _bucketed(batch, buckets)
    if not names:
        return Check(
            "buckets",
            FAIL,
            f"data.buckets={list(buckets)}, but no field of the sample batch has one of those "
            f"sizes on axis 1 ({', '.join(f'{k}: {_fmt(v)}' for k, v in batch.items())}). "
            "Fix: collate every batch to one of data.buckets.",
        )
    abstract = _abstract_state(module, jbatch)
    outputs, failures = [], []
    for bucket in buckets:
        shaped = {k: (_to_bucket(v, bucket) if k in names else v) for k, v in batch.items()}
        structs = {
            k: jax.ShapeDtypeStruct(
                (v.shape[0], bucket, *v.shape[2:]) if k in names else v.shape, v.dtype
            )
            for k, v in jbatch.items()
        }

        def forward(state: Any, b: Any, key: Any) -> Any:
            out, _ = module.model_fns.apply(state["params"], state["model_state"], b, key, False)
            return out, module.loss_fn(out, b)

        try:
            out, _ = jax.eval_shape(forward, abstract, structs, jax.random.key(0))
            got = _run_twin(twin, [shaped[k][:2] for k in inputs]) if twin is not None else None
        except Exception as err:  # any error here is the finding
            failures.append(f"{bucket} frames: {type(err).__name__}: {err}")
            continue
        jax_shape = list(getattr(out, "shape", ()))
        torch_shape = list(getattr(got, "shape", ())) if got is not None else None
        if torch_shape is not None and jax_shape[1:] != torch_shape[1:]:
            failures.append(
                f"{bucket} frames: the JAX model gives {jax_shape}, the torch twin {torch_shape}"
            )
        outputs.append(f"{bucket} -> {jax_shape}")
    detail = (
        f"fields {names} on axis 1, buckets {list(buckets)} (the sample is {size}): "
        + ", ".join(outputs)
    )
    if failures:
        return Check(
            "buckets",
            FAIL,
            detail + "; " + "; ".join(failures) + ". Fix: make the model run on every "
            "bucket length, or set data.buckets to lengths it runs on.",
        )
    return Check("buckets", OK, detail + " (JAX model and torch twin)")
