"""Data sets for the book: Fashion-MNIST, scikit-learn digits, CIFAR-10/100, synthetic spheres.

Every loader returns a :class:`torch.utils.data.TensorDataset` of ``(images, labels)``
with images as float32 in [0, 1], shaped ``(N, C, H, W)``, and labels as int64.
Files are located in this order: the ``root`` argument, ``$SPHEREML_DATA/<name>``,
the Debian package directory (``/usr/share/datasets/<name>``), then the user cache
``~/.cache/sphereml/<name>``.  Every file is checked against a SHA-256 (MD5 for the
CIFAR archives, whose publishers give MD5) before use; a corrupt or truncated file
raises :class:`DataError` naming the file and the checksum expected.

Downloads happen only when asked for (``download=True``), never when
``$SPHEREML_NO_DOWNLOAD`` is set (the test suite sets it), are verified before they
are moved into place, and never leave a partial file behind.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import tarfile
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from ._checks import integer, one_of
from .geometry import normalize, sample_sphere

__all__ = ["DataError", "FASHION_MNIST_CLASSES", "load_fashion_mnist", "fetch_fashion_mnist", "load_digits",
           "find_cifar", "load_cifar", "RandomCropFlip", "sphere_clusters", "take_subset", "filter_classes",
           "split_dataset", "pool_images", "download_file", "search_paths"]

FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot")

# SHA-256 of the *decompressed* IDX payloads: the Debian package and the upstream
# mirror gzip the same bytes differently, so the compressed files' hashes differ.
_FASHION_MNIST_FILES = {
    ("train", "images"): ("train-images-idx3-ubyte",
                          "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888"),
    ("train", "labels"): ("train-labels-idx1-ubyte",
                          "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"),
    ("test", "images"): ("t10k-images-idx3-ubyte",
                         "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b"),
    ("test", "labels"): ("t10k-labels-idx1-ubyte",
                         "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"),
}
_FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"

# Official python archives and the MD5 sums their publisher lists.
_CIFAR_ARCHIVES = {
    10: ("cifar-10-python.tar.gz", "md5", "c58f30108f718f92721af3b95e74349a",
         "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"),
    100: ("cifar-100-python.tar.gz", "md5", "eb9058c3a382ffc7106e4002c42a8d85",
          "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"),
}

_SPLITS = ("train", "test")


class DataError(RuntimeError):
    """A data file is missing, corrupt, truncated or fails its checksum."""


# --------------------------------------------------------------------------- files
def search_paths(name: str, root: str | os.PathLike | None = None) -> list[Path]:
    """Directories searched for data set ``name``, in order of preference."""
    paths = []
    if root is not None:
        paths.append(Path(root))
    if os.environ.get("SPHEREML_DATA"):
        paths.append(Path(os.environ["SPHEREML_DATA"]) / name)
    paths.append(Path("/usr/share/datasets") / name)
    paths.append(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sphereml" / name)
    return paths


def _digest(data: bytes, algorithm: str) -> str:
    return hashlib.new(algorithm, data).hexdigest()


def _file_digest(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_file(
    url: str, dest: str | os.PathLike, checksum: str, algorithm: str = "sha256", gz: bool = False
) -> Path:
    """Download ``url`` to ``dest``, verifying its checksum before moving it into place.

    The bytes go to a temporary file in the destination folder, which is renamed
    atomically only after the checksum matches, and removed on any failure, so an
    interrupted or corrupt download never leaves a file at ``dest``.  With
    ``gz=True`` the checksum is that of the gunzipped payload.

    Raises:
        DataError: the download failed or its checksum differs from ``checksum``.
        RuntimeError: ``$SPHEREML_NO_DOWNLOAD`` is set.
    """
    if os.environ.get("SPHEREML_NO_DOWNLOAD"):
        raise RuntimeError(f"refusing to download {url}: $SPHEREML_NO_DOWNLOAD is set")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as response:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                out.write(chunk)
        _read_verified(Path(tmp), checksum, algorithm, gz=gz)
        os.replace(tmp, dest)
    except OSError as err:
        raise DataError(f"download of {url} failed: {err}; nothing was written to {dest}") from err
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dest


def _read_verified(path: Path, checksum: str, algorithm: str = "sha256", gz: bool = False) -> bytes:
    """Read ``path`` (gunzipping if ``gz``) and check the payload's digest."""
    try:
        data = gzip.decompress(path.read_bytes()) if gz else path.read_bytes()
    except (EOFError, OSError, gzip.BadGzipFile) as err:
        raise DataError(f"{path} is corrupt or truncated ({err}); expected {algorithm} {checksum}") from err
    found = _digest(data, algorithm)
    if found != checksum:
        raise DataError(
            f"{path} fails its checksum: {algorithm} {found}, expected {checksum}. "
            "Delete the file and fetch it again."
        )
    return data


# --------------------------------------------------------------------- Fashion-MNIST
def _parse_idx(data: bytes, path: Path) -> np.ndarray:
    """Decode an IDX file (magic 0x0000 08 NDIM, big-endian dims, uint8 payload)."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DataError(f"{path} is not an IDX file of unsigned bytes")
    ndim = data[3]
    dims = np.frombuffer(data, dtype=">u4", count=ndim, offset=4).astype(np.int64)
    payload = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if payload.size != int(np.prod(dims)):
        raise DataError(f"{path} is truncated: header promises {tuple(dims)}, got {payload.size} bytes")
    return payload.reshape(tuple(dims))


def _find_fashion_file(stem: str, checksum: str, root, download: bool) -> tuple[Path, bool]:
    for folder in search_paths("fashion-mnist", root):
        for suffix, gz in ((".gz", True), ("", False)):
            candidate = folder / f"{stem}{suffix}"
            if candidate.is_file():
                return candidate, gz
    if download:
        folder = search_paths("fashion-mnist", root)[0 if root is not None else -1]
        return download_file(_FASHION_MNIST_URL + f"{stem}.gz", folder / f"{stem}.gz", checksum, gz=True), True
    looked = ", ".join(str(p) for p in search_paths("fashion-mnist", root))
    raise DataError(
        f"Fashion-MNIST file {stem}(.gz) not found in: {looked}. Install the Debian package "
        "dataset-fashion-mnist, set $SPHEREML_DATA, or pass download=True."
    )


def fetch_fashion_mnist(root=None) -> list[Path]:
    """Make sure the four Fashion-MNIST files are on this machine: each one found in :func:`search_paths` is
    verified against its SHA-256, each missing one is downloaded (verified before it is moved into place) to
    ``root`` or the user cache.  A chapter's set-up cell calls this in a fresh Jupyter or Colab session.

    Returns:
        list[Path]: the four files.

    Raises:
        DataError: a file is corrupt, or a download failed.
        RuntimeError: a file is missing and ``$SPHEREML_NO_DOWNLOAD`` is set.
    """
    paths = []
    for stem, checksum in _FASHION_MNIST_FILES.values():
        path, gz = _find_fashion_file(stem, checksum, root, download=True)
        _read_verified(path, checksum, gz=gz)
        paths.append(path)
    return paths


def load_fashion_mnist(split: str = "train", root=None, download: bool = False) -> TensorDataset:
    """Fashion-MNIST (Xiao et al., 2017): 28x28 grey images of 10 clothing classes.

    Args:
        split (str): ``"train"`` (60,000 images) or ``"test"`` (10,000).
        root (path, optional): a folder holding the four IDX files (``.gz`` or not).
        download (bool): fetch missing files into ``root`` or the user cache. Default: False.

    Returns:
        TensorDataset of images Tensor[N, 1, 28, 28] (float32 in [0, 1]) and labels Tensor[N] (int64).
    """
    one_of("split", split, _SPLITS)
    arrays = {}
    for kind in ("images", "labels"):
        stem, checksum = _FASHION_MNIST_FILES[(split, kind)]
        path, gz = _find_fashion_file(stem, checksum, root, download)
        arrays[kind] = _parse_idx(_read_verified(path, checksum, gz=gz), path)
    images = torch.from_numpy(arrays["images"].copy()).float().div_(255.0).unsqueeze(1)
    labels = torch.from_numpy(arrays["labels"].astype(np.int64))
    return TensorDataset(images, labels)


# ------------------------------------------------------------------------- digits
def load_digits(split: str = "train", test_fraction: float = 0.25, seed: int = 0) -> TensorDataset:
    """scikit-learn's 8x8 handwritten digits (1,797 images, shipped with scikit-learn).

    The data set has no official split; a deterministic stratified split by ``seed`` is used.

    Returns:
        TensorDataset of images Tensor[N, 1, 8, 8] in [0, 1] and labels Tensor[N].
    """
    from sklearn.datasets import load_digits as _sk_load_digits

    one_of("split", split, _SPLITS)
    bunch = _sk_load_digits()
    images = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    train_idx, test_idx = _stratified_indices(labels, test_fraction, seed)
    idx = train_idx if split == "train" else test_idx
    return TensorDataset(images[idx], labels[idx])


# -------------------------------------------------------------------------- CIFAR
def find_cifar(num_classes: int = 10, root=None) -> Path | None:
    """The local CIFAR archive (``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz``), or None.

    Looks in the folders of :func:`search_paths` (``root``, ``$SPHEREML_DATA/cifar-N``,
    ``/usr/share/datasets/cifar-N``, ``~/.cache/sphereml/cifar-N``); nothing is downloaded or verified.
    """
    if num_classes not in _CIFAR_ARCHIVES:
        raise ValueError(f"num_classes must be 10 or 100, got {num_classes!r}")
    filename = _CIFAR_ARCHIVES[num_classes][0]
    return next((p / filename for p in search_paths(f"cifar-{num_classes}", root) if (p / filename).is_file()), None)


def load_cifar(num_classes: int = 10, split: str = "train", root=None, download: bool = False) -> TensorDataset:
    """CIFAR-10 or CIFAR-100 (Krizhevsky, 2009) from the official python archive.

    Args:
        num_classes (int): 10 or 100 (CIFAR-100 uses its 100 fine labels).
        split (str): ``"train"`` or ``"test"``.
        root (path, optional): folder holding ``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz``.
        download (bool): fetch the archive (with MD5 check) if missing. Default: False.

    Returns:
        TensorDataset of images Tensor[N, 3, 32, 32] in [0, 1] and labels Tensor[N].
    """
    path = find_cifar(num_classes, root)
    one_of("split", split, _SPLITS)
    filename, algorithm, checksum, url = _CIFAR_ARCHIVES[num_classes]
    if path is None:
        if not download:
            looked = ", ".join(str(p) for p in search_paths(f"cifar-{num_classes}", root))
            raise DataError(f"{filename} not found in: {looked}; pass download=True on a machine with internet")
        dest_dir = search_paths(f"cifar-{num_classes}", root)[0 if root is not None else -1]
        path = download_file(url, dest_dir / filename, checksum, algorithm)
    elif (found := _file_digest(path, algorithm)) != checksum:
        raise DataError(f"{path} fails its checksum: {algorithm} {found}, expected {checksum}")
    if num_classes == 10:
        members = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
        label_key = b"labels"
    else:
        members, label_key = [split], b"fine_labels"
    images, labels = [], []
    try:
        with tarfile.open(path, "r:gz") as tar:
            names = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
            for member in members:
                if member not in names:
                    raise DataError(f"{path} lacks the member {member!r}")
                batch = pickle.load(tar.extractfile(names[member]), encoding="bytes")
                images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
                labels.append(np.asarray(batch[label_key], dtype=np.int64))
    except (tarfile.TarError, EOFError, pickle.UnpicklingError, KeyError) as err:
        raise DataError(f"{path} is corrupt ({err}); expected {algorithm} {checksum}") from err
    x = torch.from_numpy(np.concatenate(images)).float().div_(255.0)
    y = torch.from_numpy(np.concatenate(labels))
    return TensorDataset(x, y)


class RandomCropFlip(Dataset):
    """Standard CIFAR augmentation on the fly: zero-pad by ``padding``, crop back at random, flip at random.

    The thesis's "CIFAR-10+" (§3.4.5) uses random crops with horizontal *and* vertical flips
    (``vflip=True``); the usual recipe flips horizontally only.

    Indexing one item draws from torch's global generator; training draws whole epochs instead
    (:meth:`device_batches`, used by :func:`~sphereml.train.batches`), so a copy on a GPU (:meth:`to_device`, made by
    :func:`~sphereml.train.on_device`) trains with no per-batch host work.

    Args:
        dataset (TensorDataset): images Tensor[N, C, H, W] and labels.
        padding (int): pixels of zero padding before the crop (0: no crop). Default: 4.
        hflip, vflip (bool): flip left-right / upside-down with probability 1/2. Default: True, False.
    """

    def __init__(self, dataset: TensorDataset, padding: int = 4, hflip: bool = True, vflip: bool = False):
        images, self.labels = dataset.tensors
        if images.dim() != 4:
            raise ValueError(f"images must be Tensor[N, C, H, W], got shape {tuple(images.shape)}")
        self.padding, self.hflip, self.vflip = integer("padding", padding, at_least=0), bool(hflip), bool(vflip)
        self.images = torch.nn.functional.pad(images, [padding] * 4) if padding else images
        self.size = images.shape[-2:]

    def __len__(self) -> int:
        return len(self.labels)

    def to_device(self, device) -> "RandomCropFlip":
        """The same augmentation of the same images, held on ``device`` (padded once, as here)."""
        copy = object.__new__(RandomCropFlip)
        copy.__dict__.update(self.__dict__, images=self.images.to(device), labels=self.labels.to(device))
        return copy

    def crop_flip(self, idx: Tensor, offsets: Tensor, flips: Tensor) -> Tensor:
        """Items ``idx`` cropped at ``offsets`` (Tensor[B, 2]: top, left) and flipped where ``flips`` (Tensor[B, 2]
        of bool: left-right, upside-down) says: one gather, no host read."""
        arange = [torch.arange(n, device=self.images.device) for n in (self.images.shape[1], *self.size)]
        rows = (offsets[:, 0, None] + arange[1])[:, None, :, None]
        cols = (offsets[:, 1, None] + arange[2])[:, None, None, :]
        rows = torch.where(flips[:, 1, None, None, None], rows.flip(2), rows)
        cols = torch.where(flips[:, 0, None, None, None], cols.flip(3), cols)
        return self.images[idx[:, None, None, None], arange[0][None, :, None, None], rows, cols]

    def device_batches(self, batch_size: int, shuffle: bool = False, generator: torch.Generator | None = None):
        """(images, labels) batches of one epoch, its order, crops and flips drawn at once from ``generator`` (on
        the CPU, so a seed gives the same epoch on every device) and moved to the images' device once."""
        n, dev = len(self), self.images.device
        order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
        offsets = (torch.randint(0, 2 * self.padding + 1, (n, 2), generator=generator) if self.padding
                   else torch.zeros(n, 2, dtype=torch.long))
        flips = (torch.rand(n, 2, generator=generator) < 0.5) & torch.tensor([self.hflip, self.vflip])
        order, offsets, flips = order.to(dev), offsets.to(dev), flips.to(dev)
        for part in (slice(start, start + batch_size) for start in range(0, n, batch_size)):
            yield self.crop_flip(order[part], offsets[part], flips[part]), self.labels[order[part]]

    def __getitem__(self, i: int):
        h, w = self.size
        top, left = (torch.randint(0, 2 * self.padding + 1, (2,)).tolist() if self.padding else (0, 0))
        x = self.images[i, :, top:top + h, left:left + w]
        if self.hflip and torch.rand(()) < 0.5:
            x = x.flip(-1)
        if self.vflip and torch.rand(()) < 0.5:
            x = x.flip(-2)
        return x, self.labels[i]


# ---------------------------------------------------------------------- synthetic
def sphere_clusters(num_classes: int, per_class: int, dim: int, concentration: float = 10.0,
                    seed: int = 0) -> TensorDataset:
    """Points on the sphere :math:`S^{d-1}` (:math:`d` = ``dim``) clustered around random class centres.

    Each point is normalize(concentration * mu_c + z) with z ~ N(0, I): a simple
    stand-in for a von Mises-Fisher mixture whose spread falls as ``concentration`` grows.

    Returns:
        TensorDataset of points Tensor[num_classes * per_class, dim] (unit rows) and labels.
    """
    for name, value in (("num_classes", num_classes), ("per_class", per_class), ("dim", dim)):
        integer(name, value, at_least=1)
    if concentration < 0:
        raise ValueError(f"concentration must be >= 0, got {concentration}")
    g = torch.Generator().manual_seed(seed)
    centres = sample_sphere(num_classes, dim, generator=g)  # (C, dim)
    labels = torch.arange(num_classes).repeat_interleave(per_class)  # (N,)
    points = normalize(concentration * centres[labels] + torch.randn(len(labels), dim, generator=g))
    return TensorDataset(points, labels)


# ------------------------------------------------------------------ subsets/splits
def _stratified_indices(labels: torch.Tensor, test_fraction: float, seed: int):
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    g = torch.Generator().manual_seed(seed)
    train, test = [], []
    for c in labels.unique(sorted=True):
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_test = int(round(test_fraction * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return torch.cat(train).sort().values, torch.cat(test).sort().values


def take_subset(dataset: TensorDataset, n: int | None, seed: int = 0, stratified: bool = True) -> TensorDataset:
    """A deterministic random subset of ``n`` examples (all of them when ``n`` is None or too large).

    With ``stratified=True`` the class proportions are kept (up to rounding).
    """
    x, y = dataset.tensors
    if n is None or n >= len(y):
        return dataset
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1 or None, got {n!r}")
    if stratified:
        _, idx = _stratified_indices(y, n / len(y), seed)
    else:
        idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:n].sort().values
    return TensorDataset(x[idx], y[idx])


def filter_classes(dataset: TensorDataset, classes, relabel: bool = True) -> TensorDataset:
    """Keep only the examples of ``classes`` (for open-set protocols).

    With ``relabel=True`` labels become 0..len(classes)-1 in the order given.
    """
    x, y = dataset.tensors
    classes = [int(c) for c in classes]
    if len(set(classes)) != len(classes) or not classes:
        raise ValueError(f"classes must be a non-empty list without repeats, got {classes}")
    missing = sorted(set(classes) - set(y.unique().tolist()))
    if missing:
        raise ValueError(f"classes {missing} do not occur in the data set")
    keep = torch.isin(y, torch.tensor(classes))
    x, y = x[keep], y[keep]
    if relabel:
        lookup = torch.full((int(max(classes)) + 1,), -1, dtype=torch.long)
        lookup[torch.tensor(classes)] = torch.arange(len(classes))
        y = lookup[y]
    return TensorDataset(x, y)


def split_dataset(dataset: TensorDataset, fraction: float, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Deterministic stratified split into (1 - fraction, fraction) parts, e.g. train/validation."""
    x, y = dataset.tensors
    a, b = _stratified_indices(y, fraction, seed)
    return TensorDataset(x[a], y[a]), TensorDataset(x[b], y[b])


def pool_images(dataset: TensorDataset, side: int) -> TensorDataset:
    """Square images average-pooled to ``side`` x ``side`` (e.g. 28 -> 14: 2 x 2 blocks); labels unchanged."""
    x, y = dataset.tensors
    integer("side", side, at_least=1, at_most=x.shape[-1])
    if x.shape[-1] % side or x.shape[-2] != x.shape[-1]:
        raise ValueError(f"side must divide the side of square images, got {side} for {tuple(x.shape[-2:])}")
    return TensorDataset(torch.nn.functional.avg_pool2d(x, x.shape[-1] // side) if side < x.shape[-1] else x, y)
