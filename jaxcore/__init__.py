"""jaxcore: the compiled, mesh-sharded JAX core of coreshell. Never imports torch."""

from jaxcore._errors import (
    BatchError,
    ConfigError,
    JaxCoreError,
    MeshError,
    NonFiniteError,
    ShardingError,
)
from jaxcore._rows import rows
from jaxcore.compile import (
    CompileStats,
    Step,
    concrete_of,
    disable_compile_cache,
    enable_compile_cache,
)
from jaxcore.eval_step import make_eval_step, make_predict_step, make_train_forward
from jaxcore.grads import GradFn, Grads, Window, accumulate, row_grads, unrolled
from jaxcore.guard import NAN_POLICIES, check_finite, set_debug_nans
from jaxcore.losses import MICRO, TOTAL, masked_mean, per_example, softmax_cross_entropy
from jaxcore.make_step import make_train_step
from jaxcore.mesh import make_mesh, set_cpu_devices
from jaxcore.model import ModelFns, linen_model, nnx_model
from jaxcore.optim import current_lr, make_optimizer, make_schedule
from jaxcore.precision import resolve_dtype
from jaxcore.sharding import (
    LARGEST,
    PRESETS,
    Largest,
    ShardingPlan,
    batch_sharding,
    parse_rules,
    plan_shardings,
    preset_rules,
    sharding_rules,
    state_sharding_fn,
)
from jaxcore.state import (
    PendingState,
    TrainState,
    init_train_state,
    replicated,
    restart_optimizer,
    start_train_state,
    state_shardings,
)
from jaxcore.step import (
    ComposedStep,
    GradsHook,
    StepFn,
    jit_step,
    k_steps,
    scale_grads,
    train_step,
)

__all__ = [
    "LARGEST",
    "MICRO",
    "NAN_POLICIES",
    "PRESETS",
    "TOTAL",
    "BatchError",
    "CompileStats",
    "ComposedStep",
    "ConfigError",
    "GradFn",
    "Grads",
    "GradsHook",
    "JaxCoreError",
    "Largest",
    "MeshError",
    "ModelFns",
    "NonFiniteError",
    "PendingState",
    "ShardingError",
    "ShardingPlan",
    "Step",
    "StepFn",
    "TrainState",
    "Window",
    "accumulate",
    "batch_sharding",
    "check_finite",
    "concrete_of",
    "current_lr",
    "disable_compile_cache",
    "enable_compile_cache",
    "init_train_state",
    "jit_step",
    "k_steps",
    "linen_model",
    "make_eval_step",
    "make_mesh",
    "make_optimizer",
    "make_predict_step",
    "make_schedule",
    "make_train_forward",
    "make_train_step",
    "masked_mean",
    "nnx_model",
    "parse_rules",
    "per_example",
    "plan_shardings",
    "preset_rules",
    "replicated",
    "resolve_dtype",
    "restart_optimizer",
    "row_grads",
    "rows",
    "scale_grads",
    "set_cpu_devices",
    "set_debug_nans",
    "sharding_rules",
    "softmax_cross_entropy",
    "start_train_state",
    "state_sharding_fn",
    "state_shardings",
    "train_step",
    "unrolled",
]
