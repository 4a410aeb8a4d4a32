"""GSM8K with Qwen2-1.5B: the released VCPO setting (8 prompts x 8, 2048/2048 tokens, k = 12).

Needs a local Hugging Face checkpoint and the GSM8K parquet files (nothing is
fetched at run time):

  huggingface-cli download Qwen/Qwen2-1.5B --local-dir ~/models/Qwen2-1.5B
  huggingface-cli download openai/gsm8k --repo-type dataset --local-dir ~/data/gsm8k
    # -> ~/data/gsm8k/main/train-00000-of-00001.parquet (question, answer with "#### N")

Launch (one accelerator host; the sampler process gets its own devices):

  python main.py --config=configs/gsm8k.py --workdir=/tmp/vcpo_gsm8k \\
      --config.async_.sampler_devices=1
  python main.py --config=configs/gsm8k.py --workdir=/tmp/gsm8k_k12_lag --config.mode=lag   # exact lag
  python main.py --config=configs/gsm8k.py:smoke --workdir=/tmp/gsm8k_smoke   # CPU, tiny random model
  # other paths: --config.model.checkpoint=/path/Qwen2-1.5B --config.task.data_path=/path/train.parquet

Released values (the VCPO paper, arXiv 2602.17616, and its released scripts): P x G = 8 x 8,
max prompt / response 2048 / 2048, k = 12, rho_on = 1.0, AdamW lr 1e-6, wd 0.1,
clip 1.0, constant schedule, sequence TIS c = 8, sampling temperature 1.0,
validation temperature 0.8 / top_p 0.7 / n = 3, asynchronous. The number of
steps, the eval / checkpoint cadence and the mesh are not in the released table.
"""

import os

from configs import common, released

MODEL_DIR = os.path.expanduser("~/models/Qwen2-1.5B")  # local HF checkpoint (download as above)
DATA_PATH = os.path.expanduser("~/data/gsm8k/main/train-00000-of-00001.parquet")  # GSM8K train split
EVAL_PATH = os.path.expanduser("~/data/gsm8k/main/test-00000-of-00001.parquet")  # GSM8K test split


def get_config(arg: str | None = None):
  c = common.get_base_config()
  released.released_recipe(c)  # async VCPO, TIS c = 8, AdamW 1e-6, validation at 0.8 / 0.7, bf16 FSDP
  c.steps = 500  # learner steps (not in the released table)
  c.lag.k = 12  # released staleness budget for GSM8K
  c.task.name = "gsm8k"  # scored on the "#### N" answer (boxed / "answer is" as fallbacks)
  c.task.data_path = DATA_PATH  # local parquet/jsonl in the GSM8K schema
  c.task.template = ""  # the task default: "... output the final answer after ####"
  c.task.prompts_per_step = 8  # P (released)
  c.task.group_size = 8  # G (released)
  c.task.max_prompt_len = 2048  # released max prompt length
  c.task.max_new_tokens = 2048  # released max response length
  c.model.checkpoint = MODEL_DIR  # Qwen2-1.5B (local directory with config.json + safetensors)
  c.learner.microbatch_size = 16  # rows per exact micro-batch (whole groups); see benchmarks/memory.py
  c.learner.ghost_passes = "auto"  # one ghost backward while its (A, D) fit one_pass_budget_gib per device, else two
  released.qwen2_shape(c, "Qwen2-1.5B")  # its architecture (config.json), for sizing without weights
  c.method.lr.rho_on = 1.0  # ESS ratio at which the lr is not scaled (released for GSM8K)
  c.eval.every = 20  # evaluation cadence in learner steps (not in the released table)
  c.eval.dataset = "gsm8k"  # held-out GSM8K test split
  c.eval.data_path = EVAL_PATH  # local parquet/jsonl of the test split
  c.eval.num_problems = 1319  # the GSM8K test split size (the loader caps at the file's size)
  c.eval.n = 3  # released samples per validation problem (mean@3)
  c.checkpoint.every = 50  # save cadence in learner steps
  if arg == "smoke":  # tiny random model, shipped fixture, a few sync steps on CPU (tests)
    _smoke(c)
  elif arg:
    raise ValueError(f"configs/gsm8k.py: unknown variant {arg!r}; use '' or 'smoke'.")
  return c


def _smoke(c):
  """Shrinks a released config to seconds on CPU; shared by math.py and multiturn.py."""
  c.steps = 2  # a couple of learner steps
  c.mode = "sync"  # one process, k = 0
  c.lag.k = 0  # sync samples with the current policy
  c.model.checkpoint = ""  # random init of model.preset ...
  c.model.preset = "tiny_qwen2"  # ... with the built-in char tokenizer
  c.model.dtype = "float32"  # CPU compute dtype
  c.model.attention, c.model.remat = "dense", "none"  # tiny CPU model: the reference kernels
  c.learner.microbatch_size = 0  # one pass
  c.task.data_path = ""  # the shipped 22-problem fixture
  c.eval.data_path = ""  # the eval data set's shipped fixture
  c.task.chat_template = False  # plain prompts (no chat specials)
  c.task.prompts_per_step = 2  # P
  c.task.group_size = 4  # G
  c.task.max_prompt_len = 200  # longest fixture prompt (chars = tokens) with the default template
  c.task.max_new_tokens = 16  # response budget
  c.optim.lr = 1e-4  # large enough to move a random model in 2 steps
  c.eval.every = 0  # start and end only
  c.eval.num_problems = 2  # a tiny evaluation at start and end
  c.eval.n = 1  # one sample per problem
  c.checkpoint.every = 1  # exercise saving
  c.mesh.shape = (-1, 1, 1)  # data parallel over whatever devices there are
  c.log.progress = False  # quiet in tests
  c.log.plots = False  # no PNGs in tests
  c.log.norm_overhead_every = 0  # no extra timing compile in tests
