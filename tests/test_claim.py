"""vcpo_jax.experiments.claim: steps-to-reach, the seed-noise rule, the table and the report on hand-made cells."""

import math

import ml_collections
import numpy as np

from vcpo_jax.experiments import claim


def _c():
  c = ml_collections.ConfigDict()
  c.methods = ("none", "vcpo")
  c.ks = (0, 128)
  c.seeds = (0, 1, 2)
  c.lrs = (2e-4,)
  return c


def test_steps_to_reach_is_the_first_evaluation_at_the_target():
  ev = np.array([0, 25, 50, 75])
  assert claim.steps_to_reach(ev, np.array([0.1, 0.4, 0.6, 0.5]), 0.45) == 50
  assert claim.steps_to_reach(ev, np.array([0.1, 0.4, 0.6, 0.5]), 0.4) == 25  # >=, not >
  assert math.isnan(claim.steps_to_reach(ev, np.array([0.1, 0.2, 0.3, 0.3]), 0.45))


def test_matches_is_two_standard_errors_of_the_difference():
  a, b = np.array([0.50, 0.52, 0.54]), np.array([0.40, 0.42, 0.44])
  same, diff, se = claim.matches(a, b)
  # var(ddof=1) = 4e-4 each: se = sqrt(2 * 4e-4 / 3) = 0.01633; diff 0.10 > 2 se
  assert not same and abs(diff - 0.10) < 1e-12
  assert abs(se - math.sqrt(2 * 4e-4 / 3)) < 1e-12
  same, diff, se = claim.matches(a, a + 0.02)
  assert same and abs(diff + 0.02) < 1e-12  # 0.02 < 2 x 0.01633


def test_table_rows_and_verdict_from_hand_made_cells():
  ev = np.array([0, 100, 200])
  ref = np.array([[0.2, 0.5, 0.6], [0.2, 0.5, 0.6], [0.2, 0.4, 0.6]])  # final 0.6 each
  cur = {
    ("none", 0): (ev, ref, ref[:, -1], 0),
    ("none", 128): (ev, ref * 0.5, ref[:, -1] * 0.5, 3),  # collapsed, far below
    ("vcpo", 128): (ev, ref, ref[:, -1] + np.array([0.0, 0.01, -0.01]), 0),
  }
  rows, verdict = claim.table(_c(), cur)
  assert verdict == {("none", 0): True, ("none", 128): False, ("vcpo", 128): True}
  vcpo = next(r for r in rows if r.startswith("| vcpo | 128"))
  # 90% of the reference's final 0.6 = 0.54: the seed-mean curve first reaches it at step 200
  assert "| 200 |" in vcpo and "0/3" in vcpo and "matches" in vcpo
  stale = next(r for r in rows if r.startswith("| none | 128"))
  assert "| never |" in stale and "3/3" in stale and "differs" in stale
