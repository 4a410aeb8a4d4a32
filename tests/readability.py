"""A readability check for matplotlib figures (the per-run plots and the compare figure's tests use it).

After a draw with the Agg backend, every visible text artist that a reader needs (the figure's title, each
axes' title and axis labels, each legend) must lie inside the figure and must not overlap another one; a
legend must list only series that are drawn (a line with a finite point to show); the title must name the
run(s) it shows. `problems(fig)` lists what fails, as sentences; `check(fig, ...)` asserts there are none.
"""

from __future__ import annotations

import itertools

import numpy as np

PAD = 1.0  # pixels of tolerance at the figure's edge and between two boxes (antialiasing)


def _texts(fig):
  """[(name, artist)] of the texts to read: the titles, axis labels and legends (each legend as one box)."""
  out = []
  if fig._suptitle is not None:
    out.append(("figure title", fig._suptitle))
  out += [(f"figure text {t.get_text()!r}", t) for t in fig.texts if t is not fig._suptitle]
  out += [(f"figure legend {i}", leg) for i, leg in enumerate(fig.legends)]
  for i, ax in enumerate(fig.axes):
    out += [
      (f"axes {i} {where} title", ax.title if where == "center" else getattr(ax, f"_{where}_title"))
      for where in ("left", "center", "right")
    ]
    out += [(f"axes {i} x label", ax.xaxis.label), (f"axes {i} y label", ax.yaxis.label)]
    if ax.get_legend() is not None:
      out.append((f"axes {i} legend", ax.get_legend()))
  return [(n, a) for n, a in out if a.get_visible() and (not hasattr(a, "get_text") or a.get_text().strip())]


def _drawn(line) -> bool:
  """A Line2D shows something: a marker at a finite point, or a segment between two consecutive finite ones."""
  if not line.get_visible():
    return False
  x, y = (np.asarray(v, dtype=float) for v in line.get_data())
  ok = np.isfinite(x) & np.isfinite(y)
  has_marker = line.get_marker() not in (None, "None", "none", "", " ")
  has_line = line.get_linestyle() not in ("None", "none", "", " ") and line.get_linewidth() > 0
  return bool((has_marker and ok.any()) or (has_line and (ok[1:] & ok[:-1]).any()))


def _legend_problems(name, legend) -> list[str]:
  out = []
  for handle, text in zip(legend.legend_handles, legend.get_texts()):
    lines = getattr(handle, "_vcpo_source", None)
    if lines is not None and not any(_drawn(ln) for ln in lines):
      out.append(f"{name} lists {text.get_text()!r}, which is not drawn")
  return out


def _link_legends(fig):
  """Marks each legend handle with the plotted lines it stands for (matched by label)."""
  by_label = {}
  for ax in fig.axes:
    for ln in ax.get_lines():
      by_label.setdefault(ln.get_label(), []).append(ln)
  for legend in [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]:
    for handle, text in zip(legend.legend_handles, legend.get_texts()):
      if text.get_text() in by_label:
        handle._vcpo_source = by_label[text.get_text()]


def problems(fig, identity=()) -> list[str]:
  """What makes `fig` hard to read (empty when it reads): clipped or overlapping texts, legend entries that
  are not drawn, a title without every string of `identity` (the run's label, the differing fields)."""
  fig.canvas.draw()
  renderer = fig.canvas.get_renderer()
  box = fig.bbox
  out = []
  texts = [(n, a, a.get_window_extent(renderer)) for n, a in _texts(fig)]
  for n, _, b in texts:
    if b.x0 < box.x0 - PAD or b.y0 < box.y0 - PAD or b.x1 > box.x1 + PAD or b.y1 > box.y1 + PAD:
      out.append(
        f"{n} is clipped by the figure's edge ({b.x0:.0f}..{b.x1:.0f} x {b.y0:.0f}..{b.y1:.0f} px "
        f"in {box.width:.0f} x {box.height:.0f})"
      )
  for (n1, _, b1), (n2, _, b2) in itertools.combinations(texts, 2):
    w = min(b1.x1, b2.x1) - max(b1.x0, b2.x0)
    h = min(b1.y1, b2.y1) - max(b1.y0, b2.y0)
    if w > PAD and h > PAD:
      out.append(f"{n1} overlaps {n2} ({w:.0f} x {h:.0f} px)")
  _link_legends(fig)
  for n, a, _ in texts:
    if n.endswith("legend") or "legend " in n:
      out += _legend_problems(n, a)
  title = fig._suptitle.get_text().replace("\n", " ") if fig._suptitle is not None else ""  # a wrapped title
  out += [f"the title {title!r} does not name {s!r}" for s in identity if s not in title]
  return out


def check(fig, identity=()):
  found = problems(fig, identity)
  assert not found, "the figure does not read:\n  " + "\n  ".join(found)
