"""The served speech model: an MLflow pyfunc over the fastest core (models from code).

MLflow copies this file into the logged model and runs it at load time, so it imports only
what the serving environment has (numpy, mlflow and the core's runtime, as the model's
requirements list them): no coreshell code, no pickle. The core (``serving.json``'s ``core``):

- ``"jax"``: ``jax.export`` programs (StableHLO, the trained weights inside) of the JAX front
  end and encoder (``core``) and of the front end alone (``front``), with symbolic batch and
  sample axes. A request is padded to a bucket (rows and samples, at most 25% more: a few
  compiled shapes serve every batch and length; padding changes no clip's result), then a
  batch of up to ``onnx_max_batch`` clips runs the front end in JAX and the encoder in ONNX
  Runtime (``encoder``, one thread, no per-shape compile: faster at batch 1), a larger one the
  whole JAX program. Requirements: jax, jaxlib, numpy, mlflow (and onnxruntime).
- ``"pt2"``: ``torch.export``'s program of the torch serving module (the model before #54,
  the benchmarks' baseline). Requirements: torch, numpy, mlflow.

Request (``mlflow.pyfunc`` and ``mlflow models serve`` alike): a dict of two tensors,

- ``waveform``: float32 ``[B, N]``, 16 kHz mono clips, each zero-padded to the longest;
- ``lengths``: int64 ``[B]``, each clip's own length in samples (0.2 s to 5 s).

One clip is a batch of one. Over HTTP: ``POST /invocations`` with
``{"inputs": {"waveform": [[...], [...]], "lengths": [16000, 9600]}}``.
Response: ``{"logits": [B, C], "probabilities": [B, C], "label": [B]}``.
"""

from __future__ import annotations

import collections
import functools
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel

FORMAT = (
    'Send {"waveform": float32[B, N] (clips zero-padded to the longest), "lengths": '
    "int64[B] (samples of each clip)}; over HTTP "
    '{"inputs": {"waveform": [[...]], "lengths": [N]}}'
)


#: The most characters of the request a refusal repeats.
ECHO = 200


class RequestRefused(MlflowException):
    """A refused request (HTTP 400): the fault and the fix first, then at most :data:`ECHO`
    characters of the request. MLflow's scoring server prefixes every ``MlflowException`` of
    ``predict`` with ``Failed to predict data '<the whole request>'`` (4,845 characters of
    samples before the fix for a short clip); that prefix is folded in here, cut short."""

    @property
    def message(self) -> str:  # type: ignore[override]
        return self._message

    @message.setter
    def message(self, value: str) -> None:
        own = getattr(self, "_message", None)
        if own is None or value == own or not value.endswith(own):
            self._message = value
            return
        echo = value[: -len(own)].removeprefix("Failed to predict data '")
        echo = echo.removesuffix("'. \nError: ")
        cut = echo if len(echo) <= ECHO else f"{echo[:ECHO]}... ({len(echo):,} characters)"
        self._message = f"{own} Request: {cut}"


def _refuse(message: str) -> MlflowException:
    return RequestRefused(message, error_code=INVALID_PARAMETER_VALUE)


def validated(model_input: Any, spec: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(waveform float32[B, N], lengths int64[B])`` of a request, or a clear refusal.

    Args:
        model_input: the request: a dict with ``waveform`` and ``lengths``.
        spec: the model's ``serving.json`` (``sample_rate``, ``min_samples``,
            ``max_samples``).

    Raises:
        MlflowException: (HTTP 400) what was expected, what came in, and the fix.

    Example:
        >>> spec = {"sample_rate": 16000, "min_samples": 3200, "max_samples": 80000}
        >>> w, n = validated({"waveform": np.zeros((1, 4000)), "lengths": [4000]}, spec)
        >>> w.dtype, n.tolist()
        (dtype('float32'), [4000])
    """
    if not isinstance(model_input, dict) or not {"waveform", "lengths"} <= set(model_input):
        got = sorted(model_input) if isinstance(model_input, dict) else type(model_input).__name__
        raise _refuse(f"Expected a dict with 'waveform' and 'lengths'; got {got}. Fix: {FORMAT}.")
    try:  # MLflow hands over arrays, or the request's own lists (JSON numbers)
        waveform = np.asarray(model_input["waveform"], dtype=np.float32)
        lengths = np.asarray(model_input["lengths"]).reshape(-1)
    except (TypeError, ValueError) as err:
        raise _refuse(
            f"waveform and lengths must be arrays of numbers; got {str(err)[:ECHO]}. Fix: {FORMAT}."
        ) from None
    if waveform.ndim == 1:
        waveform = waveform[None]
    if waveform.ndim != 2 or len(lengths) != len(waveform) or not len(waveform):
        raise _refuse(
            f"Expected waveform [B, N] and lengths [B] with B >= 1; got waveform "
            f"{list(waveform.shape)} and lengths {list(lengths.shape)}. Fix: {FORMAT}."
        )
    if np.issubdtype(lengths.dtype, np.floating) and np.array_equal(lengths, np.round(lengths)):
        lengths = lengths.astype(np.int64)  # 16000.0: a whole number of samples, from JSON
    if not np.issubdtype(lengths.dtype, np.integer):
        raise _refuse(f"lengths must be integers (samples); got {lengths.dtype}. Fix: {FORMAT}.")
    rate, low, high = spec["sample_rate"], spec["min_samples"], spec["max_samples"]
    bad = [
        (i, int(n)) for i, n in enumerate(lengths) if not low <= n <= min(high, waveform.shape[1])
    ]
    if bad:
        i, n = bad[0]
        raise _refuse(
            f"Clip {i} has lengths[{i}]={n} samples ({n / rate:.3f} s); expected "
            f"{low}..{high} samples ({low / rate:g} s to {high / rate:g} s of {rate} Hz audio) "
            f"and at most the padded width {waveform.shape[1]}. Fix: send 16 kHz mono clips "
            "of 0.2 s to 5 s (split longer recordings), lengths[i] = the clip's own samples."
        )
    if not np.isfinite(waveform).all():
        raise _refuse("waveform holds NaN or infinite samples. Fix: send finite float32 audio.")
    return np.ascontiguousarray(waveform), lengths.astype(np.int64)


#: Samples of a padded request are a multiple of this (two 10 ms frames: the stride-2 stem).
SAMPLE_STEP = 320


def bucket(n: int) -> int:
    """The padded size of ``n`` rows (or sample steps): ``n`` up to 8, else the smallest
    ``m * 2**e >= n`` with ``m`` in 4..8, so at most 25% padding and four sizes an octave.

    Example:
        >>> [bucket(n) for n in (1, 5, 8, 9, 33, 64, 65, 250)]
        [1, 5, 8, 10, 40, 64, 80, 256]
    """
    if n <= 8:
        return n
    shift = n.bit_length() - 3
    return -(-n >> shift) << shift


class JaxCore:
    """The ``"jax"`` core: the exported JAX programs, and ONNX Runtime for small batches."""

    def __init__(self, artifacts: dict[str, str], spec: dict[str, Any]) -> None:
        import jax
        from jax import export

        def load(name: str) -> Any:
            return jax.jit(export.deserialize(bytearray(Path(artifacts[name]).read_bytes())).call)

        self.cpu = jax.devices("cpu")[0]  # exported for the CPU, wherever JAX's default is
        self.core, self.front = load("core"), load("front")
        self.onnx_max_batch, self.session = 0, None
        if "encoder" in artifacts and spec.get("onnx_max_batch", 0) > 0:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = 1  # a small batch: threads cost more than they give
            self.session = ort.InferenceSession(
                artifacts["encoder"], options, providers=["CPUExecutionProvider"]
            )
            self.names = [i.name for i in self.session.get_inputs()]
            self.onnx_max_batch = int(spec["onnx_max_batch"])
        self.ran: collections.Counter[str] = collections.Counter()  # requests per path

    def logits(self, waveform: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        import jax

        b, n = len(waveform), int(lengths.max())  # samples past every clip's end: dropped
        rows, width = bucket(b), bucket(-(-n // SAMPLE_STEP)) * SAMPLE_STEP
        wave = np.zeros((rows, width), np.float32)
        wave[:b, :n] = waveform[:, :n]
        sizes = np.full(rows, n, np.int32)  # padded rows: silent clips, sliced off below
        sizes[:b] = lengths
        with jax.default_device(self.cpu):
            if b <= self.onnx_max_batch:
                self.ran["onnx"] += 1
                features, mask = (np.asarray(x)[:b] for x in self.front(wave, sizes))
                t = int(mask.sum(axis=1).max())  # the frames past every clip's end dropped
                feeds = dict(zip(self.names, (features[:, :t], mask[:, :t]), strict=True))
                return self.session.run(None, feeds)[0]  # type: ignore[union-attr,no-any-return]
            self.ran["jax"] += 1
            return np.asarray(self.core(wave, sizes))[:b]


class Pt2Core:
    """The ``"pt2"`` core: ``torch.export``'s program of the torch serving module."""

    def __init__(self, artifacts: dict[str, str], spec: dict[str, Any]) -> None:
        import torch

        # torch.export.load builds the weights with torch.frombuffer over the archive's
        # read-only bytes and warns that the buffer is not writable (nothing writes to it):
        # not the serving user's concern
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"The given buffer is not writable", category=UserWarning
            )
            self.program = torch.export.load(artifacts["program"]).module()
        self.ran: collections.Counter[str] = collections.Counter()

    def logits(self, waveform: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        import torch

        self.ran["pt2"] += 1
        with torch.no_grad():
            out = self.program(torch.from_numpy(waveform), torch.from_numpy(lengths))
        return out.numpy()  # type: ignore[no-any-return]


CORES = {"jax": JaxCore, "pt2": Pt2Core}


def malformed(body: bytes | str, error: ValueError) -> MlflowException:
    """The 400 for a request body that is not JSON: the fault and the fix, then at most
    :data:`ECHO` characters of the body (MLflow's own message repeats all of it).

    Example:
        >>> body = b'{"inputs": [1, 2,'
        >>> try:
        ...     json.loads(body)
        ... except ValueError as err:
        ...     print(malformed(body, err).message[:55])
        The request is not valid JSON (Expecting value: line 1
    """
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
    size = f"{len(body):,} {'bytes' if isinstance(body, bytes) else 'characters'}"
    echo = text if len(text) <= ECHO else f"{text[:ECHO]}..."
    return _refuse(
        f"The request is not valid JSON ({str(error)[:ECHO]}): a truncated or unfinished body? "
        f"Fix: send the whole request as one UTF-8 JSON object. {FORMAT}. "
        f"Request ({size}): {echo}"
    )


#: The module ``mlflow models serve``'s uvicorn imports; it loads the model while imported.
SERVER_APP = "mlflow.pyfunc.scoring_server.app"


def decode_once(server: Any) -> bool:
    """Makes MLflow's scoring server decode a JSON request body once, not twice.

    MLflow 3's ``_parse_json_data`` decodes the body (``_decode_json_input``) to look for the
    LLM keys, then hands the raw body to ``_split_data_and_params``, which decodes it again:
    two ``json.loads`` of a batch-64 request's 14 MB, most of its time. Here the body is
    decoded once and the dict handed on (``_decode_json_input`` returns a dict unchanged):
    the same data, params and errors, except that a body that is not JSON gets
    :func:`malformed`'s short 400, not MLflow's echo of the whole body. Nothing else of the
    server changes; a server without these functions is left as it is.

    Args:
        server: the ``mlflow.pyfunc.scoring_server`` module.

    Returns:
        True when the server now decodes once.

    Example:
        >>> import types
        >>> calls = []
        >>> server = types.SimpleNamespace(
        ...     _decode_json_input=lambda d: calls.append(d) or {"inputs": d},
        ...     _parse_json_data=lambda data, metadata, schema: data)
        >>> decode_once(server), server._parse_json_data("[1]", None, None), calls
        (True, {'inputs': '[1]'}, ['[1]'])
    """
    parse, decode = (getattr(server, n, None) for n in ("_parse_json_data", "_decode_json_input"))
    if parse is None or decode is None:
        return False
    if getattr(parse, "decodes_once", False):
        return True

    @functools.wraps(parse)
    def parse_decoded(data: Any, metadata: Any, input_schema: Any) -> Any:
        try:
            decoded = decode(data)
        except MlflowException as err:  # MLflow's message repeats the whole body
            if not isinstance(err.__cause__, ValueError):  # JSON or UTF-8 decoding errors
                raise
            raise malformed(data, err.__cause__) from None
        return parse(decoded, metadata, input_schema)

    parse_decoded.decodes_once = True  # type: ignore[attr-defined]
    server._parse_json_data = parse_decoded
    return True


class WaveformClassifier(PythonModel):
    """Runs the model's core (waveform and lengths in, logits out) on a validated batch."""

    # The signature is explicit and `validated` checks every request: MLflow's own wrapping of
    # `predict` by its type hints (and its advice to add some) is skipped, as for its ChatModel
    _skip_type_hint_validation = True

    def load_context(self, context):
        with open(context.artifacts["serving"]) as f:
            self.spec = json.load(f)
        self.core = CORES[self.spec.get("core", "pt2")](context.artifacts, self.spec)
        if self.spec.get("decode_once") and SERVER_APP in sys.modules:  # in `models serve`
            decode_once(sys.modules["mlflow.pyfunc.scoring_server"])

    def predict(self, context, model_input, params=None):
        waveform, lengths = validated(model_input, self.spec)
        logits = np.asarray(self.core.logits(waveform, lengths), np.float32)
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return {
            "logits": logits,
            "probabilities": (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32),
            "label": logits.argmax(axis=1).astype(np.int64),
        }


if __name__ != "torchshell.app.waveform_model":  # run by MLflow as the model's code
    mlflow.models.set_model(WaveformClassifier())
