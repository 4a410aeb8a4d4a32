"""vcpo_jax.experiments.claim: the protocol's rules on hand numbers, and the report on hand-made ledger records."""

import math
from pathlib import Path

import numpy as np
import pytest

from vcpo_jax.experiments import claim, stability

COMMIT = "c0ffee" * 6 + "abcd"


def test_match_test_is_an_equivalence_test_that_a_noisy_cell_cannot_pass():
  # d = +-0.01, +-0.02, 0: mean 0, sd 0.01581, SE 0.007071; t(0.95, 4) = 2.1318 -> 90% CI +-0.0151 inside +-0.05
  quiet = np.array([0.01, -0.01, 0.0, 0.02, -0.02])
  m, se, n = claim.paired(quiet, np.zeros(5))
  assert m == pytest.approx(0.0, abs=1e-12) and se == pytest.approx(0.0158114 / math.sqrt(5), rel=1e-5) and n == 5
  assert claim.verdict(m, se, n) == "matches"
  # the same mean with a spread of +-0.1: SE 0.03536, 90% CI +-0.0754 crosses the margin -> not a match
  noisy = np.array([0.1, -0.1, 0.05, -0.05, 0.0])
  assert claim.verdict(*claim.paired(noisy, np.zeros(5))) == "inconclusive"
  # the old "within 2 SE" rule would call the noisy one a match; a clear gap is "below", a clear gain "above"
  assert claim.verdict(*claim.paired(np.array([-0.2, -0.22, -0.18, -0.21, -0.19]), np.zeros(5))) == "below"
  assert claim.verdict(*claim.paired(np.array([0.2, 0.22, 0.18, 0.21, 0.19]), np.zeros(5))) == "above"
  # mean -0.04 +- 0.004: inside the margin? 90% CI [-0.0485, -0.0315] -> matches; at -0.047 it does not
  assert claim.verdict(-0.04, 0.004, 5) == "matches" and claim.verdict(-0.047, 0.004, 5) == "below"
  assert claim.verdict(0.0, math.inf, 1) == "inconclusive"


def test_pairing_is_by_seed_not_by_cell_means():
  a, b = np.array([0.3, 0.5, 0.7]), np.array([0.29, 0.49, 0.69])  # a tiny, steady gain across seeds
  m, se, _ = claim.paired(a, b)
  assert m == pytest.approx(0.01) and se == pytest.approx(0.0, abs=1e-12)  # unpaired SE would be ~0.12


def test_steps_to_reach_counts_only_a_level_that_is_kept():
  ev = np.array([0, 25, 50, 75, 100])
  curve = np.array([0.1, 0.6, 0.3, 0.6, 0.7])
  assert claim.steps_to_reach(ev, curve, 0.5) == 75  # reached at 25, lost at 50: the lasting hit is 75
  assert claim.steps_to_reach(ev, curve, 0.6) == 75  # >=, not >
  assert math.isnan(claim.steps_to_reach(ev, curve, 0.8))


def _cell(acc, ev=(0, 100, 200), lmw=None, commits=(COMMIT,), machines=("cpu",), steps=200):
  acc = np.asarray(acc, float)
  ev = np.asarray(ev)
  return claim.Cell(
    method="m",
    k=128,
    knob=None,
    seeds=tuple(range(len(acc))),
    eval_step=ev,
    accuracy=acc,
    final=stability.final_value(acc, ev, steps, 0.2),
    lr_scale=np.ones((len(acc), steps)),
    log_mean_weight=None if lmw is None else np.asarray(lmw, float),
    commits=frozenset(commits),
    machines=frozenset(machines),
  )


def test_collapses_dips_and_the_log_mean_weight_flag_hand_made():
  cell = _cell([[0.4, 0.5, 0.6], [0.4, 0.1, 0.5], [0.4, 0.6, 0.15]])
  assert claim.collapses(cell) == 1  # run 2: final 0.15 < 0.5 x 0.6
  assert claim.dipped(cell).tolist() == [False, True, True]  # run 1 fell to 0.1 < 0.2 (half of step 0), recovered
  # the flag: trailing 10-step median of log_mean_weight below log(0.1) = -2.303
  lmw = np.zeros(30)
  lmw[12:] = -5.0
  assert claim.signal_step(lmw) == 17  # steps 13.. low; at step 17 five of ten are: median (0 - 5) / 2 < log 0.1
  assert math.isnan(claim.signal_step(np.full(30, -1.0)))  # a mean weight of 0.37 is no flag


def test_a_table_refuses_records_of_two_commits():
  a, b = _cell([[0.4, 0.5, 0.6]] * 2), _cell([[0.4, 0.5, 0.6]] * 2, commits=("f" * 40,))
  assert claim.check_one_source([a], "t", False) == COMMIT[:10]
  with pytest.raises(claim.MixedRecords, match="t: records from 2 commits"):
    claim.check_one_source([a, b], "t", False)
  claim.check_one_source([a, b], "t", True)  # told to: allowed
  with pytest.raises(claim.MixedRecords, match="2 machines"):
    claim.check_one_source([a, _cell([[0.4, 0.5, 0.6]] * 2, machines=("other",))], "t", False)


def test_the_attribution_rule_names_the_part_that_closes_the_gap():
  ref = _cell([[0.2, 0.5, 0.6]] * 5)
  off = np.array([0.0, 0.01, -0.01, 0.02, -0.02])[:, None]
  vcpo = _cell(np.array([[0.2, 0.3, 0.4]] * 5) + off)  # 0.2 below sync
  brake = _cell(np.array([[0.2, 0.45, 0.58]] * 5) + off)  # closes 0.18 of it
  cap = _cell(np.array([[0.2, 0.3, 0.42]] * 5) + off[::-1])  # +0.02: too small to explain it
  cells = {("none", 0): ref, ("vcpo", 128): vcpo, ("vcpo_no_esslr", 128): brake, ("vcpo_cap4", 128): cap}
  text = "\n".join(claim.attribution_section(cells, ref))
  assert "VCPO's mean gap to sync at k = 128: -0.200" in text
  assert "the ESS brake (removed): vcpo_no_esslr - vcpo = +0.180 +- 0.000: **explains the gap**" in text
  assert "the TIS cap (8 -> 4): vcpo_cap4 - vcpo = +0.020" in text and "does not explain it" in text
  assert "the OPOB baseline (removed): arm vcpo_no_opob not finished" in text
  assert (
    "offered as a preset (95% interval of the paired difference to vcpo above 0, no more collapses): vcpo_no_esslr, vcpo_cap4"
    in text
  )
  horizon = "\n".join(claim.attribution_section(cells, ref, horizon=True))  # only the arms it ran
  assert "vcpo_no_esslr - vcpo = +0.180" in horizon and "not finished" not in horizon
  assert "offered as a preset" not in horizon
  assert claim.best_arm(cells) == "vcpo_no_esslr"  # +0.18 against vcpo_cap4's +0.02
  assert claim.best_arm({("vcpo_cap4", 128): cap}) is None  # no vcpo yet: no choice


def _write_record(c, method, k, seed, acc, knob=None, stage="", commit=COMMIT):
  path = stability.record_path(c, method, k, c.lrs[0], seed, knob, stage)
  steps = c.task.steps
  ev = np.arange(0, steps + 1, c.task.eval_every)
  stability.save_cell(
    path,
    dict(
      accuracy=np.where(ev == 0, acc[0], acc[1]),  # the warm start, then a plateau
      eval_step=ev,
      lr_scale=np.ones(steps),
      log_mean_weight=np.zeros(steps),
      commit=np.asarray(commit),
      machine=np.asarray("cpu"),
    ),
    "fp",
    1.0,
  )


def _ledger(tmp_path: Path, variant: str):
  c = stability.load_config(variant)
  c.trainer.ledger = str(tmp_path / c.trainer.ledger)
  return c


@pytest.mark.slow
def test_report_from_hand_made_ledger_records(tmp_path):
  """claim.write on records laid out as the studies write them: tuning choices by auc, the attribution table,
  the every-method table with VCPO's tuned knob, the verdicts; a second commit makes it refuse (exit 2)."""
  a = _ledger(tmp_path, "protocol_attribution")
  for s in a.seeds:
    _write_record(a, "none", 0, s, [0.2, 0.6 + 0.01 * s])
    _write_record(a, "vcpo", 128, s, [0.2, 0.4 + 0.01 * s])
    _write_record(a, "vcpo_no_esslr", 128, s, [0.2, 0.58 + 0.01 * s])
  g = _ledger(tmp_path, "protocol")
  name, values = g.tuning.knobs["vcpo"]
  for i, v in enumerate(values):  # the third value has the best auc
    for s in g.tuning.seeds:
      _write_record(g, "vcpo", 128, s, [0.2, 0.5 if i == 2 else 0.3], knob=(name, v), stage="tune")
  for s in g.seeds:
    _write_record(g, "vcpo", 8, s, [0.2, 0.6 + 0.01 * s], knob=(name, values[2]))
  out = tmp_path / "out"
  assert claim.main(["--root", str(tmp_path), "--out", str(out)]) == 0
  text = (out / "claim.md").read_text()
  assert "| vcpo | 128 | 0.420 +- 0.016 | -0.200 +- 0.000 | below |" in text
  assert "the ESS brake (removed): vcpo_no_esslr - vcpo = +0.180 +- 0.000: **explains the gap**" in text
  assert "the attribution's best arm by the protocol's rule: **vcpo_no_esslr**" in text
  assert f"| vcpo | rho_on | 0.25: 0.300, 0.5: 0.300, 0.75: 0.500, 1: 0.300 | {values[2]:g} |" in text
  assert f"| vcpo | rho_on={values[2]:g} | 8 | cpu | 0.620 +- 0.016 | +0.000 +- 0.000 | matches |" in text
  assert "- vcpo (attribution: fixed settings): k = 128: does not match (below, d -0.200)." in text
  assert "- vcpo (tuned): k = 8: **matches**." in text
  assert (out / "claim.png").stat().st_size > 0
  _write_record(a, "vcpo_cap4", 128, 0, [0.2, 0.4], commit="f" * 40)
  for s in a.seeds[1:]:
    _write_record(a, "vcpo_cap4", 128, s, [0.2, 0.4])
  assert claim.main(["--root", str(tmp_path), "--out", str(out)]) == 2
  assert claim.main(["--root", str(tmp_path), "--out", str(out), "--allow_mixed"]) == 0


def test_every_method_table_pairs_each_cell_with_its_own_machines_reference():
  """Two CPU models give different runs from step 0 (claim_protocol.md's deviation): a cell is compared with the
  sync reference of the machine it ran on, a cell spanning machines or without a reference there is refused."""
  amd, intel = ("AMD EPYC",), ("Intel(R) Xeon(R) Processor",)
  refs = {amd[0]: _cell([[0.2, 0.5, 0.6]] * 3, machines=amd), intel[0]: _cell([[0.2, 0.6, 0.7]] * 3, machines=intel)}
  a = _cell([[0.2, 0.5, 0.55]] * 3, machines=amd)  # -0.05 against the AMD reference
  b = _cell([[0.2, 0.6, 0.68]] * 3, machines=intel)  # -0.02 against the Intel one (would be +0.08 against AMD's)
  b.method = "b"
  assert claim.check_per_machine([a, b], refs, "t", False) == COMMIT[:10]
  text = "\n".join(claim.grid_section(_grid_config(("m", "b")), {("m", 128): a, ("b", 128): b}, refs, {}))
  assert "| m | - | 128 | AMD | 0.550 +- 0.000 | -0.050 +- 0.000 |" in text
  assert "| b | - | 128 | Intel | 0.680 +- 0.000 | -0.020 +- 0.000 |" in text
  assert "| - |" in text.split("| b |")[1]  # b vs vcpo: no vcpo on its machine, so no pair
  both = _cell([[0.2, 0.5, 0.55]] * 3, machines=amd + intel)
  with pytest.raises(claim.MixedRecords, match="m k = 128 hold records of several machines"):
    claim.check_per_machine([both], refs, "t", False)
  with pytest.raises(claim.MixedRecords, match="no synchronous reference on"):
    claim.check_per_machine([b], {amd[0]: refs[amd[0]]}, "t", False)
  verdicts = claim.plain_verdicts(_grid_config(("m", "b")), {("m", 128): a, ("b", 128): b}, {amd[0]: refs[amd[0]]}, "x")
  assert "no reference on its machine (Intel)" in "\n".join(verdicts)


def _grid_config(methods):
  import ml_collections

  return ml_collections.ConfigDict(dict(methods=methods, ks=(128,)))
