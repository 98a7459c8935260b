"""Figures drawn once and cropped from pixels (sim/outputs/figure.py): the PNG holds what savefig's
tight bounding box held (labels past the nominal figure included), a layout that does not fit falls
back to the tight box, and a y offset text never sits on a title."""
import numpy as np
from PIL import Image

from cbsim.sim.outputs.figure import grid, new_figure, save_png, styled


@styled
def labelled(value=1.0, title="A title"):
    fig = new_figure((6, 2.5))
    ax = fig.subplots()
    ax.plot([0, 1, 2], np.array([0, 1, 4]) * value)
    ax.set_title(title)
    ax.set_xlabel("seconds (this label sits below the nominal figure)")
    ax.set_ylabel("a value")
    return fig


def test_the_crop_keeps_what_the_tight_box_kept(tmp_path):
    ours = Image.open(save_png(labelled(), tmp_path / "ours.png", 100))
    fig = labelled()
    fig.savefig(tmp_path / "tight.png", dpi=100, bbox_inches="tight")
    tight = Image.open(tmp_path / "tight.png")
    assert abs(ours.size[0] - tight.size[0]) <= 3 and abs(ours.size[1] - tight.size[1]) <= 3
    pixels = np.asarray(ours)
    border = np.concatenate([pixels[:5].reshape(-1, 4), pixels[-5:].reshape(-1, 4),
                             pixels[:, :5].reshape(-1, 4), pixels[:, -5:].reshape(-1, 4)])
    assert (border == 255).all()  # the pad: nothing touches the edge, nothing was cut


def test_a_layout_that_does_not_fit_falls_back_to_the_tight_box(tmp_path):
    fig = new_figure((4, 2), bleed=0.0)
    ax = grid(fig, 1, 1, left=0.0, right=0.0, top=0.0, bottom=0.0)  # tick labels past every edge
    ax.plot([0, 1], [0, 1e5])
    ax.set_ylabel("no room")
    image = Image.open(save_png(fig, tmp_path / "f.png", 100))
    assert image.size[0] > 400 and image.size[1] > 200  # grew past the 4 x 2 in canvas, as the tight box does


def test_a_y_offset_text_lifts_the_title_it_would_overlap(tmp_path):
    fig = labelled(1e7, "a title wide enough to run over the offset text at the top left of the axis " * 2)
    save_png(fig, tmp_path / "f.png", 100)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    offset = ax.yaxis.offsetText
    assert offset.get_text() and offset.get_visible()
    assert not offset.get_window_extent(renderer).overlaps(ax.title.get_window_extent(renderer))
    assert ax.title.get_position()[1] > 1.0
    plain = labelled()
    save_png(plain, tmp_path / "p.png", 100)
    assert plain.axes[0].title.get_position()[1] == 1.0
