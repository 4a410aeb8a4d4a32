"""The paper's claim under its pre-registered protocol (docs/results/claim_protocol.md): the report.

  bash launch/claim_protocol.sh                              # the runs (pinned commit, nice 19, resumable)
  python -m vcpo_jax.experiments.claim --out=docs/results    # claim.md and claim.png from the committed ledgers

The runs are three studies of vcpo_jax.experiments.stability (configs/stability.py: protocol_attribution,
protocol_horizon, protocol) whose per-run records live in docs/results/stability_ledger/claim_protocol{,_horizon}.
This module reads those records only (a missing seed leaves its cell out) and applies the protocol's rules:

- final accuracy: the mean of the last two evaluations; cells report mean +- sample std (ddof 1);
- the paired difference to sync, d_s = final(method, k, s) - final(none, 0, s), mean +- SE = sd(d) / sqrt(n);
- the match test (TOST, margin MARGIN): "matches" when mean(d) +- t(0.95, n-1) SE lies inside (-MARGIN, MARGIN),
  "below" / "above" when mean(d) +- t(0.975, n-1) SE excludes 0, else "inconclusive";
- steps to REACH of the sync plateau: the first evaluation from which the seed-mean curve stays above it;
- collapses (final < half of the run's best) and dips (an evaluation below half of the step-0 accuracy);
- the collapse signal: the first step whose trailing median of log_mean_weight is below SIGNAL_LOG.

Records of different commits or machines in one table are refused (exit 2) unless --allow_mixed; the every-method
table may span machines when each cell ran on one and is paired with the synchronous reference of its own machine
(claim_protocol.md's deviation of 2026-12-06: the same run differs between CPU models from step 0).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np

from vcpo_jax.experiments import stability, tuning

MARGIN = 0.05  # equivalence margin of the final accuracy (the protocol's delta)
REACH = 0.9  # "steps to reach" this fraction of the synchronous plateau
SIGNAL_LOG = math.log(0.1)  # the collapse signal: mean unnormalized weight below 0.1 ...
SIGNAL_WINDOW = 10  # ... as a trailing median over this many steps
REFERENCE = ("none", 0)  # (method, k) of the synchronous reference
STUDIES = ("protocol_attribution", "protocol_horizon", "protocol")  # configs/stability.py variants
MACHINE_LEDGER = "docs/results/stability_ledger/claim_protocol_machines"  # sync references rerun on other CPUs


class MixedRecords(ValueError):
  """Records of more than one commit or machine in one table."""


@dataclasses.dataclass
class Cell:
  """One method at one k over seeds, from the ledger records."""

  method: str
  k: int
  knob: tuple | None
  seeds: tuple[int, ...]
  eval_step: np.ndarray  # [E]
  accuracy: np.ndarray  # [S, E]
  final: np.ndarray  # [S]
  lr_scale: np.ndarray  # [S, T]
  log_mean_weight: np.ndarray | None  # [S, T], None for records made before it was logged
  commits: frozenset
  machines: frozenset


def load_records(c, method: str, k: int, seeds, knob=None, stage: str = "") -> list[dict] | None:
  """The records of every seed of (method, k[, knob]) in c.trainer.ledger, or None when one is missing."""
  recs = []
  for seed in seeds:
    path = stability.record_path(c, method, k, c.lrs[0], seed, knob, stage)
    if path is None or not path.exists():
      return None
    with np.load(path, allow_pickle=False) as z:
      recs.append({key: z[key] for key in z.files})
  return recs


def load_cell(c, method: str, k: int, knob=None) -> Cell | None:
  recs = load_records(c, method, k, c.seeds, knob)
  if recs is None:
    return None
  ev = recs[0]["eval_step"]
  acc = np.stack([r["accuracy"] for r in recs])
  lmw = np.stack([r["log_mean_weight"] for r in recs]) if all("log_mean_weight" in r for r in recs) else None
  return Cell(
    method=method,
    k=k,
    knob=knob,
    seeds=tuple(c.seeds),
    eval_step=ev,
    accuracy=acc,
    final=stability.final_value(acc, ev, c.task.steps, c.analysis.final_frac),
    lr_scale=np.stack([r["lr_scale"] for r in recs]),
    log_mean_weight=lmw,
    commits=frozenset(str(r.get("commit", "unrecorded")) for r in recs),
    machines=frozenset(str(r.get("machine", "unrecorded")) for r in recs),
  )


def auc(acc: np.ndarray, ev: np.ndarray) -> np.ndarray:
  """The tuning score: mean accuracy over the evaluations after step 0. acc [..., E] -> [...]."""
  return np.asarray(acc)[..., np.asarray(ev) > 0].mean(-1)


def tuned_knob(c, method: str):
  """(knob name, value) the protocol's tuning chose for `method`: the best mean auc over its trials (ties: the
  value listed first); None without a knob; raises LookupError while a trial is missing. Also returns the
  per-value scores ([V] or None)."""
  spec = tuning.knob_of(c, method)
  if spec is None:
    return None, None
  name, values = spec
  scores = []
  for v in values:
    runs = [load_records(c, method, int(k), c.tuning.seeds, (name, v), stage="tune") for k, _ in c.tuning.cells]
    if any(r is None for r in runs):
      raise LookupError(f"{method}: tuning trial {name}={tuning.value_str(v)} is not finished")
    scores.append(np.mean([auc(r["accuracy"], r["eval_step"]) for cell in runs for r in cell]))
  return (name, values[tuning.select(values, scores)]), np.asarray(scores)


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float, int]:
  """(mean, standard error, n) of the per-seed differences a - b (paired by seed)."""
  d = np.asarray(a, float) - np.asarray(b, float)
  n = d.size
  se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf
  return float(d.mean()), se, n


def verdict(mean: float, se: float, n: int, margin: float = MARGIN) -> str:
  """The protocol's match test on a paired difference: matches / below / above / inconclusive."""
  from scipy import stats

  if n < 2 or not math.isfinite(se):
    return "inconclusive"
  t90, t95 = stats.t.ppf(0.95, n - 1), stats.t.ppf(0.975, n - 1)
  if -margin < mean - t90 * se and mean + t90 * se < margin:
    return "matches"
  if mean + t95 * se < 0:
    return "below"
  if mean - t95 * se > 0:
    return "above"
  return "inconclusive"


def steps_to_reach(ev: np.ndarray, mean_curve: np.ndarray, target: float) -> float:
  """The first evaluation step from which mean_curve >= target at every later evaluation (nan if none)."""
  above = np.asarray(mean_curve) >= target
  stays = np.flip(np.cumprod(np.flip(above))).astype(bool)  # suffix-all
  hit = np.nonzero(stays)[0]
  return float(ev[hit[0]]) if hit.size else math.nan


def collapses(cell: Cell) -> int:
  """Runs whose final accuracy is below half of their best evaluation (the best includes step 0)."""
  return int((cell.final < 0.5 * cell.accuracy.max(-1)).sum())


def dipped(cell: Cell) -> np.ndarray:
  """[S] bool: an evaluation after step 0 below half of the run's step-0 accuracy (a mid-run collapse)."""
  later = cell.accuracy[:, cell.eval_step > 0]
  return (later < 0.5 * cell.accuracy[:, :1]).any(-1)


def signal_step(log_mean_weight: np.ndarray) -> float:
  """The first learner step (1-based) whose trailing median of log_mean_weight is below SIGNAL_LOG (nan: never)."""
  med = stability.trailing_median(np.asarray(log_mean_weight, float), SIGNAL_WINDOW)
  hit = np.nonzero(med < SIGNAL_LOG)[0]
  return float(hit[0] + 1) if hit.size else math.nan


def check_one_source(cells, what: str, allow_mixed: bool) -> str:
  """The one commit (short) the table's records share; raises MixedRecords unless allow_mixed."""
  commits = frozenset().union(*(x.commits for x in cells)) if cells else frozenset()
  machines = frozenset().union(*(x.machines for x in cells)) if cells else frozenset()
  if (len(commits) > 1 or len(machines) > 1) and not allow_mixed:
    raise MixedRecords(
      f"{what}: records from {len(commits)} commits {sorted(commits)} and {len(machines)} machines; rerun them on "
      "one commit (launch/claim_protocol.sh) or pass --allow_mixed"
    )
  return ", ".join(sorted(x[:10] for x in commits)) or "none"


def check_per_machine(cells, refs: dict, what: str, allow_mixed: bool) -> str:
  """The every-method table's source rule (the protocol's deviation of 2026-12-06): one commit, and each cell's
  records from ONE machine with a synchronous reference run on that machine (`refs`: {machine: Cell}), so every
  pair stays within a machine; the table may then hold several machines. Raises MixedRecords otherwise unless
  allow_mixed. Returns the commit (short)."""
  commit = check_one_source([*cells, *refs.values()], what, allow_mixed=True)
  if allow_mixed:
    return commit
  if "," in commit:
    check_one_source([*cells, *refs.values()], what, allow_mixed=False)  # raises: two commits
  spans = sorted(f"{x.method} k = {x.k}" for x in cells if len(x.machines) > 1)
  if spans:
    raise MixedRecords(f"{what}: {', '.join(spans)} hold records of several machines; rerun them on one")
  orphans = sorted({m for x in cells for m in x.machines if m not in refs})
  if orphans:
    raise MixedRecords(f"{what}: no synchronous reference on {orphans}; run `none` k = 0 there (claim_protocol.md)")
  return commit


def machine_label(machines: frozenset) -> str:
  """A cell's machine(s), short: "AMD EPYC" -> "AMD", "Intel(R) Xeon(R) Processor" -> "Intel"."""
  return "+".join(sorted(m.split()[0].replace("(R)", "") for m in machines)) or "-"


def ref_on(refs: dict, cell: Cell) -> Cell | None:
  """The synchronous reference of the machine the cell ran on (None: several machines, or none there)."""
  return refs.get(next(iter(cell.machines))) if len(cell.machines) == 1 else None


# ----------------------------------------------------------------------------- tables


def _fmt(x: np.ndarray) -> str:
  return f"{x.mean():.3f} +- {x.std(ddof=1) if x.size > 1 else math.nan:.3f}"


def _reach(cell: Cell, plateau: float) -> str:
  s = steps_to_reach(cell.eval_step, cell.accuracy.mean(0), REACH * plateau)
  return "never" if math.isnan(s) else str(int(s))


def cell_row(cell: Cell, ref: Cell | None, vs: Cell | None = None) -> dict:
  """The protocol's numbers of one cell against the synchronous reference (and another arm `vs`)."""
  d = paired(cell.final, ref.final) if ref is not None else (math.nan, math.nan, 0)
  row = dict(
    final=_fmt(cell.final),
    vs_sync=f"{d[0]:+.3f} +- {d[1]:.3f}",
    verdict=verdict(*d) if ref is not None else "-",
    reach=_reach(cell, float(ref.final.mean())) if ref is not None else "-",
    collapsed=f"{collapses(cell)}/{cell.final.size}",
    dips=f"{int(dipped(cell).sum())}/{cell.final.size}",
    lr_scale=f"{np.median(cell.lr_scale):.3f}",
  )
  if vs is not None:
    e = paired(cell.final, vs.final)
    row["vs"] = f"{e[0]:+.3f} +- {e[1]:.3f}"
    row["_vs"] = e
  row["_d"] = d
  return row


def attribution_section(cells: dict, ref: Cell | None, horizon: bool = False) -> list[str]:
  """The arms at k = 128 against sync and against the paper's VCPO, and which part explains VCPO's gap.

  horizon: the 800-step table, whose arms are a subset: only the parts it ran are explained, and no preset is
  offered from it (the protocol offers from the attribution)."""
  vcpo = cells.get(("vcpo", 128))
  L = [
    "| arm | k | final (mean +- sd) | vs sync (d +- SE) | match test | vs vcpo (d +- SE) | collapsed | dips | "
    "median lr scale | steps to 90% |",
    "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
  ]
  rows = {}
  for (m, k), cell in cells.items():
    r = rows[(m, k)] = cell_row(cell, ref, vcpo if (vcpo is not None and (m, k) != ("vcpo", 128) and k) else None)
    L.append(
      f"| {m} | {k} | {r['final']} | {r['vs_sync']} | {r['verdict']} | {r.get('vs', '-')} | {r['collapsed']} | "
      f"{r['dips']} | {r['lr_scale']} | {r['reach']} |"
    )
  L += ["", *explain(rows, vcpo, ref, horizon)]
  return L


PARTS = {  # arm -> the part of VCPO its paired difference to vcpo measures
  "vcpo_no_esslr": "the ESS brake (removed)",
  "vcpo_no_opob": "the OPOB baseline (removed)",
  "vcpo_cap4": "the TIS cap (8 -> 4)",
  "vcpo_loo_opob": "OPOB's plug-in bias (leave-one-out)",
}


def explain(rows: dict, vcpo: Cell | None, ref: Cell | None, horizon: bool = False) -> list[str]:
  """The protocol's attribution rule: a part explains the gap when changing it moves the paired difference to
  vcpo by > 2 SE towards sync AND closes at least half of VCPO's mean gap to sync. horizon: only the arms run."""
  if vcpo is None or ref is None or ("vcpo", 128) not in rows:
    return ["Attribution: VCPO or the synchronous reference at k = 128 is not finished; no verdict yet."]
  gap = rows[("vcpo", 128)]["_d"][0]
  L = [f"VCPO's mean gap to sync at k = 128: {gap:+.3f}."]
  movers = []
  for arm, part in PARTS.items():
    if (arm, 128) not in rows:
      if not horizon:
        L.append(f"- {part}: arm {arm} not finished.")
      continue
    e, se, _ = rows[(arm, 128)]["_vs"]
    towards = e * gap < 0  # opposite in sign to the gap: towards sync
    explains = towards and abs(e) > 2 * se and abs(e) >= 0.5 * abs(gap)
    movers.append((abs(e), arm))
    L.append(
      f"- {part}: {arm} - vcpo = {e:+.3f} +- {se:.3f}: "
      + ("**explains the gap** by the rule" if explains else "does not explain it by the rule")
    )
  if movers:
    L.append(f"- largest movers: {', '.join(a for _, a in sorted(movers, reverse=True)[:2])}.")
  if horizon:
    return L
  L.append(
    f"- offered as a preset (95% interval of the paired difference to vcpo above 0, no more collapses): "
    f"{', '.join(offers(rows, vcpo)) or 'none'}."
  )
  return L


def offers(rows: dict, vcpo: Cell) -> list[str]:
  """The arms the protocol offers as their own preset: beat vcpo with a 95% interval above 0, no more collapses."""
  from scipy import stats

  out = []
  for (arm, k), r in rows.items():
    if "_vs" not in r or k != 128:
      continue
    e, se, n = r["_vs"]
    if n > 1 and e - stats.t.ppf(0.975, n - 1) * se > 0 and int(r["collapsed"].split("/")[0]) <= collapses(vcpo):
      out.append(arm)
  return out


HORIZON_FIXED = ("none", "vcpo", "seq_tis_c4")  # the horizon's fixed arms; the fourth is best_arm's


def best_arm(cells: dict) -> str | None:
  """The protocol's fourth horizon arm: the attribution arm (not a fixed one) with the highest mean paired
  difference to vcpo at k = 128; ties: fewer collapses, then the one listed first. None until all are in."""
  vcpo = cells.get(("vcpo", 128))
  if vcpo is None:
    return None
  scored = [
    (-paired(x.final, vcpo.final)[0], collapses(x), i, m)
    for i, ((m, k), x) in enumerate(cells.items())
    if k == 128 and m not in HORIZON_FIXED
  ]
  return min(scored)[3] if scored else None


def grid_section(c, cells: dict, refs: dict, knobs: dict) -> list[str]:
  """The every-method table: each cell against the synchronous reference of its own machine (`refs`), and
  against vcpo at the same k where both ran on one machine."""
  L = [
    "| method | knob | k | machine | final (mean +- sd) | vs sync (d +- SE) | match test | vs vcpo (d +- SE) | "
    "steps to 90% | collapsed | dips |",
    "|---|---|---:|---|---:|---:|---|---:|---:|---:|---:|",
  ]
  for m in c.methods:
    for k in c.ks:
      if (m, k) not in cells:
        continue
      cell = cells[(m, k)]
      vs = cells.get(("vcpo", k)) if m != "vcpo" else None
      vs = vs if vs is not None and vs.machines == cell.machines else None
      r = cell_row(cell, ref_on(refs, cell), vs)
      knob = knobs.get(m)
      knob_s = "-" if knob is None else f"{knob[0]}={_value(knob[1])}"
      L.append(
        f"| {m} | {knob_s} | {k} | {machine_label(cell.machines)} | {r['final']} | {r['vs_sync']} | "
        f"{r['verdict']} | {r.get('vs', '-')} | {r['reach']} | {r['collapsed']} | {r['dips']} |"
      )
  return L


def _value(v) -> str:
  return tuning.value_str(v)


def signal_section(cells: list[Cell]) -> list[str]:
  """How often the log-mean-weight flag fires on runs that dip or collapse, and on the others."""
  hits = misses = false = quiet = 0
  leads = []
  for cell in cells:
    if cell.log_mean_weight is None:
      continue
    bad = dipped(cell) | (cell.final < 0.5 * cell.accuracy.max(-1))
    for s in range(cell.final.size):
      flag = signal_step(cell.log_mean_weight[s])
      if bad[s]:
        hits, misses = hits + (not math.isnan(flag)), misses + math.isnan(flag)
        low = cell.accuracy[s] < 0.5 * cell.accuracy[s, 0]
        first_dip = cell.eval_step[np.argmax(low)] if low.any() else math.nan
        if not math.isnan(flag) and not math.isnan(first_dip):
          leads.append(first_dip - flag)
      else:
        false, quiet = false + (not math.isnan(flag)), quiet + math.isnan(flag)
  if hits + misses + false + quiet == 0:
    return ["No record logged log_mean_weight yet."]
  lead = f"; lead time flag -> first dip: median {np.median(leads):+.0f} steps" if leads else ""
  return [
    f"Flag: trailing {SIGNAL_WINDOW}-step median of log_mean_weight below log(0.1). Runs that dip or collapse: "
    f"{hits} flagged, {misses} not; the other runs: {false} flagged, {quiet} not{lead}."
  ]


def tuning_section(c, scores: dict, knobs: dict) -> list[str]:
  L = ["| method | knob | trial values: mean auc over the tuning runs | chosen |", "|---|---|---|---|"]
  for m in c.methods:
    spec = tuning.knob_of(c, m)
    if spec is None:
      L.append(f"| {m} | - | (no knob) | - |")
      continue
    sc = scores.get(m)
    vals = ", ".join(
      f"{tuning.value_str(v)}" + ("" if sc is None else f": {s:.3f}")
      for v, s in zip(spec[1], sc if sc is not None else spec[1])
    )
    chosen = "not finished" if m not in knobs else tuning.value_str(knobs[m][1])
    L.append(f"| {m} | {spec[0]} | {vals} | {chosen} |")
  return L


def plain_verdicts(c, cells: dict, refs: dict, label: str) -> list[str]:
  """Per method and k, the protocol's "matches synchronous training" in words: the match test says matches,
  no run collapsed, and the cell reaches 90% of the sync plateau. refs: {machine: the synchronous reference
  run there}; a cell is judged against its own machine's."""
  if not refs:
    return ["The synchronous reference is not finished: no verdict."]
  L = []
  for m in c.methods:
    words = []
    for k in c.ks:
      if k == 0 or (m, k) not in cells:
        continue
      cell = cells[(m, k)]
      ref = ref_on(refs, cell)
      if ref is None:
        words.append(f"k = {k}: no reference on its machine ({machine_label(cell.machines)}) yet")
        continue
      d = paired(cell.final, ref.final)
      v = verdict(*d)
      reach = _reach(cell, float(ref.final.mean())) != "never"
      full = v == "matches" and collapses(cell) == 0 and reach
      words.append(f"k = {k}: " + ("**matches**" if full else f"does not match ({v}, d {d[0]:+.3f})"))
    if words:
      L.append(f"- {m} ({label}): " + "; ".join(words) + ".")
  return L


def figure(studies: dict, ref: Cell | None, href: Cell | None, commit: str):
  """Accuracy against the learner step: the attribution's arms, the horizon's, and every method per k."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  grid_c, grid = studies["protocol"]
  lagged = [k for k in grid_c.ks if k]
  panels = [("attribution, k = 128 (200 steps)", studies["protocol_attribution"][1], ref)]
  panels.append(("horizon, k = 128 (800 steps)", studies["protocol_horizon"][1], href))
  panels += [(f"every method, k = {k}", {key: x for key, x in grid.items() if key[1] == k}, ref) for k in lagged]
  fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 4.2), squeeze=False, layout="constrained")
  names = list(dict.fromkeys(m for _, cells, _ in panels for (m, k) in cells if k))
  cmap = plt.get_cmap("tab20")
  color = {m: cmap(i % 20) for i, m in enumerate(names)}  # one colour per method in every panel
  for ax, (title, cells, sync) in zip(axes[0], panels):
    if sync is not None:
      ax.plot(sync.eval_step, sync.accuracy.mean(0), "k--", lw=2, label="sync (none, k = 0)")
    for (m, k), cell in ((key, x) for key, x in cells.items() if key[1] != 0):
      mean, sd = cell.accuracy.mean(0), cell.accuracy.std(0, ddof=1)
      ax.plot(cell.eval_step, mean, color=color[m], lw=1.4, label=m)
      ax.fill_between(cell.eval_step, mean - sd, mean + sd, color=color[m], alpha=0.12)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("learner step")
    ax.set_ylabel("held-out accuracy (mean, +-1 sd)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[1]:
      ax.legend(fontsize=6, loc="lower right")
  fig.suptitle(f"claim protocol on the countdown testbed, lr 2e-4, commit {commit}", fontsize=10)
  return fig


def load_studies(root: Path) -> dict:
  """{variant: (its config with the ledger under root, {(method, k): Cell})}, tuning choices applied."""
  out, knobs, scores = {}, {}, {}
  for variant in STUDIES:
    c = stability.load_config(variant)
    c.trainer.ledger = str(root / c.trainer.ledger)
    if variant == "protocol_horizon":  # the fixed arms plus whichever attribution arm the rule added
      c.methods = tuple(dict.fromkeys((*c.methods, *stability.load_config("protocol_attribution").methods)))
    cells = {}
    for m in c.methods:
      knob = None
      if c.tuning.enabled:
        try:
          knob, scores[m] = tuned_knob(c, m)
        except LookupError:
          continue
        if knob is not None:
          knobs[m] = knob
      for k in stability.ks_of(c, m):
        cell = load_cell(c, m, k, knob)
        if cell is not None:
          cells[(m, k)] = cell
    out[variant] = (c, cells)
  out["_tuning"] = (knobs, scores)
  return out


def machine_references(root: Path, cells: dict) -> dict:
  """{machine: Cell}: the synchronous reference (`none` k = 0, the protocol's seeds) of each machine, from the
  studies' cells and from the ledger of references rerun on another machine (MACHINE_LEDGER)."""
  refs = {}
  c = stability.load_config("protocol_attribution")
  c.trainer.ledger = str(root / MACHINE_LEDGER)
  for cell in (cells.get(REFERENCE), load_cell(c, *REFERENCE)):
    if cell is not None and len(cell.machines) == 1:
      refs.setdefault(next(iter(cell.machines)), cell)
  return refs


def write(root: Path, out: Path, command: str, allow_mixed: bool = False) -> Path:
  studies = load_studies(root)
  knobs, scores = studies.pop("_tuning")
  (ac, attr), (hc, hor), (gc, grid) = (studies[v] for v in STUDIES)
  ref, href = attr.get(REFERENCE) or grid.get(REFERENCE), hor.get(REFERENCE)
  refs = machine_references(root, {REFERENCE: ref} if ref is not None else {})
  one = lambda x: {next(iter(x.machines)): x} if x is not None and len(x.machines) == 1 else {}
  commits = {
    "attribution": check_one_source(list(attr.values()), "attribution table", allow_mixed),
    "horizon": check_one_source(list(hor.values()), "horizon table", allow_mixed),
    "grid": check_per_machine(list(grid.values()), refs, "every-method table", allow_mixed),
  }
  out.mkdir(parents=True, exist_ok=True)
  fig = figure(studies, ref, href, next(iter(commits.values())))
  fig.savefig(out / "claim.png", dpi=100)
  n_attr = sum(len(stability.ks_of(ac, m)) for m in ac.methods)
  n_grid = sum(len(stability.ks_of(gc, m)) for m in gc.methods)
  L = [
    "# The paper's claim on the CPU testbed, under its protocol",
    "",
    "Does VCPO at a high lag learn as well as synchronous training, and which of its parts decides it at "
    "k = 128? The rules (endpoints, seeds, tuning, the match test, what counts as a match) were committed before "
    f"the runs: [claim_protocol.md](claim_protocol.md). This page: `{command}`; runs: `bash "
    "launch/claim_protocol.sh`. Every number below is a paired comparison on the same seeds; +- after a "
    f"final accuracy is the sample std over seeds, after a difference its standard error. Commit of the records: "
    f"{commits['attribution']} (attribution), {commits['horizon']} (horizon), {commits['grid']} (every method).",
    "",
    "![accuracy against step](claim.png)",
    "",
    f"## Attribution at k = 128 (200 steps, seeds {list(ac.seeds)}; {len(attr)} of {n_attr} cells)",
    "",
    *attribution_section(attr, ref),
    "",
    f"## Horizon: 800 steps at k = 128 (seeds {list(hc.seeds)}; {len(hor)} cells)",
    "",
    f"Arms: sync, {', '.join(HORIZON_FIXED[1:])} and the attribution's best arm by the protocol's rule: "
    f"**{best_arm(attr) or 'not decided (the attribution is not finished)'}**.",
    "",
    *(attribution_section(hor, href, horizon=True) if hor else ["Not started."]),
    "",
    f"## Every method at every lag (200 steps, seeds {list(gc.seeds)}; {len(grid)} of {n_grid} cells)",
    "",
    f"Tuning (the protocol's rule: 4 values of each method's own knob, tuning seeds {list(gc.tuning.seeds)} at "
    f"(k, lr) = {[tuple(x) for x in gc.tuning.cells]}, score = mean accuracy over the evaluations after step 0):",
    "",
    *tuning_section(gc, scores, knobs),
    "",
    f"Machines: {', '.join(machine_label(frozenset([m])) for m in sorted(refs)) or '-'}; each cell is paired with "
    "the synchronous reference run on its own machine (claim_protocol.md, deviation of 2026-12-06).",
    "",
    *grid_section(gc, grid, refs, knobs),
    "",
    "## A collapse signal the ESS misses",
    "",
    *signal_section([*attr.values(), *hor.values(), *grid.values()]),
    "",
    "## Verdicts (the protocol's rule: the match test says matches, no run collapsed, 90% of the sync plateau reached)",
    "",
    *plain_verdicts(ac, attr, one(ref), "attribution: fixed settings"),
    *plain_verdicts(hc, hor, one(href), "800 steps"),
    *plain_verdicts(gc, grid, refs, "tuned"),
  ]
  path = out / "claim.md"
  path.write_text("\n".join(L) + "\n")
  return path


def main(argv=None) -> int:
  import argparse

  p = argparse.ArgumentParser(prog="python -m vcpo_jax.experiments.claim", description=__doc__.split("\n\n")[0])
  p.add_argument("--root", default=str(stability._ROOT), help="the checkout whose ledgers are read")
  p.add_argument("--out", default="docs/results", help="where claim.md and claim.png go")
  p.add_argument("--allow_mixed", action="store_true", help="allow records of several commits / machines")
  args = p.parse_args(argv)
  command = " ".join(["python -m vcpo_jax.experiments.claim", *(argv if argv is not None else sys.argv[1:])])
  try:
    print(write(Path(args.root), Path(args.out), command, args.allow_mixed))
  except MixedRecords as e:
    print(f"claim: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
