"""bf16 MFU of a Whisper-base-sized encoder: coreshell against a pure Flax step, and from_torch.

The encoder (d=512, 6 pre-norm transformer layers, 8 heads, MLP 2048, 1,500 frames of 80
log-mel features projected in, mean-pooled to 10 classes) trains with Adam, computing in
bfloat16 (float32 params and optimizer state) in three ways, on the same batch shapes:

- (r) the pure Flax reference: one ``jax.jit`` step over batches already on the device; its
  attention is the recipes' fused call (``jaxcore.models.attention.attend``), as in (a);
- (a) coreshell: ``JaxModule`` under ``lightning.Trainer(precision="bf16-mixed")`` fed by a
  torch ``DataLoader`` (each batch crosses host -> device: the user's path);
- (t) ``JaxModule.from_torch`` on the same encoder written in torch
  (``nn.TransformerEncoder``, ``norm_first``), traced by torchax;
- (l) ``JaxModule.from_lightning`` on a team's ``LightningModule`` around that torch encoder
  (its ``training_step`` computes ``F.cross_entropy`` and logs it, its
  ``configure_optimizers`` returns ``torch.optim.Adam`` at the same learning rate).

MFU = model FLOPs per step x steps/s / the chip's dense bf16 peak (H100/H200: 989 TFLOP/s;
unknown chips print n/a). Model FLOPs are counted from the shapes (:func:`model_flops`: the
matmuls and attention, 3x the forward for a training step); XLA's cost analysis of the compiled
step is printed beside them (on a GPU it misses work done in library calls, and it changed
between two compiles of the same step: 950 and 729 GFLOP). ``--dry-run`` runs the same
code on CPU with tiny sizes (the suite runs it, so this script cannot rot).

Run: ``.venv/bin/python benchmarks/gpu_encoder.py [--dry-run] [--steps 20] [--batch 16]
[--ways r,a,t,l]`` (``tpu.sh`` runs all four; ``gpu.sh`` r, a, t).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

sys.path.insert(0, str(_HERE.parent))  # the repository: `benchmarks._x` helpers


import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import jaxcore  # noqa: E402
from benchmarks import _peers, _stats  # noqa: E402
from jaxcore.models.attention import attend  # noqa: E402

FULL = {"d": 512, "layers": 6, "heads": 8, "mlp": 2048, "frames": 1500, "mels": 80}
TINY = {"d": 32, "layers": 1, "heads": 2, "mlp": 64, "frames": 50, "mels": 8}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "TPU v5 lite": 197e12}


class FusedSelfAttention(nn.Module):
    """``nn.MultiHeadDotProductAttention``'s projections (``query``/``key``/``value``/``out``)
    around the recipes' attention call (``jaxcore.models.attention.attend``: cuDNN's fused
    kernel on a GPU in bf16), not Flax's own, which materialises every head's scores."""

    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, D]
        d = x.shape[-1]
        q, k, v = (
            nn.DenseGeneral((self.heads, d // self.heads), name=name)(x)
            for name in ("query", "key", "value")
        )
        return nn.DenseGeneral(d, axis=(-2, -1), name="out")(attend(q, k, v))


class FlaxEncoder(nn.Module):
    d: int
    layers: int
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:  # x: [B, T, mels]
        h = nn.Dense(self.d, name="proj")(x)
        for i in range(self.layers):
            y = nn.LayerNorm(epsilon=1e-5, name=f"ln1_{i}")(h)
            h = h + FusedSelfAttention(self.heads, name=f"attn_{i}")(y)
            y = nn.LayerNorm(epsilon=1e-5, name=f"ln2_{i}")(h)
            y = nn.Dense(self.mlp, name=f"fc1_{i}")(y)
            h = h + nn.Dense(self.d, name=f"fc2_{i}")(nn.gelu(y, approximate=False))
        h = nn.LayerNorm(epsilon=1e-5, name="ln_out")(h)
        return nn.Dense(10, name="head")(h.mean(axis=1))


class TorchEncoder(torch.nn.Module):
    def __init__(self, d: int, layers: int, heads: int, mlp: int, mels: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(mels, d)
        layer = torch.nn.TransformerEncoderLayer(
            d, heads, mlp, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.encoder(self.proj(x)))
        return self.head(h.mean(dim=1))


def lit_encoder(size: dict[str, int], lr: float) -> Any:
    """(l)'s module: the torch encoder inside a team's ``LightningModule``."""
    import lightning as L
    import torch.nn.functional as F

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TorchEncoder(
                size["d"], size["layers"], size["heads"], size["mlp"], size["mels"]
            )

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y.long())
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=lr)

    return Lit()


def model_flops(size: dict[str, int], batch: int) -> float:
    """Matmul and attention FLOPs of one training step (forward x 3), from the shapes."""
    tokens = batch * size["frames"]
    d, t = size["d"], size["frames"]
    layer = 2 * tokens * (4 * d * d + 2 * d * size["mlp"]) + 4 * batch * t * t * d
    forward = 2 * tokens * size["mels"] * d + size["layers"] * layer + 2 * batch * d * 10
    return 3.0 * forward


def reference_path(size: dict[str, int], batch: int) -> tuple[Any, float]:
    """(r): ``steps -> (seconds, steps)`` and the model FLOPs of one step."""
    model = FlaxEncoder(size["d"], size["layers"], size["heads"], size["mlp"])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, size["frames"], size["mels"])), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, batch), jnp.int32)
    params = model.init(jax.random.key(0), x)["params"]
    tx = optax.adam(1e-4)

    def loss_fn(p: Any) -> jax.Array:
        bf = jax.tree.map(lambda v: v.astype(jnp.bfloat16), p)
        logits = model.apply({"params": bf}, x.astype(jnp.bfloat16)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(p: Any, o: Any) -> Any:
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    # the compiled program's cost analysis (a lowered one has no FLOPs on GPU)
    jitted = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params)).compile()
    cost = jitted.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    flops = float((cost or {}).get("flops", float("nan")))
    holder = {"p": params, "o": tx.init(params)}

    def run(steps: int) -> tuple[float, int]:
        p, o = holder["p"], holder["o"]
        for _ in range(2):
            p, o, _ = jitted(p, o)
        jax.block_until_ready(p)
        t0 = time.perf_counter()
        for _ in range(steps):
            p, o, _ = jitted(p, o)
        jax.block_until_ready(p)
        holder["p"], holder["o"] = p, o
        return time.perf_counter() - t0, steps

    return run, flops


def _loader(size: dict[str, int], batch: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch * 4, size["frames"], size["mels"], generator=g)
    y = torch.randint(0, 10, (batch * 4,), generator=g, dtype=torch.int32)
    return DataLoader(TensorDataset(x, y), batch_size=batch, drop_last=True)


def shell_path(module: Any, loader: Any, warmup: int = 2) -> Any:
    """``steps -> (seconds, steps)`` for ``trainer.fit`` in bf16-mixed."""
    import lightning as L

    def run(steps: int) -> tuple[float, int]:
        clock = _peers.LightningClock(warmup, sync=lambda: jax.block_until_ready(module.state))
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            precision="bf16-mixed",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            max_steps=warmup + steps,
            callbacks=[clock],
        )
        trainer.fit(module, loader)
        return clock.result()  # type: ignore[no-any-return]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU: a smoke run")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument(
        "--ways", default="r,a,t", help="a comma list of r, a, t, l (r: always; default r,a,t)"
    )
    parser.add_argument(
        "--no-torch",
        action="store_true",
        help="leave out (t) and (l): where torchax 0.0.13 cannot load beside the machine's torch "
        "(a TPU machine's torch 2.13 CPU build)",
    )
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    size = TINY if args.dry_run else FULL
    steps, batch = (2, 4) if args.dry_run else (args.steps, args.batch)

    from torchshell import JaxModule

    ref, xla_flops = reference_path(size, batch)
    flops = model_flops(size, batch)
    tx = jaxcore.make_optimizer("adam", lr=1e-4)
    flax_module = JaxModule(
        FlaxEncoder(size["d"], size["layers"], size["heads"], size["mlp"]),
        jaxcore.softmax_cross_entropy,
        tx,
        print_summary=False,
    )
    loader = _loader(size, batch)
    paths = {
        "(r) pure Flax step, batches on device": ref,
        "(a) coreshell JaxModule, DataLoader, bf16-mixed": shell_path(flax_module, loader),
    }
    ways = set(args.ways.split(",")) - ({"t", "l"} if args.no_torch else set())
    if "a" not in ways:
        del paths["(a) coreshell JaxModule, DataLoader, bf16-mixed"]
    if "t" in ways:
        twin = TorchEncoder(size["d"], size["layers"], size["heads"], size["mlp"], size["mels"])
        torch_module = JaxModule.from_torch(
            twin, jaxcore.softmax_cross_entropy, tx, print_summary=False
        )
        paths["(t) JaxModule.from_torch (torch encoder), bf16-mixed"] = shell_path(
            torch_module, loader
        )
    if "l" in ways:
        lit_module = JaxModule.from_lightning(lit_encoder(size, 1e-4), print_summary=False)
        paths["(l) JaxModule.from_lightning (its LightningModule), bf16-mixed"] = shell_path(
            lit_module, loader
        )
    rates = _stats.rotate(paths, 1 if args.dry_run else 3, steps)
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_BF16.items() if k in kind), None)
    bench = f"gpu encoder d={size['d']} x{size['layers']}, {size['frames']} frames, B={batch}"
    ref_med = sorted(rates[next(iter(paths))])[len(rates[next(iter(paths))]) // 2]
    rows = []
    for name, r in rates.items():
        med = sorted(r)[len(r) // 2]
        mfu = f"MFU {flops * med / peak:.1%}" if peak and flops == flops else "MFU n/a"
        rows.append(
            _stats.row(
                bench,
                name,
                "steps/s",
                r,
                ratio=None if name.startswith("(r)") else med / ref_med,
                ratio_to=None if name.startswith("(r)") else "this / (r)",
                note=f"{mfu}; {flops / 1e9:,.1f} model GFLOP/step, XLA counts "
                f"{xla_flops / 1e9:,.1f}; {kind}",
            )
        )
    print(_stats.markdown(rows))
    if args.json:
        _stats.write_rows(args.json, rows, _stats.machine())


if __name__ == "__main__":
    main()
