"""The bridge's one torch <-> numpy/JAX conversion path: bf16, views, narrowing, gathers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import bridge

BF16 = np.dtype(jnp.bfloat16)


def test_export_state_dict_of_a_numpy_bf16_tree():
    # What a multi-process gather gives: ml_dtypes.bfloat16 ndarrays. It used to fail with
    # "TypeError: can't convert np.ndarray of type ml_dtypes.bfloat16".
    kernel = np.arange(6, dtype=np.float32).reshape(3, 2).astype(BF16)
    params = {"head": {"kernel": kernel, "bias": np.array([0.5, -1.0], dtype=BF16)}}
    module = torch.nn.ModuleDict({"head": torch.nn.Linear(3, 2)}).to(torch.bfloat16)
    sd = bridge.export_state_dict(params, module)
    assert sd["head.weight"].dtype == torch.bfloat16
    assert sd["head.weight"].float().tolist() == kernel.astype(np.float32).T.tolist()
    assert sd["head.bias"].float().tolist() == [0.5, -1.0]
    module.load_state_dict(sd)
    # ... and back: the import fills a bf16 numpy template with the same bits.
    back = bridge.import_state_dict(sd, params)
    assert back["head"]["kernel"].dtype == BF16
    assert (back["head"]["kernel"].view(np.uint16) == kernel.view(np.uint16)).all()


def test_export_state_dict_of_a_read_only_numpy_tree():
    w = np.ones((2, 2), np.float32)
    w.setflags(write=False)
    sd = bridge.export_state_dict({"w": w})
    assert sd["w"].tolist() == [[1.0, 1.0], [1.0, 1.0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_as_numpy_and_as_torch_are_views_of_the_same_bits(dtype: torch.dtype):
    t = torch.linspace(-2, 2, 8).to(dtype)
    a = bridge.as_numpy(t)
    assert a.dtype.itemsize == t.element_size() and a.shape == (8,)
    assert a.ctypes.data == t.data_ptr()  # a view, no copy
    back = bridge.as_torch(a)
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr()
    assert torch.equal(back.float(), t.float())


def test_as_numpy_of_a_non_contiguous_bf16_tensor():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16).T
    assert bridge.as_numpy(t).astype(np.float32).tolist() == t.float().tolist()


def test_as_torch_of_negative_strides_and_jax_arrays():
    a = np.arange(4, dtype=np.float32)[::-1]
    assert bridge.as_torch(a).tolist() == [3.0, 2.0, 1.0, 0.0]
    x = jnp.arange(4, dtype=jnp.bfloat16)
    t = bridge.as_torch(x)
    assert t.dtype == torch.bfloat16 and t.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_as_torch_gathers_a_sharded_array():
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    x = jax.device_put(
        jnp.arange(8.0, dtype=jnp.bfloat16), NamedSharding(mesh, PartitionSpec("data"))
    )
    t = bridge.as_torch(x)
    assert t.dtype == torch.bfloat16 and t.float().tolist() == list(range(8))
    assert bridge.as_numpy(x).astype(np.float32).tolist() == list(range(8))


def test_as_jax_copies_and_narrows_with_a_range_check():
    t = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    x = bridge.as_jax(t)
    t.add_(1)  # a copy: later torch writes never reach JAX
    assert x.dtype == jnp.bfloat16 and x.tolist() == [1.0, 2.0]
    assert bridge.as_jax(torch.tensor([2**31 - 1])).dtype == jnp.int32
    assert bridge.as_jax(np.array([1.5])).dtype == jnp.float32
    with pytest.raises(bridge.TransferError, match=r"values in \[0, 1099511627776\] do not fit"):
        bridge.as_jax(torch.tensor([0, 2**40]), name="ids")
    with pytest.raises(bridge.TransferError, match=r"'ids'.*int32"):
        bridge.as_jax(np.array([2**40]), name="ids")
    # Without the check the value wraps like a C cast (the caller asked for it).
    assert bridge.as_jax(torch.tensor([2**32 + 3]), check_range=False).tolist() == [3]


def test_narrow_refuses_float_overflow_and_keeps_other_dtypes():
    with pytest.raises(bridge.TransferError, match="overflow"):
        bridge.narrow("x", torch.tensor([1e300], dtype=torch.float64))
    f = torch.ones(2)
    assert bridge.narrow("x", f) is f
    u = bridge.narrow("u", torch.tensor([5], dtype=torch.uint64))
    assert u.dtype == torch.uint32 and int(u[0]) == 5


def test_round_up_and_path_str():
    assert [bridge.round_up(n, 8) for n in (0, 1, 8, 65)] == [0, 8, 8, 72]
    flat = jax.tree_util.tree_flatten_with_path({"a": [{"b": 1}]})[0]
    assert bridge.path_str(flat[0][0]) == "a/0/b"
