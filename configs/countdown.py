"""Countdown on CPU: the default that README's first command runs.

A tiny Qwen2-style policy is warm-started on solver-written solutions (cached),
then trained with VCPO. Launch:

  python main.py --config=configs/countdown.py --workdir=/tmp/vcpo_countdown
  python main.py --config=configs/countdown.py:smoke --workdir=/tmp/smoke        # a few steps, tests
  python main.py --config=configs/countdown.py --config.mode=lag --config.lag.k=8 --config.method=seq_tis
"""
from configs import common


def get_config(arg: str | None = None):
  c = common.get_base_config()
  c.steps = 60
  c.mode = "sync"
  c.method = "vcpo"
  c.task.name = "countdown"
  c.task.template = "{numbers}>{target}:"  # short prompt for a char-level model
  c.task.gen.num_numbers = (3, 3)
  c.task.gen.number_range = (1, 9)
  c.task.gen.target_range = (1, 30)
  c.task.prompts_per_step = 8
  c.task.group_size = 8
  c.task.max_prompt_len = 24
  c.task.max_new_tokens = 16
  c.model.preset = "tiny_qwen2"
  c.optim.lr = 3e-4
  c.optim.weight_decay = 0.0
  c.eval.num_problems = 64
  c.eval.every = 20
  c.checkpoint.every = 20
  c.sft.steps = 300
  if arg == "smoke":  # a few steps of the real code path (tests, CI)
    c.steps = 3
    c.task.prompts_per_step = 2
    c.task.group_size = 4
    c.eval.num_problems = 4
    c.eval.n = 1
    c.eval.every = 0
    c.checkpoint.every = 2
    c.sft.steps = 0
    c.log.progress = False
    c.log.plots = False
  elif arg:
    raise ValueError(f"configs/countdown.py: unknown variant {arg!r}; use '' or 'smoke'.")
  return c
