import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from sphereml.book import viz  # noqa: E402


def test_save_and_show_writes_png_and_closes(tmp_path):
    viz.set_style()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = viz.save_and_show(fig, tmp_path / "sub" / "line", show=False)
    assert path == tmp_path / "sub" / "line.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number)


def test_scatter_features_one_series_per_class():
    fig, ax = plt.subplots()
    f = torch.randn(30, 2)
    y = torch.arange(30) % 3
    viz.scatter_features(ax, f, y, class_names=["a", "b", "c"], unit_circle=True)
    assert [t.get_text() for t in ax.legend().get_texts()] == ["a", "b", "c"]
    assert len(ax.collections) == 3
    with pytest.raises(ValueError, match=r"Tensor\[N, 2\]"):
        viz.scatter_features(ax, torch.randn(5, 3), torch.zeros(5))
    plt.close(fig)


def test_image_grid_places_every_image():
    fig, ax = plt.subplots()
    images = torch.stack([torch.full((1, 4, 4), float(i) / 5) for i in range(5)])
    viz.image_grid(ax, images, nrow=3, pad=1)
    grid = ax.get_images()[0].get_array()
    assert grid.shape == (2 * 5 + 1, 3 * 5 + 1)
    assert np.allclose(grid[1:5, 6:10], 0.2)  # image 1: row 0, column 1
    assert np.allclose(grid[6:10, 6:10], 0.8)  # image 4: row 1, column 1
    with pytest.raises(ValueError, match=r"Tensor\[N, 1, H, W\]"):
        viz.image_grid(ax, torch.zeros(2, 3, 4, 4), nrow=2)
    plt.close(fig)


def test_figures_are_glued_only_in_a_kernel_executing_for_the_book(tmp_path, monkeypatch):
    """Outside a notebook kernel (a script, these tests) a figure is never glued, whatever the environment;
    in a kernel only when $SPHEREML_GLUE_FIGURES is 1 (the book build), so a reader's Jupyter shows it."""
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    monkeypatch.setenv("SPHEREML_GLUE_FIGURES", "1")
    assert viz._glue("key", fig) is False  # no kernel here
    monkeypatch.setenv("SPHEREML_GLUE_FIGURES", "0")
    assert viz._glue("key", fig) is False
    path = viz.save_and_show(fig, tmp_path / "fig", show=True, glue_as="key")
    assert path.is_file() and not plt.get_fignums()
