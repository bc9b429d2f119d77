"""``jaxcore.rows``: jaxcore's one definition of a batch's rows (issue #53)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxcore


def test_rows_is_the_size_every_array_shares_on_the_axis():
    batch = {"x": np.ones((6, 3)), "y": jnp.zeros(6), "n": jnp.int32(2), "tag": "a"}
    assert jaxcore.rows(batch) == 6
    assert jaxcore.rows({"x": np.ones((2, 6, 3)), "y": np.ones((2, 6))}, axis=1) == 6
    assert jaxcore.rows(({"x": np.ones((5, 1))}, [np.ones(5)])) == 5  # any pytree


def test_rows_of_fields_that_differ_names_them_unless_a_default_is_given():
    batch = {"x": np.ones((4, 2)), "ids": np.ones(7)}
    with pytest.raises(jaxcore.BatchError, match=r"same number of rows.*'ids'.*7.*'x'.*4"):
        jaxcore.rows(batch)
    assert jaxcore.rows(batch, default=0) == 0
    with pytest.raises(jaxcore.BatchError, match=r"no array fields\. Fix"):
        jaxcore.rows({"n": np.float32(1)})
    with pytest.raises(jaxcore.BatchError, match="no array fields with an axis 1"):
        jaxcore.rows({"y": np.ones(3)}, axis=1)
