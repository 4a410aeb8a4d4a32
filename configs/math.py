"""MATH with Qwen2.5-7B: the released VCPO setting (32 prompts x 16, 1024/2048 tokens, k = 10).

Needs a local Hugging Face checkpoint and the MATH training set (nothing is
fetched at run time):

  huggingface-cli download Qwen/Qwen2.5-7B --local-dir ~/models/Qwen2.5-7B
  # MATH train (hendrycks schema: problem, solution with \\boxed{...}) as one file:
  #   ~/data/math/train.jsonl   (parquet works too: --config.task.data_path=...parquet)

Launch:

  python main.py --config=configs/math.py --workdir=/tmp/vcpo_math --config.async_.sampler_devices=4,5,6,7
  python main.py --config=configs/math.py --workdir=/tmp/math_k64 --config.mode=lag --config.lag.k=64  # stress
  python main.py --config=configs/math.py --workdir=/tmp/math_sync --config.mode=sync --config.lag.k=0 \\
      --config.method=sync                                                         # synchronous baseline
  python main.py --config=configs/math.py:smoke --workdir=/tmp/math_smoke   # CPU, tiny random model
  python main.py --config=configs/math.py:qwen3_8b --workdir=/tmp/math_qwen3  # Qwen3-8B (Base) instead
  python main.py --config=configs/math.py:qwen3_30b_a3b --workdir=/tmp/math_moe  # Qwen3-30B-A3B (MoE), R3 replay

Released values (the VCPO paper, arXiv 2602.17616, and its released scripts): P x G = 32 x 16, max prompt / response
1024 / 2048, k = 10 (stress runs 16..128: use mode=lag), rho_on = 1.0, AdamW lr
1e-6, wd 0.1, clip 1.0, constant schedule, sequence TIS c = 8, temperature 1.0,
validation temperature 0.8 / top_p 0.7 / n = 3 (MATH-500), asynchronous.
Steps, cadences and mesh are not in the released table.
"""

import os

from configs import common, released
from configs.gsm8k import _smoke

MODEL_DIR = os.path.expanduser("~/models/Qwen2.5-7B")  # local HF checkpoint (download as above)
QWEN3_8B_DIR = os.path.expanduser("~/models/Qwen3-8B-Base")  # huggingface-cli download Qwen/Qwen3-8B-Base
QWEN3_30B_A3B_DIR = os.path.expanduser(
  "~/models/Qwen3-30B-A3B-Base"
)  # huggingface-cli download Qwen/Qwen3-30B-A3B-Base
DATA_PATH = os.path.expanduser("~/data/math/train.jsonl")  # MATH train split (problem, solution)
EVAL_PATH = os.path.expanduser("~/data/math500/test.jsonl")  # MATH-500 (problem, answer)


def get_config(arg: str | None = None):
  c = common.get_base_config()
  released.released_recipe(c)  # async VCPO, TIS c = 8, AdamW 1e-6, validation at 0.8 / 0.7, bf16 FSDP
  c.steps = 400  # learner steps (not in the released table)
  c.lag.k = 10  # released staleness budget for MATH (stress: 16..128 with mode=lag)
  c.task.name = "math"  # reference = last \boxed{} of the solution; math-verify equivalence
  c.task.data_path = DATA_PATH  # local parquet/jsonl in the MATH schema
  c.task.template = ""  # the task default: "... put your final answer within \boxed{}"
  c.task.prompts_per_step = 32  # P (released)
  c.task.group_size = 16  # G (released)
  c.task.max_prompt_len = 1024  # released max prompt length
  c.task.max_new_tokens = 2048  # released max response length
  c.model.checkpoint = MODEL_DIR  # Qwen2.5-7B (local directory with config.json + safetensors)
  c.learner.microbatch_size = 64  # rows per exact micro-batch (whole groups); see benchmarks/memory.py
  # 9.3 GiB per device on 64 chips against 50.4 for one pass with the scanned layers, whose one-pass (A, D)
  # estimate ("auto") is far below what XLA keeps (benchmarks/README.md)
  c.learner.ghost_passes = 2  # two ghost backward passes: the norms layer by layer
  released.qwen2_shape(c, "Qwen2.5-7B")  # its architecture (config.json), for sizing without weights
  c.method.lr.rho_on = 1.0  # ESS ratio at which the lr is not scaled (released for MATH)
  c.eval.every = 20  # evaluation cadence in learner steps (not in the released table)
  c.eval.dataset = "math500"  # MATH-500 held-out set
  c.eval.data_path = EVAL_PATH  # local parquet/jsonl in the MATH-500 schema
  c.eval.num_problems = 500  # MATH-500 size (the loader caps at the file's size)
  c.eval.n = 3  # released samples per validation problem (mean@3)
  c.checkpoint.every = 50  # save cadence in learner steps
  if arg == "qwen3_8b":  # the same recipe on Qwen3-8B: q/k norms, no q/k/v bias, 36 layers, GQA 32/8
    _qwen3_8b(c)
  elif arg == "qwen3_30b_a3b":  # the same recipe on Qwen3-30B-A3B: 48 MoE layers, 128 experts, 8 per token
    _qwen3_30b_a3b(c)
  elif arg == "smoke":  # tiny random model, shipped fixture, a few lag steps on CPU (tests)
    _smoke(c)
    c.mode = "lag"  # exact staleness in one process
    c.lag.k = 1  # one step stale
  elif arg:
    raise ValueError(f"configs/math.py: unknown variant {arg!r}; use '', 'qwen3_8b', 'qwen3_30b_a3b' or 'smoke'.")
  return c


def _qwen3_8b(c):
  """Qwen/Qwen3-8B-Base: the values of its config.json (default RoPE, theta 1e6, 40960 positions)."""
  c.model.checkpoint = QWEN3_8B_DIR  # local directory with config.json + safetensors
  s = c.model.shape
  s.vocab_size = 151936  # config.json vocab_size
  s.hidden_size = 4096  # hidden_size (D)
  s.intermediate_size = 12288  # intermediate_size (F)
  s.num_layers = 36  # num_hidden_layers
  s.num_heads = 32  # num_attention_heads
  s.num_kv_heads = 8  # num_key_value_heads
  s.head_dim = 128  # head_dim (= D / heads here; free in Qwen3)
  s.rope_theta = 1000000.0  # rope_theta (rope_scaling null)
  s.rms_eps = 1e-6  # rms_norm_eps
  s.tie_embeddings = False  # tie_word_embeddings
  s.qkv_bias = False  # Qwen3: no q/k/v bias
  s.model_type = "qwen3"  # model_type
  s.qk_norm = True  # q_norm / k_norm: per-head RMSNorm over head_dim before RoPE
  # Its KV cache is 2.6x Qwen2.5-7B's per token (36 layers x 8 kv heads vs 28 x 4): the 4 sampler chips split
  # the kv heads (tensor 4) and take 128 rows per call (benchmarks/memory.py --configs=math:qwen3_8b).
  c.sampler.mesh_shape = (-1, 1, 4)  # (data, fsdp, tensor) of the async sampler over its 4 devices
  c.sampler.max_batch = 128  # rows per sampler call (8 groups of 16); 512 rows run as 4 calls


def _qwen3_30b_a3b(c):
  """Qwen/Qwen3-30B-A3B-Base: the values of its config.json; the learner replays the sampler's expert routing."""
  c.model.checkpoint = QWEN3_30B_A3B_DIR  # local directory with config.json + safetensors
  c.model.routing_replay = True  # R3: the learner routes each response token through the sampler's experts
  s = c.model.shape
  s.vocab_size = 151936  # config.json vocab_size
  s.hidden_size = 2048  # hidden_size (D)
  s.intermediate_size = 6144  # intermediate_size (a dense MLP's F; every layer is sparse here)
  s.num_layers = 48  # num_hidden_layers
  s.num_heads = 32  # num_attention_heads
  s.num_kv_heads = 4  # num_key_value_heads
  s.head_dim = 128  # head_dim
  s.rope_theta = 1000000.0  # rope_theta
  s.rms_eps = 1e-6  # rms_norm_eps
  s.tie_embeddings = False  # tie_word_embeddings
  s.qkv_bias = False  # Qwen3: no q/k/v bias
  s.qk_norm = True  # q_norm / k_norm
  s.model_type = "qwen3_moe"  # model_type
  s.num_experts = 128  # num_experts (E)
  s.num_experts_per_tok = 8  # num_experts_per_tok (K)
  s.moe_intermediate_size = 768  # moe_intermediate_size (each expert's F)
  s.norm_topk_prob = True  # norm_topk_prob
  # Sampler: bf16 weights are 61 GB; its 4 chips split the kv heads and the experts (tensor 4), 128 rows per call.
  c.sampler.mesh_shape = (-1, 1, 4)  # (data, fsdp, tensor) of the async sampler over its 4 devices
  c.sampler.max_batch = 128  # rows per sampler call
