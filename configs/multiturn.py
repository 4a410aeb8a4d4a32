"""Multi-turn tool use with Qwen2.5-7B: the released VCPO setting (128 x 16, 4096/12288 tokens, k = 2).

The policy reasons in text and may run Python between <code> and </code>; the
sandbox's output comes back between <output> and </output> as tool tokens
(context for the policy, excluded from the loss and the importance ratios; see
vcpo_jax/rollout/multiturn.py). The reward is the final turn's answer.

Needs a local checkpoint and a training set of math problems with integer
answers in the AIME schema (problem, answer), e.g. a DAPO-Math-style set
converted to jsonl; nothing is fetched at run time:

  huggingface-cli download Qwen/Qwen2.5-7B-Instruct --local-dir ~/models/Qwen2.5-7B-Instruct
  #   ~/data/tool_math/train.jsonl   {"problem": "...", "answer": 42} per line

Launch:

  python main.py --config=configs/multiturn.py --workdir=/tmp/vcpo_tool
  python main.py --config=configs/multiturn.py:smoke --workdir=/tmp/tool_smoke   # CPU, tiny random model

Released values (the VCPO paper, arXiv 2602.17616, and its released scripts): P x G = 128 x 16, max prompt / response
4096 / 12288 (the response budget counts policy and tool tokens), k = 2,
rho_on = 0.55, AdamW lr 1e-6, wd 0.1, clip 1.0, constant schedule, sequence TIS
c = 8, temperature 1.0, validation temperature 0.8 / top_p 0.7 / n = 5 (AIME).
Mode: asynchronous, as released: a spawned sampler process builds the tool-use
episodes (its sandbox runs code in `python -I -S` subprocesses) and stays at
most k = 2 versions ahead of the learner. Turn limits, the tool-output budget, steps and cadences are not in the released
table.
"""

import os

from configs import common, released
from configs.gsm8k import _smoke

MODEL_DIR = os.path.expanduser("~/models/Qwen2.5-7B-Instruct")  # local HF checkpoint (download as above)
DATA_PATH = os.path.expanduser("~/data/tool_math/train.jsonl")  # problems with integer answers
EVAL_PATH = os.path.expanduser("~/data/aime25/test.jsonl")  # AIME 2025 (problem, answer)
TEMPLATE = (
  "{problem}\nYou may run Python: write code between <code> and </code>, and its output will be "
  "shown between <output> and </output>. Put your final answer within \\boxed{{}}."
)


def get_config(arg: str | None = None):
  c = common.get_base_config()
  released.released_recipe(c)  # async VCPO, TIS c = 8, AdamW 1e-6, validation at 0.8 / 0.7, bf16 FSDP
  c.steps = 300  # learner steps (not in the released table)
  c.lag.k = 2  # released staleness budget for tool use
  c.task.name = "aime"  # integer answers, graded like AIME (boxed / "answer is")
  c.task.data_path = DATA_PATH  # local parquet/jsonl in the AIME schema (problem, answer)
  c.task.template = TEMPLATE  # states the tool protocol; {problem} is the record's problem
  c.task.prompts_per_step = 128  # P (released)
  c.task.group_size = 16  # G (released)
  c.task.max_prompt_len = 4096  # released max prompt length
  c.task.max_new_tokens = 12288  # released max response length (policy + tool tokens)
  c.task.multiturn.enabled = True  # rollouts are tool-use episodes
  c.task.multiturn.max_turns = 8  # model turns per episode (not in the released table)
  c.task.multiturn.max_turn_tokens = 4096  # token budget of one model turn
  c.task.multiturn.max_tool_output_tokens = 512  # tool observation budget per call
  c.task.multiturn.code_open = "<code>"  # the model opens code with this tag (as TEMPLATE says)
  c.task.multiturn.code_close = "</code>"  # ... and closes it with this one
  c.task.multiturn.output_open = "<output>"  # tool output arrives between these tags
  c.task.multiturn.output_close = "</output>"  # ... as tool tokens (not in the loss)
  c.task.multiturn.sandbox_cpu_seconds = 5  # CPU-time limit of one execution
  c.task.multiturn.sandbox_wall_seconds = 10.0  # wall-clock limit of one execution
  c.task.multiturn.max_workers = 0  # parallel executions (0 = CPU count)
  c.model.checkpoint = MODEL_DIR  # Qwen2.5-7B (local directory with config.json + safetensors)
  c.learner.microbatch_size = 64  # rows per exact micro-batch (whole groups); see benchmarks/memory.py
  # "auto" takes 2 here: one pass would keep ~89 GiB of (A, D) per device on 64 devices (grad_norms.one_pass_bytes,
  # 28 layers x 16384 tokens, against one_pass_budget_gib = 24); two keep one layer's at a time
  c.learner.ghost_passes = "auto"  # one ghost backward while its (A, D) fit one_pass_budget_gib per device, else two
  released.qwen2_shape(c, "Qwen2.5-7B")  # the Instruct model's architecture (config.json), for sizing without weights
  # The sampler process's mesh: 4-way tensor parallel (weights / 4), the rows over the rest. On 64 devices
  # (16, 1, 4) the 2048-row prefill / decode compile to 44.0 / 41.1 GiB per device, (64, 1, 1) to 54.2 / 51.7
  # (docs/results/benchmarks_history.md, "Sampler prefill at full depth"); max_batch = 1024 gives 23.8 / 22.3 in 2 calls.
  # One sampler process with 4 chips and 128 rows: 44.4 / 41.1; on 2 chips per worker use (-1, 1, 2): 47.5 / 44.6.
  c.sampler.mesh_shape = (-1, 1, 4)  # (data, fsdp, tensor) of the async sampler: tensor 4 = the 4 KV heads
  c.sampler.max_batch = 0  # rows per sampler call: all 2048 in one (fits 64 devices on this mesh); 1024 halves it
  c.method.lr.rho_on = 0.55  # released for the long multi-turn task (protocol undocumented)
  c.eval.every = 10  # evaluation cadence in learner steps (not in the released table)
  c.eval.dataset = "aime"  # AIME, evaluated with tool use
  c.eval.data_path = EVAL_PATH  # local parquet/jsonl in the AIME schema
  c.eval.num_problems = 30  # one AIME year (the loader caps at the file's size)
  c.eval.n = 5  # released samples per AIME problem (mean@5)
  c.checkpoint.every = 25  # save cadence in learner steps
  if arg == "smoke":  # tiny random model, shipped AIME fixture, a couple of lag steps on CPU (tests)
    _smoke(c)
    c.mode = "lag"  # exact staleness in one process (tests also run it with mode="async")
    c.lag.k = 1  # one step stale
    c.sampler.mesh_shape = (-1, 1, 1)  # mode=async on CPU: the sampler's one device (no tensor axis of 4)
    c.task.max_prompt_len = 240  # longest fixture prompt with TEMPLATE (chars = tokens)
    c.task.max_new_tokens = 24  # response budget: policy + tool tokens
    c.task.multiturn.max_turns = 3  # up to two tool calls
    c.task.multiturn.max_turn_tokens = 8  # short turns: several rounds fit the budget
    c.task.multiturn.max_tool_output_tokens = 8  # tool observation budget per call
    c.task.multiturn.sandbox_cpu_seconds = 1  # CPU-time limit of one execution
    c.task.multiturn.sandbox_wall_seconds = 3.0  # wall-clock limit of one execution
    c.task.multiturn.max_workers = 2  # parallel executions
  elif arg:
    raise ValueError(f"configs/multiturn.py: unknown variant {arg!r}; use '' or 'smoke'.")
  return c
