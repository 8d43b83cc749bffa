"""The batch plan: the union of the ranks' shares is the uninterrupted global batch, for any world
size and any resize point; each epoch covers every sample once (the dropped tail aside)."""

import pytest
import torch

from elastic_mnist.data.mnist import BatchPlan, load_split, shard_bounds, write_synthetic_mnist


def test_shard_bounds_cover_everything_in_order():
    for n in (1, 7, 128, 1000):
        for world in range(1, min(n, 5) + 1):
            bounds = [shard_bounds(n, world, r) for r in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [e - s for s, e in bounds]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_union_of_ranks_equals_global_batch_for_every_world_size():
    plan = BatchPlan(1000, 128, seed=3)
    for step in range(0, 3 * plan.steps_per_epoch):
        expected = plan.global_indices(step)
        for world in (1, 2, 3, 4):
            parts = [plan.rank_indices(step, world, r) for r in range(world)]
            assert torch.equal(torch.cat(parts), expected)


def test_resizes_mid_epoch_replay_the_uninterrupted_order():
    """World sizes change at arbitrary steps; the concatenated sequence of global batches is unchanged."""
    n, b = 1000, 128
    straight = BatchPlan(n, b, seed=0)
    total = 3 * straight.steps_per_epoch
    schedule = {0: 2, 3: 1, 5: 4, 9: 3, 13: 2, 17: 1}  # step -> new world size
    world, seen = 2, []
    for step in range(total):
        world = schedule.get(step, world)
        fresh = BatchPlan(n, b, seed=0)  # a restarted process rebuilds the plan from the step alone
        seen.append(torch.cat([fresh.rank_indices(step, world, r) for r in range(world)]))
    assert all(torch.equal(s, straight.global_indices(i)) for i, s in enumerate(seen))


def test_each_epoch_uses_every_sample_once_and_drops_the_same_tail_size():
    plan = BatchPlan(1000, 128, seed=0)
    assert plan.steps_per_epoch == 7  # 1000 // 128; the last 104 are dropped each epoch
    for epoch in range(3):
        steps = range(epoch * 7, (epoch + 1) * 7)
        used = torch.cat([plan.global_indices(s) for s in steps])
        assert len(used) == len(set(used.tolist())) == 7 * 128
    e0 = set(torch.cat([plan.global_indices(s) for s in range(7)]).tolist())
    e1 = set(torch.cat([plan.global_indices(s) for s in range(7, 14)]).tolist())
    assert e0 != e1, "a different permutation each epoch, so the dropped tail changes"


def test_permutation_depends_on_seed_and_epoch_only():
    a, b, c = BatchPlan(500, 50, 0), BatchPlan(500, 50, 0), BatchPlan(500, 50, 1)
    assert torch.equal(a.permutation(2), b.permutation(2))
    assert not torch.equal(a.permutation(2), a.permutation(3))
    assert not torch.equal(a.permutation(2), c.permutation(2))


def test_generated_idx_files_load_through_torchvision(tmp_path):
    root = write_synthetic_mnist(tmp_path, n_train=300, n_test=50)
    train, test = load_split(str(root), True), load_split(str(root), False)
    assert train.images.shape == (300, 784) and test.images.shape == (50, 784)
    assert train.labels.dtype == torch.int64 and set(train.labels.tolist()) <= set(range(10))
    assert abs(train.images.mean().item()) < 2.0  # normalized with MNIST's mean/std


@pytest.mark.vision
def test_direct_idx_reader_matches_torchvision(tmp_path):
    from torchvision.datasets import MNIST

    from elastic_mnist.data.mnist import read_idx

    root = write_synthetic_mnist(tmp_path, n_train=200, n_test=40)
    for train, prefix in ((True, "train"), (False, "t10k")):
        ds = MNIST(root=str(root), train=train, download=False)
        raw = root / "MNIST" / "raw"
        assert torch.equal(read_idx(raw / f"{prefix}-images-idx3-ubyte"), ds.data)
        assert torch.equal(read_idx(raw / f"{prefix}-labels-idx1-ubyte").long(), ds.targets)


def test_truncated_idx_file_is_a_clear_error(tmp_path):
    import pytest

    from elastic_mnist.contract.errors import UserError

    root = write_synthetic_mnist(tmp_path, n_train=100, n_test=20)
    path = root / "MNIST" / "raw" / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(UserError, match="truncated"):
        load_split(str(root), True)


def test_global_batch_smaller_than_the_world_is_refused():
    import pytest

    from elastic_mnist.config import TrainConfig
    from elastic_mnist.contract.errors import UserError

    TrainConfig(global_batch_size=4).check_world_size(4)
    with pytest.raises(UserError, match="smaller than the world size 5"):
        TrainConfig(global_batch_size=4).check_world_size(5)


# The decoded-split cache (data/cache.py): a restart maps the tensors instead of decoding them again.

def _cache_files(directory):
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def _fresh_decode(root, train=True):
    from elastic_mnist.data.mnist import RAW_FILES, normalize, read_idx

    raw = root / "MNIST" / "raw"
    images = read_idx(raw / RAW_FILES[(train, "images")])
    return normalize(images.reshape(len(images), -1)), read_idx(raw / RAW_FILES[(train, "labels")]).long()


def test_second_load_maps_the_cache_and_gives_the_same_tensors(tmp_path, monkeypatch):
    from elastic_mnist.data import mnist as data

    root = write_synthetic_mnist(tmp_path / "data", n_train=300, n_test=50)
    cache = tmp_path / "cache"
    first = load_split(str(root), True, cache_dir=cache)
    names = _cache_files(cache)
    assert len(names) == 1 and names[0].startswith("mnist-train-") and names[0].endswith(".bin")  # no temp left
    images, labels = _fresh_decode(root)

    def no_decode(path):
        raise AssertionError(f"decoded {path} although a valid cache exists")

    monkeypatch.setattr(data, "read_idx", no_decode)
    second = load_split(str(root), True, cache_dir=cache)
    for split in (first, second):
        assert torch.equal(split.images, images) and torch.equal(split.labels, labels)


def test_default_cache_lives_beside_the_data(tmp_path, monkeypatch):
    monkeypatch.delenv("ELASTIC_MNIST_CACHE_DIR", raising=False)
    root = write_synthetic_mnist(tmp_path / "data", n_train=100, n_test=20)
    load_split(str(root), False)
    assert [n[:11] for n in _cache_files(root / "MNIST" / "cache")] == ["mnist-test-"]


def _damage(path, how):
    blob = bytearray(path.read_bytes())
    if how == "truncated":
        blob = blob[:len(blob) - 1000]
    elif how == "payload":  # every image row zeroed, size and header intact
        blob[4096:4096 + 300 * 784 * 4] = bytes(300 * 784 * 4)
    elif how == "labels":
        blob[-8:] = (99).to_bytes(8, "little")
    else:
        blob[:20] = b"\x00garbage header\xff\xfe\x00"
    path.write_bytes(bytes(blob))


def test_a_corrupt_cache_is_ignored_and_rebuilt(tmp_path):
    import pytest

    root = write_synthetic_mnist(tmp_path / "data", n_train=300, n_test=50)
    cache = tmp_path / "cache"
    images, labels = _fresh_decode(root)
    load_split(str(root), True, cache_dir=cache)
    path = cache / _cache_files(cache)[0]
    for how in ("truncated", "payload", "labels", "header"):
        _damage(path, how)
        split = load_split(str(root), True, cache_dir=cache)
        assert torch.equal(split.images, images) and torch.equal(split.labels, labels), how
        assert load_split(str(root), True, cache_dir=cache).images.sum() == pytest.approx(images.sum().item()), how


def test_a_stale_cache_is_rebuilt_when_the_raw_files_change(tmp_path):
    root = write_synthetic_mnist(tmp_path / "data", n_train=200, n_test=40, seed=0)
    cache = tmp_path / "cache"
    old = load_split(str(root), True, cache_dir=cache)
    write_synthetic_mnist(root, n_train=200, n_test=40, seed=1)  # same size, different content
    new = load_split(str(root), True, cache_dir=cache)
    images, labels = _fresh_decode(root)
    assert not torch.equal(old.labels, new.labels)
    assert torch.equal(new.images, images) and torch.equal(new.labels, labels)


def test_no_writable_cache_place_still_loads(tmp_path):
    root = write_synthetic_mnist(tmp_path / "data", n_train=100, n_test=20)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would go")
    split = load_split(str(root), True, cache_dir=blocker / "cache")
    images, _ = _fresh_decode(root)
    assert torch.equal(split.images, images) and blocker.read_text().startswith("a file")
