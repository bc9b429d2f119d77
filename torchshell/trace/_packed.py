"""Packed sequences (``nn.utils.rnn.pack_padded_sequence``) in a traced step, as masks.

A ``PackedSequence`` holds ``sum(lengths)`` rows laid out by the lengths' values, and
``nn.LSTM``/``GRU``/``RNN`` run it one time step at a time over the still-active sequences:
shapes that depend on the batch's values, which a compiled step cannot have (torchax has no
lowering for ``aten::_pack_padded_sequence`` either). While a step is traced,
:func:`packed_as_masks` swaps torch's four packed-sequence kernels (``torch._VF``: pack, pad,
and the packed recurrences) for ones that keep the padded ``[T, B, ...]`` batch and its
lengths: each recurrence runs over all T steps and a sequence's state stops changing past its
length (the reverse direction starts at each sequence's own last step), outputs past it are
``padding_value``. The results are torch's: the final states ``h_n``/``c_n``, and
``pad_packed_sequence``'s output (its length the batch's longest sequence, a value read on
the host as any batch scalar, or ``total_length``). The Python side of torch
(``pack_padded_sequence``'s sorting, ``nn.LSTM.forward``'s hidden-state permutations) runs
unchanged. Inside the traced step ``PackedSequence.data`` is the padded batch
(``T * B`` rows), not torch's ``sum(lengths)``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import _VF
from torch.nn.utils import rnn

__all__ = ["packed_as_masks"]

_PAD_CODE = rnn.pad_packed_sequence.__code__
_INIT_ARGS = rnn._packed_sequence_init_args
_LENGTHS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(data) -> (data, lengths)


def _register(data: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    _LENGTHS[id(data)] = (data, lengths)  # (the reference keeps the id unique)
    return data


def _padded(data: torch.Tensor, batch_sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [T, B, ...], lengths [B])`` of a packed ``data`` made by :func:`_pack`."""
    t = batch_sizes.shape[0]
    lengths = _LENGTHS[id(data)][1].to(data.device)  # (a Python list's: on the host)
    return data.reshape(t, data.shape[0] // t, *data.shape[1:]), lengths


def _pack(input: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> Any:
    x = input.transpose(0, 1) if batch_first else input  # [T, B, ...], sorted by length
    t, b = x.shape[:2]
    data = _register(x.reshape(t * b, *x.shape[2:]), lengths)
    return data, torch.full((t,), b, dtype=torch.int64)  # every step "holds" the B rows


def _init_args(data: Any, batch_sizes: Any = None, *indices: Any) -> Any:
    """``PackedSequence``'s argument check, which wants ``batch_sizes`` on the CPU device
    (a traced tensor is on JAX's), skipped for our data."""
    if id(data) not in _LENGTHS:
        return _INIT_ARGS(data, batch_sizes, *indices)
    sorted_indices, unsorted = (*indices, None, None)[:2]
    if unsorted is None:
        unsorted = rnn.invert_permutation(sorted_indices)
    return data, batch_sizes, sorted_indices, unsorted


def _pad(
    data: torch.Tensor,
    batch_sizes: torch.Tensor,
    batch_first: bool,
    padding_value: float,
    total_length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    x, lengths = _padded(data, batch_sizes)
    caller = sys._getframe(1)  # torch's pad_packed_sequence: was total_length given?
    if caller.f_code is _PAD_CODE and caller.f_locals["total_length"] is None:
        total_length = int(lengths.max())  # torch's: the longest sequence (a batch scalar)
    steps = torch.arange(x.shape[0], device=x.device)[:, None]
    valid = (steps < lengths[None, :]).reshape(*x.shape[:2], *[1] * (x.dim() - 2))
    out = torch.where(valid, x, torch.full_like(x, padding_value))[:total_length]
    if total_length > x.shape[0]:
        extra = [0, 0] * (x.dim() - 1) + [0, total_length - x.shape[0]]
        out = F.pad(out, extra, value=padding_value)
    return (out.transpose(0, 1) if batch_first else out), lengths


def _reverse_index(valid: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[T, B]`` time index reversing each sequence within its length (pads stay)."""
    steps = torch.arange(valid.shape[0], device=valid.device)[:, None]
    return torch.where(valid, lengths[None, :] - 1 - steps, steps)


def _time_gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.gather(0, index[..., None].expand(-1, -1, x.shape[-1]))


def _recur(
    mode: str,
    x: torch.Tensor,
    valid: torch.Tensor,
    weights: Sequence[torch.Tensor],
    has_biases: bool,
    h: torch.Tensor,
    c: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One layer, one direction, over ``x [T, B, F]``; states frozen where not ``valid``."""
    w_ih, w_hh = weights[0], weights[1]
    b_ih, b_hh = (weights[2], weights[3]) if has_biases else (None, None)
    w_hr = weights[4 if has_biases else 2] if len(weights) in (3, 5) else None  # LSTM proj
    xi = F.linear(x, w_ih, b_ih)  # every step's input part at once
    outs = []
    for s in range(x.shape[0]):
        gh = F.linear(h, w_hh, b_hh)
        keep = valid[s][:, None]
        if mode == "lstm":
            assert c is not None
            i, f, g, o = (xi[s] + gh).chunk(4, -1)
            c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h_new = torch.sigmoid(o) * torch.tanh(c_new)
            if w_hr is not None:
                h_new = F.linear(h_new, w_hr)
            c = torch.where(keep, c_new, c)
        elif mode == "gru":
            r_i, z_i, n_i = xi[s].chunk(3, -1)
            r_h, z_h, n_h = gh.chunk(3, -1)
            r, z = torch.sigmoid(r_i + r_h), torch.sigmoid(z_i + z_h)
            n = torch.tanh(n_i + r * n_h)
            h_new = (1 - z) * n + z * h
        else:
            h_new = torch.tanh(xi[s] + gh) if mode == "rnn_tanh" else torch.relu(xi[s] + gh)
        h = torch.where(keep, h_new, h)
        outs.append(torch.where(keep, h_new, torch.zeros_like(h_new)))
    return torch.stack(outs), h, c


def _packed_rnn(mode: str, original: Any) -> Any:
    """``_VF.<mode>`` taking our packed data (other calls go to torch's kernel)."""

    def run(data: Any, *args: Any) -> Any:
        if id(data) not in _LENGTHS or not isinstance(args[0], torch.Tensor):
            return original(data, *args)
        batch_sizes, hx, params, has_biases, layers, dropout, train, bidirectional = args
        x, lengths = _padded(data, batch_sizes)
        steps = torch.arange(x.shape[0], device=x.device)[:, None]
        valid = steps < lengths[None, :]
        back = _reverse_index(valid, lengths)
        dirs = 2 if bidirectional else 1
        per = len(params) // (layers * dirs)
        h0, c0 = hx if mode == "lstm" else (hx, None)
        hs: list[torch.Tensor] = []
        cs: list[Any] = []
        for layer in range(layers):
            outs = []
            for d in range(dirs):
                k = layer * dirs + d
                seq = x if d == 0 else _time_gather(x, back)
                c_k = None if c0 is None else c0[k]
                out, h, c = _recur(
                    mode, seq, valid, params[k * per : (k + 1) * per], has_biases, h0[k], c_k
                )
                outs.append(out if d == 0 else _time_gather(out, back))
                hs.append(h)
                cs.append(c)
            x = torch.cat(outs, -1) if dirs == 2 else outs[0]
            if dropout and train and layer < layers - 1:
                x = F.dropout(x, dropout, True)
        x = torch.where(valid[..., None], x, torch.zeros_like(x))
        out = _register(x.reshape(-1, x.shape[-1]), lengths)
        if mode == "lstm":
            return out, torch.stack(hs), torch.stack(cs)
        return out, torch.stack(hs)

    return run


@contextlib.contextmanager
def packed_as_masks() -> Iterator[None]:
    """While tracing: torch's packed-sequence kernels as masked padded ones (see above).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> lstm, x = nn.LSTM(3, 4, batch_first=True), torch.randn(2, 5, 3)
        >>> def run(x):
        ...     packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([5, 2]), True)
        ...     out, (h, _) = lstm(packed)
        ...     return nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0], h
        >>> with packed_as_masks():
        ...     masked = run(x)
        >>> [bool(torch.allclose(a, b, atol=1e-6)) for a, b in zip(masked, run(x))]
        [True, True]
    """
    if rnn._packed_sequence_init_args is _init_args:  # (already on: a nested trace)
        yield
        return
    kernels = {"_pack_padded_sequence": _pack, "_pad_packed_sequence": _pad}
    kernels |= {m: _packed_rnn(m, getattr(_VF, m)) for m in ("lstm", "gru", "rnn_tanh", "rnn_relu")}
    try:
        for name, fn in kernels.items():
            setattr(_VF, name, fn)
        rnn._packed_sequence_init_args = _init_args  # type: ignore[assignment]
        yield
    finally:
        for name in kernels:
            delattr(_VF, name)
        rnn._packed_sequence_init_args = _INIT_ARGS
        _LENGTHS.clear()
