"""A user's ``LightningModule`` traced: its step methods as pure JAX functions.

:class:`LightningPort` runs ``training_step`` / ``validation_step`` / ``test_step`` /
``predict_step`` under torchax (:class:`~torchshell.torch_model.TorchTracer`), with the
module's weights swapped for JAX values, and records every ``self.log`` / ``self.log_dict``
call made while tracing: the values come back as JAX scalars (on device), the options
(``prog_bar``, ``logger``, ``on_step``, ``on_epoch``, ``reduce_fx``, ``batch_size``) as a
:class:`LogSpec` per name, static for the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import lightning as L
import torch
from torchmetrics import Metric

from jaxcore import ModelFns
from torchshell._embedding import EmbeddingChecks
from torchshell._errors import ConfigError, TorchModelError
from torchshell.torch_model import TorchTracer

__all__ = ["HOOKS", "LightningPort", "LogSpec"]

PyTree = Any

# Lightning's defaults of self.log per hook: (on_step, on_epoch).
HOOKS = {
    "training_step": (True, False),
    "validation_step": (False, True),
    "test_step": (False, True),
    "predict_step": (False, False),
}
_REDUCE = ("mean", "sum", "max", "min")
_METRIC_METHODS = ("forward", "update", "compute")
_COUNTERS = ("global_step", "current_epoch")  # Trainer progress a step may read


@dataclasses.dataclass(frozen=True)
class LogSpec:
    """How one ``self.log`` name is reported (Lightning's meaning of each option)."""

    name: str
    prog_bar: bool = False
    logger: bool | None = None  # as given: None logs when a logger exists, like Lightning
    on_step: bool = True
    on_epoch: bool = False
    reduce_fx: str = "mean"
    batch_size: int | None = None


def _reduce_name(reduce_fx: Any) -> str:
    name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "")
    name = {"amax": "max", "amin": "min"}.get(name, name)
    if name not in _REDUCE:
        raise ConfigError(
            f"self.log(reduce_fx={reduce_fx!r}) is not supported in a traced step: expected "
            f"one of {_REDUCE} (or torch.mean/sum/max/min). Fix: use one of them."
        )
    return name


def _counting_class(cls: type, read: set[str]) -> type:
    """``cls`` whose ``global_step``/``current_epoch`` record, in ``read``, that they were read.

    The user's module wears this class while a step is traced (and its own class again after):
    the values themselves are the ones ``cls`` gives.
    """

    def counter(name: str) -> property:
        base = getattr(cls, name)

        def get(self: Any) -> Any:
            read.add(name)
            return base.__get__(self, cls)

        return property(get)

    attrs: dict[str, Any] = {name: counter(name) for name in _COUNTERS}
    attrs.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
    return type(cls.__name__, (cls,), attrs)


def _warn_at(method: Any, where: str, name: str) -> None:
    """Warns, at the user's method, that it read a Trainer counter while being traced."""
    message = (
        f"{where} reads self.{name}: the compiled step is traced once, so every step sees its "
        "value at trace time (0), where plain Lightning gives the current one. Fix: for an lr "
        "warmup or decay use a torch lr scheduler in configure_optimizers (mapped per step); "
        "for a loss weight that changes over training, compute it from a batch field."
    )
    try:
        filename = inspect.getsourcefile(method) or "<unknown>"
        lineno = inspect.getsourcelines(method)[1]
    except (OSError, TypeError):
        filename, lineno = "<unknown>", 0
    warnings.warn_explicit(message, UserWarning, filename, lineno)


class LightningPort:
    """The traced step methods of one ``LightningModule``.

    Args:
        module: the user's module, with automatic optimization (Lightning's default).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> port = LightningPort(BoringModel())
        >>> out, logs, _ = port.call("training_step", port.tracer.params0,
        ...     port.tracer.state0, jnp.ones((4, 32)), jax.random.key(0), True)
        >>> float(out["loss"]) > 0
        True
    """

    def __init__(self, module: L.LightningModule) -> None:
        if not isinstance(module, L.LightningModule):
            raise ConfigError(
                f"JaxModule.from_lightning expects a lightning.LightningModule instance, got "
                f"{type(module).__name__}. Fix: pass MyModule(**hparams); for a plain "
                "nn.Module use JaxModule.from_torch."
            )
        if not module.automatic_optimization:
            raise ConfigError(
                f"{type(module).__name__} uses manual optimization (automatic_optimization="
                "False): its training_step calls the torch optimizer itself, which a compiled "
                "JAX step cannot. Fix: return the loss from training_step with automatic "
                "optimization, or use JaxModule.from_torch with an optax optimizer."
            )
        self.module = module
        self.tracer = TorchTracer(module)
        self.embeddings = EmbeddingChecks()
        self.embeddings.install(self.tracer.env)
        self.specs: dict[str, dict[str, LogSpec]] = {hook: {} for hook in HOOKS}
        self._warned: set[tuple[str, str]] = set()

    def overrides(self, hook: str) -> bool:
        """Whether the user's class defines ``hook`` (Lightning's own check)."""
        from lightning.pytorch.utilities.model_helpers import is_overridden

        return is_overridden(hook, self.module, parent=L.LightningModule)

    @contextlib.contextmanager
    def _capture(self, hook: str, records: list[tuple[LogSpec, Any]]) -> Iterator[None]:
        on_step_default, on_epoch_default = HOOKS[hook]

        def log(
            name: str,
            value: Any,
            prog_bar: bool = False,
            logger: bool | None = None,
            on_step: bool | None = None,
            on_epoch: bool | None = None,
            reduce_fx: Any = "mean",
            enable_graph: bool = False,
            sync_dist: bool = False,
            sync_dist_group: Any = None,
            add_dataloader_idx: bool = True,
            batch_size: int | None = None,
            metric_attribute: str | None = None,
            rank_zero_only: bool = False,
        ) -> None:
            if isinstance(value, Mapping) or not isinstance(value, (torch.Tensor, int, float)):
                raise ConfigError(
                    f"self.log({name!r}, ...) in {hook} got a {type(value).__name__}: a "
                    "traced step logs tensors or numbers (torchmetrics objects keep state "
                    "outside the step). Fix: log metric.compute() values from a torch "
                    "function of the batch, or a tensor."
                )
            spec = LogSpec(
                name=name,
                prog_bar=bool(prog_bar),
                logger=logger,
                on_step=on_step_default if on_step is None else bool(on_step),
                on_epoch=on_epoch_default if on_epoch is None else bool(on_epoch),
                reduce_fx=_reduce_name(reduce_fx),
                batch_size=batch_size,
            )
            records.append((spec, value))

        self.module.log = log  # type: ignore[method-assign]  # an instance attribute
        device = self.module._device
        self.module._device = torch.device("jax")  # tensors made on self.device are traced
        metrics = self._refuse_metrics(hook)
        user_class = type(self.module)
        read: set[str] = set()
        self.module.__class__ = _counting_class(user_class, read)
        try:
            yield
        finally:
            self.module.__class__ = user_class
            del self.module.log
            self.module._device = device
            for metric in metrics:
                for method in _METRIC_METHODS:
                    metric.__dict__.pop(method, None)
        for name in sorted(read):
            if (hook, name) not in self._warned:
                self._warned.add((hook, name))
                _warn_at(getattr(user_class, hook), f"{user_class.__name__}.{hook}", name)

    def _refuse_metrics(self, hook: str) -> list[Metric]:
        """Makes the module's torchmetrics objects refuse to run inside the traced ``hook``.

        A metric accumulates its state in torch tensors between steps (and its updates use
        value-dependent shapes, e.g. ``bincount``): it cannot run in a compiled step, and
        tracing it would fail deep inside torchmetrics with a message about shapes.
        """
        owner = type(self.module).__name__
        metrics = []
        for name, metric in self.module.named_modules():
            if not isinstance(metric, Metric):
                continue

            def refuse(*args: Any, _name: str = name, _m: Metric = metric, **kw: Any) -> Any:
                raise ConfigError(
                    f"{owner}.{hook} runs the torchmetrics metric self.{_name} "
                    f"({type(_m).__name__}): a metric keeps its state in torch between steps, "
                    "outside the compiled JAX step, so it cannot run inside it. Fix: compute "
                    "the value as a torch expression of the batch and log it, e.g. "
                    'self.log("acc", (logits.argmax(-1) == y).float().mean(), on_epoch=True) '
                    "(Lightning's mean over the epoch's batches), or pass the metric's inputs "
                    "out of predict_step and run the metric on the host."
                )

            for method in _METRIC_METHODS:
                metric.__dict__[method] = refuse
            metrics.append(metric)
        return metrics

    def call(
        self,
        hook: str,
        params: PyTree,
        model_state: PyTree,
        batch: PyTree,
        rng: jax.Array,
        train: bool,
    ) -> tuple[Any, dict[str, jax.Array], PyTree]:
        """Runs ``module.<hook>(batch, 0)`` traced; ``(outputs, logged values, new state)``."""
        records: list[tuple[LogSpec, Any]] = []

        def fn(b: Any) -> Any:
            # Lightning's precision plugin may have entered torch.autocast around our
            # training_step; the traced step's dtype is the JAX step's, not autocast's.
            with (
                self._capture(hook, records),
                self.embeddings.watching(b),
                torch.autocast("cpu", enabled=False),
            ):
                out = getattr(self.module, hook)(b, 0)
            return out, [value for _, value in records]

        (out, values), new_state = self.tracer.call(fn, params, model_state, [batch], rng, train)
        specs: dict[str, LogSpec] = {}
        logs: dict[str, jax.Array] = {}
        for (spec, _), value in zip(records, values, strict=True):
            array = jnp.asarray(value, jnp.float32)
            if array.size != 1:
                raise ConfigError(
                    f"self.log({spec.name!r}) in {hook} got a tensor of shape "
                    f"{tuple(array.shape)}; Lightning logs scalars. Fix: log a reduced value "
                    "(e.g. .mean())."
                )
            specs[spec.name], logs[spec.name] = spec, array.reshape(())
        self.specs[hook] = specs
        return out, logs, new_state

    def loss_of(self, out: Any) -> jax.Array:
        """The loss a ``training_step`` returned (a tensor, or a dict holding ``"loss"``)."""
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if loss is None or not hasattr(loss, "shape") or getattr(loss, "size", 0) != 1:
            raise TorchModelError(
                f"{type(self.module).__name__}.training_step returned "
                f"{type(out).__name__ if loss is None else tuple(loss.shape)}: expected the "
                "loss, a scalar tensor (or a dict with 'loss'). A step that returns None "
                "(Lightning skips it) cannot be compiled. Fix: return the loss."
            )
        return jnp.asarray(loss, jnp.float32).reshape(())

    def model_fns(self) -> ModelFns:
        """``training_step`` as jaxcore's :class:`~jaxcore.ModelFns`.

        ``apply`` returns ``{"loss": loss, "logs": {name: value}}``, which :meth:`loss_fn`
        turns into the step's loss and metrics (``log/<name>``).
        """

        def init(rng: jax.Array, batch: PyTree) -> tuple[PyTree, PyTree]:
            t = self.tracer
            jax.eval_shape(
                lambda b: self.apply(t.params0, t.state0, b, jax.random.key(0), True), batch
            )
            return dict(t.params0), dict(t.state0)

        return ModelFns(init, self.apply)

    def apply(
        self, params: PyTree, model_state: PyTree, batch: PyTree, rng: jax.Array, train: bool
    ) -> tuple[PyTree, PyTree]:
        out, logs, new_state = self.call("training_step", params, model_state, batch, rng, train)
        return {"loss": self.loss_of(out), "logs": logs}, new_state

    @staticmethod
    def loss_fn(outputs: PyTree, batch: PyTree) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The traced step's loss and logged values (0-d: batch means) for jaxcore."""
        return outputs["loss"], {f"log/{k}": v for k, v in outputs["logs"].items()}
