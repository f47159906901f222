"""veloxquant eval's plots: bit-width labels on every point, needle.png whole and with a legend."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from veloxquant.tools import eval as ev


def _results(needle_keys):
    specs = [ev.CacheSpec("fp16", "fp16"), ev.CacheSpec("mlx-affine-4", "mlx-quantized", bits=4)]
    specs += [
        ev.CacheSpec(f"turboquant-rvq-{kb}" if kb == vb else f"turboquant-rvq-k{kb}v{vb}", "veloxquant", bits=kb,
                     value_bits=vb, method="turboquant-rvq")
        for kb, vb in ((2, 2), (3, 2), (4, 3), (4, 4))
    ]
    out = []
    for i, s in enumerate(specs):
        r = ev.Result(s, ppl=10 + i, top1=1 - 0.01 * i, kl=0.01 * i, kv_bytes=1000, bits_per_element=16 if i == 0 else 2 + i)
        r.needle = {k: (j + i) % 3 != 0 for j, k in enumerate(needle_keys)}
        out.append(r)
    return out


def test_bits_label():
    assert ev.bits_label(ev.CacheSpec("x", "veloxquant", bits=4, value_bits=3)) == "k4v3"
    assert ev.bits_label(ev.CacheSpec("x", "veloxquant", bits=2, value_bits=2)) == "2b"
    assert ev.bits_label(ev.CacheSpec("x", "mlx-quantized", bits=8)) == "8b"


# One length@depth (a narrow figure, where the title and labels were cut off) and many.
@pytest.mark.parametrize("needle_keys", [["256@0.5"], [f"{n}@{d}" for n in (512, 1024, 2048, 4096) for d in (0.1, 0.5, 0.9)]])
def test_plots_label_bit_widths_and_needle_png_is_whole_with_a_legend(tmp_path, monkeypatch, needle_keys):
    saved = {}
    original = Figure.savefig

    def spy(self, fname, *a, **k):
        saved[str(fname).rsplit("/", 1)[-1]] = self
        return original(self, fname, *a, **k)

    monkeypatch.setattr(Figure, "savefig", spy)
    paths = ev.plot(_results(needle_keys), tmp_path)
    assert sorted(p.name for p in paths) == ["kl.png", "needle.png", "pareto.png", "perplexity.png", "top1.png"]
    for name in ("perplexity.png", "top1.png", "kl.png"):
        texts = {t.get_text() for t in saved[name].axes[0].texts}
        assert {"4b", "2b", "k3v2", "k4v3"} <= texts, (name, texts)
    # The Pareto figure: Δppl and KL panels, a line per family, every point labelled.
    for ax in saved["pareto.png"].axes:
        assert {"4b", "2b", "k3v2", "k4v3"} <= {t.get_text() for t in ax.texts}
        assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["mlx-affine", "turboquant-rvq"]
    legend = saved["needle.png"].axes[0].get_legend()
    assert legend is not None and [t.get_text() for t in legend.get_texts()] == ["found", "not found"]
    # Nothing is cut off: everything drawn fits in the image that was written.
    for name, fig in saved.items():
        with Image.open(tmp_path / name) as img:
            (w, h), (dpi_x, dpi_y) = img.size, img.info["dpi"]
        drawn = fig.get_tightbbox(FigureCanvasAgg(fig).get_renderer())
        assert drawn.width <= w / dpi_x + 0.02 and drawn.height <= h / dpi_y + 0.02, (
            f"{name}: {drawn.width:.2f} x {drawn.height:.2f} in drawn, {w / dpi_x:.2f} x {h / dpi_y:.2f} in written"
        )
    plt.close("all")
