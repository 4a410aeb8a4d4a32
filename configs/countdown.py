"""Countdown on CPU: the default that README's first command runs (asynchronous VCPO, lag bound k = 4).

A testbed where RL visibly learns in a few minutes on 2 cores. A tiny Qwen2-style policy (0.4M parameters:
width 128, 3 layers, char-level) is warm-started on a noisy demonstrator (200 supervised steps; 3 of 4
targets are well-formed wrong expressions; cached under ~/.cache/vcpo_jax/sft, so only the first run pays
for it): it knows the answer format and the arithmetic but prefers wrong answers, about 20% correct at the
evaluation protocol. RL moves the probability mass onto what the verifier accepts (+35 points in 200
steps on seed 0), the job RL does on a pretrained language model. The default runs it
asynchronously: a sampler process on its own device streams rollouts up to k = 4 learner steps old through
the shared-memory queue, so the importance ratios drift from 1 and VCPO's ESS-scaled rate brakes the
steps where they do (measured numbers: docs/results/cpu_default.md). Launch:

  python main.py --config=configs/countdown.py --workdir=/tmp/vcpo_countdown
  python main.py --config=configs/countdown.py --workdir=/tmp/sync --config.mode=sync      # the reference
  python main.py --config=configs/countdown.py --workdir=/tmp/lag32 --config.mode=lag --config.lag.k=32 --config.method=none
  python main.py --config=configs/countdown.py:smoke --workdir=/tmp/smoke                   # a few steps, tests
  python main.py --config=configs/countdown.py:study13 ...   # the earlier, harder testbed (the committed study)
  python main.py --config=configs/countdown.py:moe ...       # a tiny Qwen3-MoE policy, lag k = 8, routing replay
"""

from configs import common
from vcpo_jax.rl import choices


def get_config(arg: str | None = None):
  c = common.get_base_config()
  c.steps = 200  # RL steps; eval accuracy plateaus after ~150 at this lr
  c.mode = "async"  # sampler process + shared-memory queue (sync: k = 0 in one process; lag: exact staleness k)
  c.lag.k = 4  # lag bound: rollouts are at most 4 learner steps old, so the ESS falls below 1 and the brake acts
  c.method = choices.preset("vcpo")  # ESS-scaled lr + OPOB + sequence TIS c = 8 on GRPO advantages
  c.task.name = "countdown"  # generated, solver-checked instances; exact-fraction verifier
  c.task.template = "{numbers}>{target}:"  # short prompt for a char-level model
  c.task.gen.num_numbers = (2, 2)  # 2 numbers: a 0.4M model learns the arithmetic (3: ~30% after any warm start)
  c.task.gen.number_range = (1, 19)  # 1..19: 738 train / 66 held-out instances (1..9: only 14 held out)
  c.task.gen.target_range = (1, 40)  # targets reachable with one operation on two such numbers
  c.task.prompts_per_step = 8  # P
  c.task.group_size = 8  # G (N = 64 trajectories per step)
  c.task.max_prompt_len = 24  # prompt bucket in characters (= tokens)
  c.task.max_new_tokens = 16  # response budget; solutions are ~5 characters + EOS
  c.model.preset = "tiny_qwen2"  # Qwen2-style (GQA, q/k/v bias, tied embeddings), random init
  c.model.hidden_size = 128  # 0.4M params: learns 2-number arithmetic in ~200 supervised steps
  c.model.num_layers = 3  # transformer blocks
  c.model.intermediate_size = 256  # SwiGLU width
  c.model.scan_layers = False  # 3 blocks unrolled: XLA:CPU runs the step faster than the layer scan (deep models scan)
  c.optim.lr = 2e-4  # 1e-4 reaches the plateau ~50 steps later; 1e-3 collapses to one answer per prompt
  c.optim.weight_decay = 0.0  # no decay for a 200-step run of a tiny model
  c.eval.num_problems = 256  # drawn from the 66 held-out instances, x eval.n samples
  c.eval.n = 3  # samples per problem (countdown's own protocol; written out: the study's run fingerprints hold it)
  c.eval.every = 25  # evaluations at steps 0, 25, ..., 200
  c.checkpoint.every = 50  # checkpoints (kept: last 2 + best eval accuracy)
  c.sft.steps = 200  # the warm start learns the format and the arithmetic (~90% greedy without noise) ...
  c.sft.noise = 0.75  # ... from a noisy demonstrator: 3 of 4 targets are wrong, so it samples ~20% correct
  if arg in ("study13", "smoke"):  # the earlier default (3 numbers, sync, 120 steps): the committed study's runs
    c.steps = 120  # RL steps
    c.mode = "sync"  # sample with the current policy, then learn (k = 0)
    c.lag.k = 0  # synchronous
    c.task.gen.num_numbers = (3, 3)  # 3 numbers: harder; the 0.4M policy barely improves on its warm start
    c.task.gen.number_range = (1, 9)  # single digits
    c.task.gen.target_range = (1, 30)  # targets
    c.optim.lr = 3e-4  # the study's selected lr
    c.eval.num_problems = 128  # x eval.n = 3 samples
    c.eval.every = 40  # evaluations at steps 0, 40, 80, 120
    c.checkpoint.every = 40  # checkpoints
    c.sft.steps = 200  # base policy ~29% eval accuracy
    c.sft.noise = 0.0  # the solver's solutions only
  if arg == "smoke":  # a few steps of the real code path (tests, CI), on the study13 settings
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
  if arg == "moe":  # the same testbed on a tiny Qwen3-MoE policy (issue 41's replay evidence, moe_replay_protocol.md)
    c.model.preset = "tiny_qwen3_moe"  # 8 experts, top-2, normalised gates; hidden / layers as above (0.51M params)
    c.model.intermediate_size = None  # every layer is an MoE block: each expert's width is moe_intermediate_size
    c.model.routing_replay = True  # the learner replays the sampler's experts (--config.model.routing_replay=false)
    c.mode = "lag"  # exact staleness: runs with and without replay see the same lag at every step
    c.lag.k = 8  # rollouts 8 learner steps old: the learner's routing drifts from the sampler's
    c.steps = 150  # RL steps (the protocol's budget on the shared CPU)
    c.eval.every = 50  # evaluations at steps 0, 50, 100, 150
  if arg not in (None, "", "smoke", "study13", "moe"):
    raise ValueError(f"configs/countdown.py: unknown variant {arg!r}; use '', 'smoke', 'study13' or 'moe'.")
  return c
