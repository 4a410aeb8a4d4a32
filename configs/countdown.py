"""Countdown on CPU: the default that README's first command runs.

A tiny Qwen2-style policy (0.4M parameters: width 128, 3 layers) is
warm-started on the solver's shortest solutions (200 supervised steps, cached
under ~/.cache/vcpo_jax/sft, so only the first run pays for it), then trained
with VCPO (sync) for 120 steps. Instances are made easy enough for a model that
trains in minutes: exactly 3 numbers in 1..9, targets in 1..30, a short
char-level prompt "[3, 1, 6]>4:" and a bare-expression answer "3+1". The warm
start reaches about 20% eval accuracy; RL raises it (measured numbers, wall and
CPU time: docs/results/cpu_default.md). Launch:

  python main.py --config=configs/countdown.py --workdir=/tmp/vcpo_countdown
  python main.py --config=configs/countdown.py:smoke --workdir=/tmp/smoke        # a few steps, tests
  python main.py --config=configs/countdown.py --config.mode=lag --config.lag.k=8 --config.method=seq_tis
"""

from configs import common


def get_config(arg: str | None = None):
  c = common.get_base_config()
  c.steps = 120  # RL steps; train accuracy rises steadily over them at this lr
  c.mode = "sync"
  c.method = "vcpo"
  c.task.name = "countdown"
  c.task.template = "{numbers}>{target}:"  # short prompt for a char-level model
  c.task.gen.num_numbers = (3, 3)  # 3 numbers: with 2 the warm start alone reaches ~80% greedy
  c.task.gen.number_range = (1, 9)
  c.task.gen.target_range = (1, 30)
  c.task.prompts_per_step = 8
  c.task.group_size = 8
  c.task.max_prompt_len = 24
  c.task.max_new_tokens = 16
  c.model.preset = "tiny_qwen2"
  c.model.hidden_size = 128  # 0.4M params; after 300 SFT steps 36% greedy vs 8% for the 0.09M preset
  c.model.num_layers = 3
  c.model.intermediate_size = 256
  c.optim.lr = 3e-4  # 1e-3 first drops accuracy (7% train acc over steps 1-10 vs 11%)
  c.optim.weight_decay = 0.0
  c.eval.num_problems = 128  # x eval.n = 3 samples: standard error ~2 points at 20%
  c.eval.every = 40
  c.checkpoint.every = 40
  c.sft.steps = 200  # base policy ~20% eval accuracy (300 steps: ~35% greedy)
  if arg == "smoke":  # a few steps of the real code path (tests, CI)
    c.steps = 3
    c.task.prompts_per_step = 2
    c.task.group_size = 4
    c.eval.num_problems = 4
    c.eval.n = 1
    c.eval.every = 0
    c.checkpoint.every = 2
    c.sft.steps = 0
    c.model.hidden_size = None  # the preset's smallest model: the smoke run tests code, not learning
    c.model.num_layers = None
    c.model.intermediate_size = None
    c.log.progress = False
    c.log.plots = False
    c.log.norm_overhead_every = 2  # exercise the overhead timing
  elif arg:
    raise ValueError(f"configs/countdown.py: unknown variant {arg!r}; use '' or 'smoke'.")
  return c
