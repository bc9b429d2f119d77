"""jaxcore: the compiled, mesh-sharded JAX core of coreshell. Never imports torch."""

from jaxcore._errors import BatchError, ConfigError, JaxCoreError, MeshError, ShardingError
from jaxcore.losses import masked_mean, softmax_cross_entropy
from jaxcore.mesh import make_mesh
from jaxcore.model import ModelFns, linen_model
from jaxcore.optim import current_lr, make_optimizer, make_schedule
from jaxcore.state import TrainState, init_train_state, replicated, state_shardings
from jaxcore.step import make_eval_step, make_predict_step, make_train_step

__all__ = [
    "BatchError",
    "ConfigError",
    "JaxCoreError",
    "MeshError",
    "ModelFns",
    "ShardingError",
    "TrainState",
    "current_lr",
    "init_train_state",
    "linen_model",
    "make_eval_step",
    "make_mesh",
    "make_optimizer",
    "make_predict_step",
    "make_schedule",
    "make_train_step",
    "masked_mean",
    "replicated",
    "softmax_cross_entropy",
    "state_shardings",
]
