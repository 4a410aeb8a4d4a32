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
  c.mode = "sync"  # sample with the current policy, then learn (k = 0)
  c.method = "vcpo"  # ESS-scaled lr + OPOB + sequence TIS c = 8 on GRPO advantages
  c.task.name = "countdown"  # generated, solver-checked instances; exact-fraction verifier
  c.task.template = "{numbers}>{target}:"  # short prompt for a char-level model
  c.task.gen.num_numbers = (3, 3)  # 3 numbers: with 2 the warm start alone reaches ~80% greedy
  c.task.gen.number_range = (1, 9)  # single digits: one token each
  c.task.gen.target_range = (1, 30)  # small targets keep solutions short
  c.task.prompts_per_step = 8  # P
  c.task.group_size = 8  # G (N = 64 trajectories per step)
  c.task.max_prompt_len = 24  # prompt bucket in characters (= tokens)
  c.task.max_new_tokens = 16  # response budget; solutions are ~5 characters + EOS
  c.model.preset = "tiny_qwen2"  # Qwen2-style (GQA, q/k/v bias, tied embeddings), random init
  c.model.hidden_size = 128  # 0.4M params; after 300 SFT steps 36% greedy vs 8% for the 0.09M preset
  c.model.num_layers = 3  # transformer blocks
  c.model.intermediate_size = 256  # SwiGLU width
  c.optim.lr = 3e-4  # 1e-3 first drops accuracy (7% train acc over steps 1-10 vs 11%)
  c.optim.weight_decay = 0.0  # no decay for a 120-step run of a tiny model
  c.eval.num_problems = 128  # x eval.n = 3 samples: standard error ~2 points at 20%
  c.eval.every = 40  # evaluations at steps 0, 40, 80, 120
  c.checkpoint.every = 40  # checkpoints (kept: last 2 + best eval accuracy)
  c.sft.steps = 200  # base policy ~20% eval accuracy (300 steps: ~35% greedy)
  if arg == "smoke":  # a few steps of the real code path (tests, CI)
    c.steps = 3  # a few updates
    c.task.prompts_per_step = 2  # P
    c.task.group_size = 4  # G
    c.eval.num_problems = 4  # a tiny evaluation at start and end
    c.eval.n = 1  # one sample per problem
    c.eval.every = 0  # start and end only
    c.checkpoint.every = 2  # exercise saving mid-run
    c.sft.steps = 0  # no warm start
    c.model.hidden_size = None  # the preset's smallest model: the smoke run tests code, not learning
    c.model.num_layers = None  # preset value
    c.model.intermediate_size = None  # preset value
    c.log.progress = False  # quiet in tests
    c.log.plots = False  # no PNGs in tests
    c.log.norm_overhead_every = 2  # exercise the overhead timing
  elif arg:
    raise ValueError(f"configs/countdown.py: unknown variant {arg!r}; use '' or 'smoke'.")
  return c
