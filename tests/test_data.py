import gzip
import hashlib
import io
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from sphereml import data
from sphereml.data import DataError

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
has_fashion = pytest.mark.skipif(not FASHION_DIR.is_dir(), reason="dataset-fashion-mnist not installed")


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


@pytest.fixture
def tiny_fashion(tmp_path, monkeypatch):
    """A 5-image Fashion-MNIST look-alike whose checksums the loader is told to expect."""
    rng = np.random.default_rng(0)
    arrays = {
        ("train", "images"): rng.integers(0, 256, (5, 28, 28)),
        ("train", "labels"): np.array([0, 1, 2, 3, 9]),
        ("test", "images"): rng.integers(0, 256, (2, 28, 28)),
        ("test", "labels"): np.array([4, 5]),
    }
    table = {}
    for key, arr in arrays.items():
        stem = data._FASHION_MNIST_FILES[key][0]
        payload = idx_bytes(arr)
        (tmp_path / f"{stem}.gz").write_bytes(gzip.compress(payload))
        table[key] = (stem, hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(data, "_FASHION_MNIST_FILES", table)
    return tmp_path, arrays


def test_fashion_loader_reads_idx_and_scales(tiny_fashion):
    root, arrays = tiny_fashion
    ds = data.load_fashion_mnist("train", root=root)
    x, y = ds.tensors
    assert x.shape == (5, 1, 28, 28) and x.dtype == torch.float32
    assert torch.allclose(x[:, 0] * 255, torch.from_numpy(arrays[("train", "images")]).float())
    assert y.tolist() == [0, 1, 2, 3, 9] and y.dtype == torch.int64


def test_fashion_loader_reads_uncompressed_files(tiny_fashion):
    root, _ = tiny_fashion
    for f in root.glob("*.gz"):
        f.with_suffix("").write_bytes(gzip.decompress(f.read_bytes()))
        f.unlink()
    assert len(data.load_fashion_mnist("test", root=root)) == 2


def test_corrupt_file_names_file_and_expected_checksum(tiny_fashion):
    root, _ = tiny_fashion
    stem, checksum = data._FASHION_MNIST_FILES[("train", "labels")]
    path = root / f"{stem}.gz"
    raw = bytearray(gzip.decompress(path.read_bytes()))
    raw[-1] ^= 0xFF
    path.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(DataError, match=rf"{stem}\.gz.*expected {checksum}"):
        data.load_fashion_mnist("train", root=root)


def test_truncated_gzip_names_file_and_expected_checksum(tiny_fashion):
    root, _ = tiny_fashion
    stem, checksum = data._FASHION_MNIST_FILES[("train", "images")]
    path = root / f"{stem}.gz"
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(DataError, match=rf"{stem}\.gz.*truncated.*{checksum}"):
        data.load_fashion_mnist("train", root=root)


def test_missing_files_explain_where_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "search_paths", lambda name, root=None: [tmp_path])
    with pytest.raises(DataError, match="dataset-fashion-mnist"):
        data.load_fashion_mnist("train")


def test_bad_split():
    with pytest.raises(ValueError, match="split must be one of"):
        data.load_fashion_mnist("validation")


def test_search_order_prefers_root_then_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SPHEREML_DATA", str(tmp_path / "env"))
    paths = data.search_paths("fashion-mnist", root=tmp_path / "root")
    assert paths[0] == tmp_path / "root"
    assert paths[1] == tmp_path / "env" / "fashion-mnist"
    assert Path("/usr/share/datasets/fashion-mnist") in paths


@has_fashion
def test_real_fashion_mnist_checksums_and_shapes():
    test = data.load_fashion_mnist("test")
    x, y = test.tensors
    assert x.shape == (10000, 1, 28, 28)
    assert torch.bincount(y).tolist() == [1000] * 10
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0


# ------------------------------------------------------------------------------ downloads
def test_download_verifies_and_is_atomic(tmp_path, monkeypatch):
    monkeypatch.delenv("SPHEREML_NO_DOWNLOAD", raising=False)
    src = tmp_path / "remote.bin"
    src.write_bytes(b"hello sphere")
    good = hashlib.sha256(b"hello sphere").hexdigest()
    dest = tmp_path / "cache" / "file.bin"
    data.download_file(src.as_uri(), dest, good)
    assert dest.read_bytes() == b"hello sphere"

    dest2 = tmp_path / "cache" / "bad.bin"
    with pytest.raises(DataError, match=f"expected {'0' * 64}"):
        data.download_file(src.as_uri(), dest2, "0" * 64)
    assert not dest2.exists()
    assert not list((tmp_path / "cache").glob("*.part"))  # no partial file left behind


def test_interrupted_download_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("SPHEREML_NO_DOWNLOAD", raising=False)

    class Broken(io.BytesIO):
        def read(self, n=-1):
            raise ConnectionResetError("connection dropped")

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(data.urllib.request, "urlopen", lambda url, timeout: Broken())
    with pytest.raises(DataError, match="connection dropped"):
        data.download_file("http://example.invalid/x", tmp_path / "x.bin", "0" * 64)
    assert list(tmp_path.iterdir()) == []


def test_fetch_fashion_mnist_verifies_present_files_and_downloads_missing_ones(tiny_fashion, monkeypatch):
    remote, arrays = tiny_fashion
    monkeypatch.delenv("SPHEREML_NO_DOWNLOAD", raising=False)
    monkeypatch.setattr(data, "_FASHION_MNIST_URL", remote.as_uri() + "/")
    monkeypatch.setattr(data, "search_paths", lambda name, root=None: [Path(root)])  # this machine's copy unseen
    local = remote / "local"
    local.mkdir()
    train_images = data._FASHION_MNIST_FILES[("train", "images")][0] + ".gz"
    (local / train_images).write_bytes((remote / train_images).read_bytes())  # one file already here
    paths = data.fetch_fashion_mnist(root=local)
    assert [p.parent for p in paths] == [local] * 4 and sorted(p.name for p in local.iterdir()) == sorted(
        p.name for p in paths)
    assert data.load_fashion_mnist("test", root=local).tensors[1].tolist() == [4, 5]
    (local / train_images).write_bytes(gzip.compress(b"not the images"))
    with pytest.raises(DataError, match=train_images.removesuffix(".gz")):
        data.fetch_fashion_mnist(root=local)  # a corrupt file is named, not used
    monkeypatch.setenv("SPHEREML_NO_DOWNLOAD", "1")
    with pytest.raises(RuntimeError, match="SPHEREML_NO_DOWNLOAD"):
        data.fetch_fashion_mnist(root=remote / "empty")


def test_downloads_refused_during_tests(tmp_path):
    with pytest.raises(RuntimeError, match="SPHEREML_NO_DOWNLOAD"):
        data.download_file("http://example.invalid/x", tmp_path / "x.bin", "0" * 64)


# ---------------------------------------------------------------------------------- CIFAR
def write_cifar(path: Path, num_classes: int, n: int = 4):
    rng = np.random.default_rng(1)
    label_key = "labels" if num_classes == 10 else "fine_labels"
    members = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"] if num_classes == 10 else ["train", "test"]
    folder = "cifar-10-batches-py" if num_classes == 10 else "cifar-100-python"
    with tarfile.open(path, "w:gz") as tar:
        for m in members:
            batch = {b"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8),
                     label_key.encode(): list(rng.integers(0, num_classes, n))}
            blob = pickle.dumps(batch)
            info = tarfile.TarInfo(f"{folder}/{m}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("num_classes", [10, 100])
def test_cifar_archive_reader(tmp_path, monkeypatch, num_classes):
    name = data._CIFAR_ARCHIVES[num_classes][0]
    md5 = write_cifar(tmp_path / name, num_classes)
    monkeypatch.setitem(data._CIFAR_ARCHIVES, num_classes, (name, "md5", md5, "unused"))
    train = data.load_cifar(num_classes, "train", root=tmp_path)
    test = data.load_cifar(num_classes, "test", root=tmp_path)
    assert train.tensors[0].shape == ((20 if num_classes == 10 else 4), 3, 32, 32)
    assert len(test) == 4
    assert int(train.tensors[1].max()) < num_classes


def test_cifar_checksum_mismatch(tmp_path, monkeypatch):
    name = data._CIFAR_ARCHIVES[10][0]
    write_cifar(tmp_path / name, 10)
    monkeypatch.setitem(data._CIFAR_ARCHIVES, 10, (name, "md5", "f" * 32, "unused"))
    with pytest.raises(DataError, match=f"{name}.*expected {'f' * 32}"):
        data.load_cifar(10, root=tmp_path)


def test_cifar_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="num_classes must be 10 or 100"):
        data.load_cifar(20)
    with pytest.raises(DataError, match="not found"):
        data.load_cifar(10, root=tmp_path / "empty")


# --------------------------------------------------------------------- digits, synthetic
def test_digits_split_is_deterministic_stratified_and_disjoint():
    train, test = data.load_digits("train"), data.load_digits("test")
    assert len(train) + len(test) == 1797
    assert train.tensors[0].shape[1:] == (1, 8, 8) and float(train.tensors[0].max()) <= 1.0
    again = data.load_digits("train")
    assert torch.equal(train.tensors[0], again.tensors[0])
    frac = torch.bincount(test.tensors[1]).float() / torch.bincount(torch.cat([train.tensors[1], test.tensors[1]]))
    assert torch.allclose(frac, torch.full((10,), 0.25), atol=0.01)
    rows_train = {tuple(r.flatten().tolist()) for r in train.tensors[0]}
    overlap = sum(tuple(r.flatten().tolist()) in rows_train for r in test.tensors[0])
    assert overlap <= 2  # the raw data has a couple of duplicate images; indices are disjoint


def test_sphere_clusters_on_sphere_and_concentration_tightens():
    loose = data.sphere_clusters(3, 200, 8, concentration=1.0, seed=0)
    tight = data.sphere_clusters(3, 200, 8, concentration=30.0, seed=0)
    for ds in (loose, tight):
        assert torch.allclose(ds.tensors[0].norm(dim=1), torch.ones(600))

    def spread(ds):
        x, y = ds.tensors
        return torch.stack([x[y == c].mean(0).norm() for c in range(3)]).mean()

    assert spread(tight) > spread(loose)
    with pytest.raises(ValueError, match="dim must be an integer >= 1"):
        data.sphere_clusters(3, 10, 0)


# ---------------------------------------------------------------------- subsets, splits
def test_subset_filter_split():
    ds = data.sphere_clusters(4, 50, 3, seed=2)
    sub = data.take_subset(ds, 40, seed=1)
    assert len(sub) == 40 and torch.bincount(sub.tensors[1]).tolist() == [10] * 4
    assert torch.equal(sub.tensors[0], data.take_subset(ds, 40, seed=1).tensors[0])
    assert not torch.equal(sub.tensors[0], data.take_subset(ds, 40, seed=2).tensors[0])
    assert data.take_subset(ds, None) is ds

    kept = data.filter_classes(ds, [3, 1])
    assert set(kept.tensors[1].tolist()) == {0, 1} and len(kept) == 100
    assert torch.equal(kept.tensors[0][kept.tensors[1] == 0], ds.tensors[0][ds.tensors[1] == 3])
    raw = data.filter_classes(ds, [3, 1], relabel=False)
    assert set(raw.tensors[1].tolist()) == {1, 3}
    with pytest.raises(ValueError, match="do not occur"):
        data.filter_classes(ds, [7])
    with pytest.raises(ValueError, match="without repeats"):
        data.filter_classes(ds, [1, 1])

    a, b = data.split_dataset(ds, 0.2, seed=0)
    assert len(a) == 160 and len(b) == 40
    with pytest.raises(ValueError, match="test_fraction must be in"):
        data.split_dataset(ds, 1.5)


def test_random_crop_flip_keeps_shapes_and_content():
    from sphereml.data import RandomCropFlip

    images = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8)
    labels = torch.tensor([0, 1])
    aug = RandomCropFlip(TensorDataset(images, labels), padding=2, hflip=True, vflip=True)
    torch.manual_seed(0)
    seen = set()
    for _ in range(40):
        x, y = aug[1]
        assert x.shape == (3, 8, 8) and int(y) == 1
        assert set(x.unique().tolist()) <= set(images[1].unique().tolist()) | {0.0}  # shifted pixels or padding
        seen.add(tuple(x.flatten()[:5].tolist()))
    assert len(seen) > 5  # the crops and flips vary
    plain = RandomCropFlip(TensorDataset(images, labels), padding=0, hflip=False)
    assert torch.equal(plain[0][0], images[0])
    with pytest.raises(ValueError, match="padding"):
        RandomCropFlip(TensorDataset(images, labels), padding=-1)


def _by_hand(aug, i, top, left, hflip, vflip):
    h, w = aug.size
    x = aug.images[i, :, top:top + h, left:left + w]
    x = x.flip(-1) if hflip else x
    return x.flip(-2) if vflip else x


def test_crop_flip_cuts_a_batch_as_indexing_each_item_would():
    from sphereml.data import RandomCropFlip
    from sphereml.launches import no_host_sync

    g = torch.Generator().manual_seed(1)
    aug = RandomCropFlip(TensorDataset(torch.rand(6, 3, 5, 7, generator=g), torch.arange(6)), padding=2, vflip=True)
    idx = torch.tensor([4, 0, 4, 2])
    offsets = torch.tensor([[0, 4], [2, 2], [4, 0], [1, 3]])
    flips = torch.tensor([[False, False], [True, False], [False, True], [True, True]])
    with no_host_sync():
        batch = aug.crop_flip(idx, offsets, flips)
    expected = torch.stack([_by_hand(aug, int(i), *map(int, o), *map(bool, f)) for i, o, f in zip(idx, offsets, flips)])
    assert batch.shape == (4, 3, 5, 7) and torch.equal(batch, expected)


def test_device_batches_draw_a_reproducible_epoch_of_every_item_once():
    from sphereml.data import RandomCropFlip
    from sphereml.train import batches, on_device

    images, labels = torch.rand(50, 1, 6, 6), torch.arange(50)
    aug = RandomCropFlip(TensorDataset(images, labels), padding=3, vflip=True)
    epoch = lambda seed: list(batches(aug, 16, True, torch.Generator().manual_seed(seed)))  # noqa: E731
    first, again, other = epoch(7), epoch(7), epoch(8)
    assert [len(y) for _, y in first] == [16, 16, 16, 2]
    assert all(torch.equal(a, b) for (xa, ya), (xb, yb) in zip(first, again) for a, b in ((xa, xb), (ya, yb)))
    assert not torch.equal(first[0][0], other[0][0])
    assert sorted(torch.cat([y for _, y in first]).tolist()) == list(range(50))  # every item once
    found = _crops(aug, torch.cat([x for x, _ in first]), torch.cat([y for _, y in first]))
    offsets = {o for o, _ in found}
    assert {0, 6} <= {top for top, _ in offsets} and {0, 6} <= {left for _, left in offsets}  # all of [0, 2p]
    assert len(offsets) > 25  # of the 49 possible crops
    for axis in (0, 1):  # left-right, upside-down: each about half the time
        assert 10 < sum(f[axis] for _, f in found) < 40
    plain = RandomCropFlip(TensorDataset(images, labels), padding=0, hflip=False)  # no augmentation: plain batches
    for (xa, ya), (xb, yb) in zip(batches(plain, 16, True, torch.Generator().manual_seed(7)),
                                  batches(TensorDataset(images, labels), 16, True, torch.Generator().manual_seed(7))):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert on_device(aug, "cpu") is aug  # already where it is asked for: no copy
    moved = aug.to_device("cpu")
    assert moved is not aug and torch.equal(moved.images, aug.images) and (moved.padding, moved.vflip) == (3, True)
    on_meta = on_device(aug, "meta")  # a copy elsewhere is made once and kept
    assert on_meta.images.is_meta and on_meta.labels.is_meta and on_device(aug, "meta") is on_meta
    flagged = RandomCropFlip(TensorDataset(images, labels), hflip=1, vflip=0)  # flags given as numbers: bools
    assert (flagged.hflip, flagged.vflip) == (True, False) and len(list(batches(flagged, 64, True))[0][1]) == 50


def _crops(aug, x, ys):
    """((top, left), (left-right, upside-down)) of every image of an epoch, found by trying each crop and flip."""
    options = [((t, left), (h, v)) for t in range(2 * aug.padding + 1) for left in range(2 * aug.padding + 1)
               for h in (False, True) for v in (False, True)]
    found = [next((o for o in options if torch.equal(x[k], _by_hand(aug, int(y), *o[0], *o[1]))), None)
             for k, y in enumerate(ys)]
    assert None not in found  # every image is a crop of its own padded item, flipped or not
    return found


def test_pool_images_averages_blocks_and_keeps_labels():
    x = torch.arange(2 * 16, dtype=torch.float32).reshape(2, 1, 4, 4)
    y = torch.tensor([3, 7])
    pooled = data.pool_images(TensorDataset(x, y), 2)
    assert pooled.tensors[0].shape == (2, 1, 2, 2) and torch.equal(pooled.tensors[1], y)
    assert float(pooled.tensors[0][0, 0, 0, 0]) == (0 + 1 + 4 + 5) / 4  # the top-left 2 x 2 block
    assert data.pool_images(TensorDataset(x, y), 4).tensors[0] is x  # full size: unchanged
    with pytest.raises(ValueError, match="divide"):
        data.pool_images(TensorDataset(x, y), 3)
    with pytest.raises(ValueError, match="side"):
        data.pool_images(TensorDataset(x, y), 8)
