"""Tiny test models and helpers shared by the jaxcore tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxcore
from jaxcore.models.digits import MLP


class MlpBlock(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(self.hidden, name="fc1")(x))
        return nn.Dense(x.shape[-1], name="fc2")(h)


class Encoder(nn.Module):
    """Pre-LN transformer encoder classifier over ``x: [B, T, F]``."""

    dim: int = 16
    heads: int = 2
    hidden: int = 32
    layers: int = 1
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train=False):
        h = nn.Dense(self.dim, name="embed")(x)  # [B, T, dim]
        for i in range(self.layers):
            y = nn.LayerNorm(name=f"ln1_{i}")(h)
            h = h + nn.MultiHeadDotProductAttention(num_heads=self.heads, name=f"attn_{i}")(y, y)
            h = h + MlpBlock(self.hidden, name=f"mlp_{i}")(nn.LayerNorm(name=f"ln2_{i}")(h))
        return nn.Dense(self.num_classes, name="head")(nn.LayerNorm()(h).mean(axis=1))


def mlp_case(rows=16, features=(32, 32)):
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(rows, 64)).astype(np.float32),
        "y": rng.integers(0, 10, rows).astype(np.int32),
    }
    return jaxcore.linen_model(MLP(features=features)), batch


def encoder_case(rows=16, seq=8, feat=6):
    rng = np.random.default_rng(1)
    batch = {
        "x": rng.normal(size=(rows, seq, feat)).astype(np.float32),
        "y": rng.integers(0, 10, rows).astype(np.int32),
    }
    return jaxcore.linen_model(Encoder()), batch


def setup(model, batch, mesh, preset="dp", steps_per_call=1, lr=1e-2, state=None, **step_kwargs):
    """A placed state and its jitted train step on ``mesh`` under ``preset``.

    With ``state`` (a state placed elsewhere) it is moved to this mesh's shardings instead of
    initialised again (one init compile less per mesh).
    """
    tx = jaxcore.make_optimizer("adamw", lr=lr, weight_decay=1e-4)
    sample = batch if steps_per_call == 1 else {k: v[0] for k, v in batch.items()}
    shard_fn = jaxcore.state_sharding_fn(mesh, preset)
    if state is None:
        state = jaxcore.init_train_state(
            model,
            tx,
            {k: jnp.asarray(v) for k, v in sample.items()},
            seed=0,
            mesh=mesh,
            param_shardings=shard_fn,
        )
    else:
        copy = jax.tree.map(_host_copy, state)  # the step donates its input
        state = jax.device_put(copy, shard_fn(copy))
    sharding = jaxcore.batch_sharding(mesh, steps_per_call=steps_per_call)
    step = jaxcore.make_train_step(
        model,
        jaxcore.softmax_cross_entropy,
        tx,
        state_sharding=jaxcore.state_shardings(state),
        batch_sharding=sharding,
        steps_per_call=steps_per_call,
        **step_kwargs,
    )
    return state, step, sharding


def _host_copy(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x.copy()
    return np.asarray(x)  # placing host values compiles nothing


def put(batch, sharding):
    return {k: jax.device_put(jnp.asarray(v), sharding) for k, v in batch.items()}
