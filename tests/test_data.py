"""Deterministic global batches and their layout over devices (pure numpy)."""

import numpy as np
import pytest

from jaxft.worker.data import GlobalBatches, Layout


def test_each_example_once_per_epoch_and_deterministic():
    data = GlobalBatches({"x": np.arange(10)}, global_batch=4, seed=3)
    first_epoch = np.concatenate([data.indices(s) for s in range(5)])[:10]  # 20 positions: 2 epochs
    assert sorted(first_epoch.tolist()) == list(range(10))
    again = GlobalBatches({"x": np.arange(10)}, global_batch=4, seed=3)
    for s in range(7):
        np.testing.assert_array_equal(data.indices(s), again.indices(s))
    other = GlobalBatches({"x": np.arange(10)}, global_batch=4, seed=4)
    assert any((data.indices(s) != other.indices(s)).any() for s in range(3))


def test_batch_gathers_every_leaf():
    data = GlobalBatches({"x": np.arange(6) * 10, "y": np.arange(6)}, global_batch=3, shuffle=False)
    b = data.batch(1)
    np.testing.assert_array_equal(b["x"], [30, 40, 50])
    np.testing.assert_array_equal(b["y"], [3, 4, 5])


def test_bad_dataset():
    with pytest.raises(ValueError, match="disagree"):
        GlobalBatches({"x": np.zeros(3), "y": np.zeros(4)}, 2)
    with pytest.raises(ValueError, match="global_batch"):
        GlobalBatches({"x": np.zeros(3)}, 0)


@pytest.mark.parametrize("g,d,m", [(10, 3, None), (10, 3, 2), (12, 4, None), (7, 2, 1), (5, 8, None)])
def test_layout_covers_batch_exactly_once(g, d, m):
    layout = Layout.plan(g, d, m)
    x = np.arange(1, g + 1)
    arranged, mask = layout.arrange(x), layout.mask()
    assert arranged.shape == mask.shape == (layout.num_micro, d * layout.micro_size)
    assert sorted(arranged[mask > 0].tolist()) == list(range(1, g + 1))
    assert (arranged[mask == 0] == x[0]).all()  # padding: copies of a real example, never zeros
    assert (layout.arrange(x, pad_with_zeros=True)[mask == 0] == 0).all()
    if m:
        assert layout.micro_size <= m


def test_grain_batches_same_examples_whatever_the_width():
    """Step k is the same global batch for any split; each process's share is its positions."""
    import jax

    from jaxft.worker.data import Layout
    from jaxft.worker.grain_source import GrainBatches

    source = [{"x": np.full(3, i, np.float32), "y": np.int32(i)} for i in range(50)]
    data = GrainBatches(source, global_batch=12, seed=5, num_threads=1, prefetch=1)
    other = GrainBatches(source, global_batch=12, seed=5, num_threads=2, prefetch=3)
    for step in (0, 3, 4, 9):  # 9 crosses into a later epoch
        full = data.batch(step)
        if step < 4:  # inside the first epoch: no example twice
            assert len(set(full["y"].tolist())) == 12
        jax.tree_util.tree_map(np.testing.assert_array_equal, full, other.batch(step))
        for width in (1, 2, 3, 5):
            layout = Layout.plan(12, width)
            for d in range(width):
                pos = layout.positions(d)
                part = data.local_batch(step, pos)
                np.testing.assert_array_equal(part["y"], full["y"][pos])
                np.testing.assert_array_equal(part["x"], full["x"][pos])
    epoch0 = np.concatenate([data.batch(s)["y"] for s in range(4)])[:50]  # 48 + 2 of step 4
    assert len(set(epoch0[:48].tolist())) == 48  # a permutation within the epoch
