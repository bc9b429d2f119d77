"""Checking: one error that lists every missing/unexpected key and shape/dtype clash."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping

import torch

from bridge._errors import StateDictError


def check(
    found: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
    found_name: str,
    expected_name: str,
    optional: Collection[str] = (),
) -> None:
    """Raises one StateDictError listing every missing/unexpected key and shape/dtype clash."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected) - set(optional))
    shapes, dtypes = [], []
    for k in sorted(set(found) & set(expected)):
        (fs, fd), (es, ed) = found[k], expected[k]
        if fs != es:
            hint = ""
            if sorted(fs) == sorted(es):
                hint = (
                    "  (kernel looks transposed: same dims in another order; Dense kernels are "
                    "(in, out) and Linear weights (out, in), conv kernels (*spatial, in, out) "
                    "and ConvNd weights (out, in, *spatial))"
                )
            shapes.append(f"    {k}: {found_name} {fs} vs {expected_name} {es}{hint}")
        elif fd is not None and ed is not None and fd != ed:
            dtypes.append(f"    {k}: {found_name} {fd} vs {expected_name} {ed}")
    if not (missing or unexpected or shapes or dtypes):
        return
    lines = [f"The {found_name} does not match the {expected_name} key for key:"]
    if missing:
        lines.append(f"  missing keys (expected by the {expected_name}, not in the {found_name}):")
        close = {m: difflib.get_close_matches(m, unexpected, n=1) for m in missing}
        lines += [
            f"    {m}" + (f"  (did you mean {c[0]!r}?)" if c else "") for m, c in close.items()
        ]
    if unexpected:
        lines.append(
            f"  unexpected keys (in the {found_name}, not expected by the {expected_name}):"
        )
        lines += [f"    {k}" for k in unexpected]
    if any(k.endswith(("running_mean", "running_var")) for k in missing + unexpected):
        lines.append(
            "  BatchNorm statistics appear on one side only: pass the whole variables dict "
            "{'params': ..., 'batch_stats': ...} (or the nnx State), not only the params."
        )
    if shapes:
        lines += ["  shape mismatches:", *shapes]
    if dtypes:
        lines += [
            "  dtype mismatches:",
            *dtypes,
            "    Fix the dtypes with export_state_dict(..., dtype=torch.float32) or by casting "
            "the module (e.g. `module.to(torch.bfloat16)`).",
        ]
    lines.append(
        "Fix: align layer names (Flax `layers_0` <-> torch `layers.0`, `a/b` <-> `a.b`), pass "
        "stacked=['prefix'] for scanned layers, or pass rules=[(regex, rename, transform)] for "
        "custom layers."
    )
    raise StateDictError("\n".join(lines))
