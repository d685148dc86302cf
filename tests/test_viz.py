import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from sphereml.book import viz  # noqa: E402


def test_style_without_seaborn_keeps_the_palette(monkeypatch):
    """A bare GPU box runs the chapters as scripts without seaborn: matplotlib's style with the book's palette."""
    import sys

    monkeypatch.setitem(sys.modules, "seaborn", None)  # import seaborn now raises ImportError
    with plt.rc_context():
        viz.set_style()
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        assert [matplotlib.colors.to_hex(c) for c in colors[:3]] == ["#1f77b4", "#ff7f0e", "#2ca02c"]
        assert plt.rcParams["axes.spines.top"] is False


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
    assert grid.mask[0].all() and grid.mask[:, 5].all() and grid.mask[6:10, 11:15].all()  # padding, empty slot
    assert not grid.mask[1:5, 1:5].any()
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


def test_smallest_text_is_its_height_once_the_figure_fits_a_phone_column():
    viz.set_style()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    axes[0].plot([0, 1], [1, 0], label="line")
    axes[0].legend(fontsize=7)
    axes[1].axis("off")  # an axis turned off draws no tick labels: they do not count
    axes[1].set_xticks([0.5], ["hidden"], fontsize=3)
    fig.canvas.draw()
    small = viz.smallest_text(fig)
    width = fig.get_tightbbox(fig.canvas.get_renderer()).width
    assert small["text"] == "line" and small["smallest_pt"] == 7.0
    assert small["px"] == pytest.approx(7 / 72 * viz.PHONE_COLUMN_PX / width, abs=0.05)  # wider than the column
    assert small["px"] < viz.LEGIBLE_PX  # 7 points on an 8-inch figure: too small on a phone
    tiny = plt.figure(figsize=(1, 1))  # narrower than the column: shown at its own size, 150 dpi
    tiny.text(0.5, 0.5, "x", fontsize=10)
    tiny.canvas.draw()
    assert viz.smallest_text(tiny, column_px=10_000)["px"] == pytest.approx(10 / 72 * 150, abs=0.05)
    plt.close("all")
