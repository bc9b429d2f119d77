"""torch <-> JAX transfer: zero-copy, the copy policy, aliasing, sharding, padding, prefetch."""

import dataclasses
import gc
import json
import socket
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec

import bridge
import jaxcore
from jaxcore.models.digits import MLP


def _mesh(shape=(8,), names=("data",)):
    devices = np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


def _rows(shape=(8,), names=("data",)):
    return NamedSharding(_mesh(shape, names), PartitionSpec("data"))


def _misaligned(n: int, dtype=torch.float32) -> torch.Tensor:
    """A contiguous tensor whose data pointer sits one element past a 64-byte boundary."""
    base = torch.arange(n + 1).to(dtype)
    t = base[1:]
    assert t.data_ptr() % 64 and t.is_contiguous()
    return t


# -- zero-copy -------------------------------------------------------------------------------
def test_aligned_tensor_crosses_zero_copy():
    t = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    stats = bridge.new_stats()
    out = bridge.to_jax({"x": t}, stats=stats)["x"]
    assert out.unsafe_buffer_pointer() == t.data_ptr()
    assert stats.zero_copy_bytes == t.nbytes and stats.copied_bytes == 0 and not stats.copies


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.complex64,
    ],
)
def test_every_supported_dtype_crosses_zero_copy_with_its_values(dtype):
    t = (torch.arange(48) % 7).reshape(6, 8).to(dtype)
    scalar = t[1, 1].clone()  # 0-d
    stats = bridge.new_stats()
    out = bridge.to_jax({"t": t, "s": scalar}, stats=stats)
    assert out["t"].unsafe_buffer_pointer() == t.data_ptr()
    assert out["s"].shape == () and out["s"].unsafe_buffer_pointer() == scalar.data_ptr()
    assert out["t"].dtype == jnp.dtype(str(dtype).removeprefix("torch."))
    back = bridge.to_torch(out)
    assert torch.equal(back["t"], t) and torch.equal(back["s"], scalar)
    assert stats.copied_bytes == 0


def test_jax_to_torch_is_zero_copy():
    x = jnp.arange(1024, dtype=jnp.float32)
    assert bridge.to_torch({"x": x})["x"].data_ptr() == x.unsafe_buffer_pointer()


def test_pytrees_keep_their_structure():
    class Pair(NamedTuple):
        a: torch.Tensor
        b: torch.Tensor

    @dataclasses.dataclass(frozen=True)
    class Batch:
        x: torch.Tensor
        meta: str = "kept"

    t = torch.ones(8, 4)
    tree = {"list": [t, (t, Pair(t, t))], "dc": Batch(t)}
    out = bridge.to_jax(tree)
    assert isinstance(out["list"][1], tuple) and isinstance(out["list"][1][1], Pair)
    assert isinstance(out["dc"], Batch) and out["dc"].meta == "kept"
    for leaf in (out["list"][0], out["list"][1][1].b, out["dc"].x):
        assert isinstance(leaf, jax.Array) and leaf.unsafe_buffer_pointer() == t.data_ptr()
    back = bridge.to_torch(out)
    assert isinstance(back["dc"], Batch) and torch.equal(back["list"][1][1].a, t)


# -- the copy policy --------------------------------------------------------------------------
def test_int64_overflow_raises_instead_of_truncating():
    with pytest.raises(bridge.TransferError, match=r"'y'.*int64.*1099511627776.*int32"):
        bridge.to_jax({"y": torch.tensor([2**40, 1])})


def test_uint64_and_float64_overflow_raise():
    with pytest.raises(bridge.TransferError, match="uint32"):
        bridge.to_jax({"u": torch.tensor([2**33], dtype=torch.uint64)})
    with pytest.raises(bridge.TransferError, match="overflow"):
        bridge.to_jax({"f": torch.tensor([1e300, 1.0], dtype=torch.float64)})


def test_int64_in_range_is_one_counted_copy():
    stats = bridge.new_stats()
    out = bridge.to_jax({"y": torch.tensor([2**31 - 1, -(2**31), -5])}, stats=stats)["y"]
    assert out.dtype == jnp.int32 and out.tolist() == [2**31 - 1, -(2**31), -5]
    assert stats.copied_bytes == 12 and sum(stats.copies.values()) == 1
    assert "int64" in next(iter(stats.copies))[1]


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: _misaligned(64), "aligned"),
        (lambda: torch.arange(64.0).reshape(8, 8)[:, ::2], "non-contiguous"),
        (lambda: torch.arange(8.0).reshape(8, 1).expand(8, 8), "non-contiguous"),
        (lambda: torch.arange(64.0).reshape(8, 8).t(), "non-contiguous"),
        (lambda: torch.arange(8.0).requires_grad_(), "requires grad"),
        (lambda: torch.arange(8, dtype=torch.float64), "float64"),
    ],
)
def test_each_policy_case_is_one_counted_copy_with_equal_values(make, reason):
    t = make()
    stats = bridge.new_stats()
    out = bridge.to_jax({"f": t}, stats=stats)["f"]
    expected = t.detach().to(torch.float32).numpy()
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert out.unsafe_buffer_pointer() != t.data_ptr()
    ((name, why),) = stats.copies
    assert name == "f" and reason in why
    assert stats.copied_bytes == out.nbytes and stats.zero_copy_bytes == 0


@pytest.mark.parametrize(
    ("make", "found"),
    [
        (lambda: torch.ones(8, 8)[:, ::2], r"strides \(8, 2\).*non-contiguous"),
        (lambda: _misaligned(64), r"4 bytes past a 64-byte boundary.*not 64-byte aligned"),
        (lambda: torch.ones(3, dtype=torch.int64), r"torch.int64.*narrowed to int32"),
        (lambda: torch.ones(3).requires_grad_(), r"requires grad"),
    ],
)
def test_strict_mode_names_the_field(make, found):
    with pytest.raises(bridge.TransferError, match=rf"'cols'.*{found}.*Fix:"):
        bridge.to_jax({"cols": make()}, strict=True)


def test_unsupported_dtype_raises_with_the_fix():
    with pytest.raises(bridge.TransferError, match=r"'q'.*float8_e4m3fn.*Fix"):
        bridge.to_jax({"q": torch.zeros(4, dtype=torch.float8_e4m3fn)})


# -- aliasing ---------------------------------------------------------------------------------
def test_zero_copy_aliases_and_keeps_the_buffer_alive():
    t = torch.zeros(1024)
    x = bridge.to_jax(t)
    t[3] = 7.0  # in-place torch writes are visible to JAX: the memory is shared
    assert float(x[3]) == 7.0
    del t
    gc.collect()
    noise = [torch.full((1024,), 9.0) for _ in range(64)]  # would reuse a freed buffer
    assert float(x.sum()) == 7.0 and len(noise) == 64


def test_requires_grad_tensor_is_not_aliased():
    w = torch.zeros(16, requires_grad=True)
    x = bridge.to_jax(w)
    with torch.no_grad():
        w.add_(1.0)  # e.g. an optimizer step on a parameter
    assert float(x.sum()) == 0.0


# -- sharded global batches -------------------------------------------------------------------
def test_sharded_batch_is_one_global_array_over_the_host_buffer():
    sharding = NamedSharding(_mesh((4, 2), ("data", "model")), PartitionSpec("data"))
    x = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    y = torch.arange(64, dtype=torch.int32)
    stats = bridge.new_stats()
    out = bridge.to_jax({"x": x, "y": y, "step": torch.tensor(3)}, sharding, stats=stats)
    assert out["x"].sharding == sharding and out["x"].shape == (64, 32)
    assert out["step"].sharding.is_fully_replicated and int(out["step"]) == 3
    np.testing.assert_array_equal(np.asarray(out["x"]), x.numpy())
    np.testing.assert_array_equal(np.asarray(out["y"]), y.numpy())
    for shard in out["x"].addressable_shards:  # every shard is a view of x: no host copy
        rows = shard.index[0].start
        assert shard.data.unsafe_buffer_pointer() == x[rows].data_ptr()
    # x and y (16 rows x 4 bytes = 64 per shard) alias; the int64 step is narrowed (one copy)
    assert stats.zero_copy_bytes == x.nbytes + y.nbytes
    assert [name for name, _ in stats.copies] == ["step"]


def test_misaligned_shards_are_counted_or_refused():
    y = torch.arange(64, dtype=torch.int32)  # 8 rows x 4 bytes: odd shards are 32 bytes off
    stats = bridge.new_stats()
    out = bridge.to_jax({"y": y}, _rows(), stats=stats)
    np.testing.assert_array_equal(np.asarray(out["y"]), y.numpy())
    assert stats.copied_bytes == 4 * 32 and stats.zero_copy_bytes == 4 * 32
    with pytest.raises(bridge.TransferError, match=r"'y'.*not 64-byte aligned.*Fix"):
        bridge.to_jax({"y": y}, _rows(), strict=True)


def test_padding_adds_mask_and_shards():
    sharding = _rows()
    out = bridge.to_jax({"x": torch.ones(5, 3)}, sharding, pad_to=8)
    assert out["x"].shape == (8, 3) and out["mask"].tolist() == [True] * 5 + [False] * 3
    assert np.asarray(out["x"])[5:].sum() == 0
    assert len(out["x"].sharding.device_set) == 8
    assert out["mask"].sharding.spec == PartitionSpec("data")


def test_indivisible_batch_is_padded_to_the_next_multiple():
    stats = bridge.new_stats()
    out = bridge.to_jax({"x": torch.ones(65, 2), "y": torch.ones(65)}, _rows(), stats=stats)
    assert out["x"].shape == (72, 2) and int(out["mask"].sum()) == 65
    assert ("x", "ragged batch padded to 72 rows") in stats.copies
    full = bridge.to_jax({"x": torch.ones(7, 2)}, _rows(), pad_to=7)  # rounded up to 8
    assert full["x"].shape == (8, 2)


def test_padding_needs_a_mapping_and_room():
    with pytest.raises(bridge.TransferError, match=r"must be a Mapping.*got list"):
        bridge.to_jax([torch.ones(5, 3)], _rows(), pad_to=8)
    with pytest.raises(bridge.TransferError, match="13 rows, more than pad_to=8"):
        bridge.to_jax({"x": torch.ones(13, 3)}, pad_to=8)
    with pytest.raises(bridge.TransferError, match="same leading"):
        bridge.to_jax({"x": torch.ones(5, 3), "y": torch.ones(4)}, pad_to=8)


def test_ragged_digits_eval_is_exact_with_one_compiled_step():
    from torchshell.data.digits import DigitsDataset

    ds = DigitsDataset()
    model = jaxcore.linen_model(MLP(features=(32,)))
    mesh = jaxcore.make_mesh({"data": -1})
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    sample = {"x": jnp.zeros((64, 64)), "y": jnp.zeros(64, jnp.int32)}
    state = jaxcore.init_train_state(model, jaxcore.make_optimizer(), sample, seed=3, mesh=mesh)
    step = jaxcore.make_eval_step(model, jaxcore.softmax_cross_entropy)
    loader = torch.utils.data.DataLoader(ds, batch_size=64)
    totals = {"accuracy": 0.0, "count": 0.0, "loss": 0.0}
    for batch in bridge.prefetch(loader, sharding=sharding, pad_to=64):
        sums = jax.device_get(step(state, batch))
        totals = {k: totals[k] + float(sums[k]) for k in totals}
    assert step.compiles == 1  # 28 full batches and one of 5 rows: the same program

    # reference: one device, all 1,797 rows in one batch, no padding and no mask
    single = jax.devices()[0]
    ref_state = jax.device_put(state, single)
    ref = jaxcore.make_eval_step(model, jaxcore.softmax_cross_entropy)(
        ref_state, {"x": jax.device_put(ds.x.numpy(), single), "y": jnp.asarray(ds.y.numpy())}
    )
    assert totals["count"] == len(ds) == float(ref["count"]) == 1797
    assert totals["accuracy"] == float(ref["accuracy"])  # exact: a count of right answers
    assert totals["loss"] == pytest.approx(float(ref["loss"]), rel=1e-5)


# -- prefetch ---------------------------------------------------------------------------------
def test_prefetch_keeps_order_and_shards():
    batches = [{"x": torch.full((8, 2), float(i))} for i in range(6)]
    stats = bridge.new_stats()
    with bridge.prefetch(iter(batches), size=2, sharding=_rows(), stats=stats) as it:
        got = [float(b["x"][0, 0]) for b in it]
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and stats.transfers == 6


def test_prefetch_reraises_the_loaders_error_in_order():
    def loader():
        yield {"x": torch.ones(2)}
        raise OSError("disk gone")

    it = bridge.prefetch(loader())
    assert float(next(it)["x"][0]) == 1.0
    with pytest.raises(OSError, match="disk gone"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_prefetch_stops_its_thread_when_closed_early():
    def endless():
        while True:
            yield {"x": torch.ones(2)}

    it = bridge.prefetch(endless(), size=1)
    next(it)
    it.close()
    assert not it._thread.is_alive()
    with pytest.raises(bridge.PrefetchError, match="size"):
        bridge.prefetch([], size=0)


# -- several processes ------------------------------------------------------------------------
_WORKER = """
import json
import os
import sys

pid, port = int(sys.argv[1]), sys.argv[2]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax

jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import jax.numpy as jnp
import torch
from jax.sharding import NamedSharding, PartitionSpec

import bridge
import jaxcore

sharding = NamedSharding(jaxcore.make_mesh({"data": -1}), PartitionSpec("data"))
n = 30 if pid == 0 else 27  # this process's rows: both ragged
rows = torch.arange(n, dtype=torch.float32) + 1000 * pid
batch = {"x": rows[:, None].repeat(1, 16).contiguous(), "y": rows.to(torch.int32)}
stats = bridge.new_stats()
out = bridge.to_jax(batch, sharding, pad_to=32, stats=stats)
total = jax.jit(lambda b: jnp.sum(b["x"][:, 0] * b["mask"]))(out)
gathered = bridge.to_torch(out)
print("RESULT", json.dumps([list(out["x"].shape), float(total), gathered["y"].tolist()]))
jax.distributed.shutdown()
"""


def test_two_processes_each_pass_their_rows_into_one_global_batch(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    expected_y = [*range(30), 0, 0, *range(1000, 1027), 0, 0, 0, 0, 0]
    for out in outs:
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert lines, out[-3000:]
        shape, total, ys = json.loads(lines[0].removeprefix("RESULT "))
        # 30 + 27 ragged local rows, each padded to 32: one (64, 16) array in process order
        assert shape == [64, 16] and total == sum(range(30)) + sum(range(1000, 1027))
        assert ys == expected_y


# -- accelerators -----------------------------------------------------------------------------
@pytest.mark.skipif(
    not torch.cuda.is_available() or not any(d.platform == "gpu" for d in jax.devices()),
    reason="needs a CUDA device visible to both torch and JAX (this machine has none)",
)
def test_cuda_tensor_is_handed_over_in_stream_order():
    device = next(d for d in jax.devices() if d.platform == "gpu")
    side = torch.cuda.Stream(device=device.id)
    with torch.cuda.stream(side):
        t = torch.zeros(1 << 22, device=f"cuda:{device.id}")
        for _ in range(20):  # queued work the consumer must wait for
            t.add_(1.0)
        stats = bridge.new_stats()
        out = bridge.to_jax({"t": t}, stats=stats)["t"]
    assert out.unsafe_buffer_pointer() == t.data_ptr()
    assert float(out.sum()) == 20.0 * t.numel() and stats.zero_copy_bytes == t.nbytes
    back = bridge.to_torch(out * 2)
    assert back.device.type == "cuda" and float(back[0]) == 40.0
