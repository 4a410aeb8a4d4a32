"""Defaults shared by every config; each experiment config overrides what it needs.

Fields left as placeholders (None) mean "use the method preset's value"; set
them to override, e.g. `--config.vcpo.ess_lr=False`.
"""

import ml_collections
from ml_collections import config_dict


def get_base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # master seed: model init, problem order, sampling (fold_in(key, step))
  c.steps = 100  # learner steps (optimizer updates)
  c.mode = "sync"  # "sync" (k = 0) | "lag" (exact staleness k, one process) | "async" (sampler process)
  c.method = "vcpo"  # estimator preset: sync none seq_tis clip mask token_tis geo_mask vcpo vcpo_*

  c.task = ml_collections.ConfigDict()
  c.task.name = "countdown"  # vcpo_jax.tasks.TASKS name
  c.task.template = ""  # prompt template ("" = the task's default)
  c.task.gen = ml_collections.ConfigDict()  # generator knobs of countdown/arithmetic (task-specific)
  c.task.prompts_per_step = 8  # P prompts per learner step
  c.task.group_size = 8  # G responses per prompt (N = P * G)
  c.task.max_prompt_len = 64  # prompt bucket in tokens
  c.task.max_new_tokens = 32  # response budget in tokens
  c.task.chat_template = False  # wrap prompts with the tokenizer's chat template
  c.task.num_train_problems = 4096  # generated / loaded training pool size
  c.task.data_path = ""  # local parquet/jsonl for gsm8k/math/aime ("" = shipped fixtures)
  c.task.multiturn = ml_collections.ConfigDict()  # tool-use episodes (vcpo_jax/rollout/multiturn.py)
  c.task.multiturn.enabled = False  # True: rollouts are multi-turn tool-use episodes (code runs in the sandbox)
  c.task.multiturn.max_turns = 4  # model turns per episode (at most max_turns - 1 tool calls)
  c.task.multiturn.max_turn_tokens = 512  # token budget of one model turn (task.max_new_tokens = whole response)
  c.task.multiturn.max_tool_output_tokens = 256  # tool observation budget per call (head kept, rest cut)
  c.task.multiturn.code_open = "<code>"  # the model opens a code block with this tag
  c.task.multiturn.code_close = "</code>"  # ... and closes it with this one (its last token is a stop id)
  c.task.multiturn.output_open = "<output>"  # tool output is wrapped in these tags (tool tokens, not in the loss)
  c.task.multiturn.output_close = "</output>"  # the tool output closes with this tag
  c.task.multiturn.sandbox_cpu_seconds = 2  # CPU-time limit of one execution
  c.task.multiturn.sandbox_wall_seconds = 5.0  # wall-clock limit of one execution
  c.task.multiturn.max_workers = 0  # parallel sandbox executions (0 = CPU count)

  c.model = ml_collections.ConfigDict()
  c.model.checkpoint = ""  # local Hugging Face directory ("" = random init of model.preset)
  c.model.preset = "tiny_qwen2"  # vcpo_jax.model.config.PRESETS name when no checkpoint
  c.model.hidden_size = config_dict.placeholder(int)  # preset overrides (None = preset value)
  c.model.num_layers = config_dict.placeholder(int)  # transformer blocks (None = preset value)
  c.model.intermediate_size = config_dict.placeholder(int)  # SwiGLU width (None = preset value)
  c.model.dtype = "float32"  # compute dtype: float32 | bfloat16
  c.model.tokenizer = ""  # tokenizer directory ("" = checkpoint dir, or the built-in char tokenizer)

  c.sampler = ml_collections.ConfigDict()
  c.sampler.temperature = 1.0  # training rollouts (released runs: 1.0)
  c.sampler.top_p = 1.0  # 1.0 = off (keeps behavior log-probs equal to the policy's)
  c.sampler.top_k = 0  # 0 = off

  c.vcpo = ml_collections.ConfigDict()  # overrides of the method preset (estimator.PGConfig fields)
  c.vcpo.advantage = config_dict.placeholder(str)  # reinforce | rloo | grpo | drgrpo
  c.vcpo.is_variant = config_dict.placeholder(str)  # none | is | tis | clip | mask | token_tis | geo_mask
  c.vcpo.tis_c = config_dict.placeholder(float)  # upper truncation c (8 in released runs)
  c.vcpo.clip_lower = config_dict.placeholder(float)  # "clip": lower end a of the interval [a, b]
  c.vcpo.clip_upper = config_dict.placeholder(float)  # "clip": upper end b
  c.vcpo.mask_lower = config_dict.placeholder(float)  # "mask": weights below this are masked (weight 0)
  c.vcpo.mask_upper = config_dict.placeholder(float)  # "mask": weights above this are masked
  c.vcpo.token_tis_c = config_dict.placeholder(float)  # "token_tis": per-token truncation level
  c.vcpo.loss_agg = config_dict.placeholder(str)  # seq-mean-token-mean | token-mean | seq-mean-token-sum
  c.vcpo.opob = config_dict.placeholder(bool)  # off-policy optimal baseline on/off
  c.vcpo.opob_weights = config_dict.placeholder(str)  # unclipped (paper) | applied (review #1)
  c.vcpo.opob_leave_one_out = config_dict.placeholder(bool)  # unbiased leave-one-out baseline
  c.vcpo.length_normalize_norms = config_dict.placeholder(bool)  # OPOB weights use ||s_i||^2 / L_i^2 (token-mean score)
  c.vcpo.reference_mode = config_dict.placeholder(bool)  # reproduce the reference's two inconsistencies
  c.vcpo.ess_lr = config_dict.placeholder(bool)  # ESS-scaled learning rate on/off
  c.vcpo.ess_rule = config_dict.placeholder(str)  # sqrt | linear
  c.vcpo.rho_on = config_dict.placeholder(float)  # on-policy reference ESS ratio

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1e-6  # base learning rate eta (AdamW)
  c.optim.weight_decay = 0.1  # decoupled AdamW decay (released runs: 0.1)
  c.optim.clip_norm = 1.0  # global-norm clip before AdamW
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.schedule = "constant"  # constant | warmup_cosine

  c.learner = ml_collections.ConfigDict()
  c.learner.grad_path = "ghost"  # ghost (fast exact norms) | vmap (reference path)
  c.learner.microbatch_size = 0  # rows per micro-batch, whole groups (a multiple of task.group_size); 0: one pass
  c.learner.on_nonfinite = "skip"  # skip the update and log | abort with the step range

  c.lag = ml_collections.ConfigDict()
  c.lag.k = 0  # staleness in learner steps (lag and async modes)

  c.async_ = ml_collections.ConfigDict()
  c.async_.queue_slots = 4  # shared-memory queue capacity (batches)
  c.async_.sampler_devices = ""  # e.g. "0,1": device ids for the sampler process ("" = same platform default)
  c.async_.timeout_s = 120.0  # a learner wait longer than this (dead sampler) is an error
  c.async_.startup_timeout_s = 600.0  # the first batch (worker start-up + compilation) may take this long
  c.async_.sampler_cpus = ""  # pin the sampler process to these cores, e.g. "1" or "2-3" ("" = no pinning)
  c.async_.sampler_env = ml_collections.ConfigDict()  # extra environment variables of the sampler process

  c.eval = ml_collections.ConfigDict()
  c.eval.dataset = ""  # held-out data set name ("" = the training task), e.g. math500 or aime
  c.eval.data_path = ""  # its local parquet/jsonl ("" = the shipped fixture / the task's own file)
  c.eval.every = 0  # evaluate every this many steps (0 = only at start and end)
  c.eval.num_problems = 64  # evaluation set size (held-out split)
  c.eval.temperature = 0.8  # reference validation protocol
  c.eval.top_p = 0.7  # reference validation nucleus
  c.eval.n = 3  # samples per problem (5 for AIME)
  c.eval.greedy = False  # argmax decoding instead (then n = 1)
  c.eval.pass_at_k = (1,)  # pass@k list

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 50  # save every this many steps (and at the end / on SIGTERM)
  c.checkpoint.keep_last = 2  # newest checkpoints kept (plus keep_best)
  c.checkpoint.keep_best = 1  # ranked by eval accuracy

  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 0  # supervised warm start on solver solutions (0 = off); cached per config
  c.sft.lr = 3e-3  # warm-start AdamW peak rate (warmup-cosine)
  c.sft.batch_size = 64  # warm-start examples per step
  c.sft.cache_dir = ""  # where warm starts are cached ("" = ~/.cache/vcpo_jax/sft)

  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (-1, 1, 1)  # (data, fsdp, tensor); -1 in one slot = all remaining devices

  c.distributed = ml_collections.ConfigDict()
  c.distributed.enabled = False  # call jax.distributed.initialize (multi-host)
  c.distributed.coordinator_address = ""  # host:port of process 0
  c.distributed.num_processes = 1  # processes in the job
  c.distributed.process_id = 0  # this process's index

  c.log = ml_collections.ConfigDict()
  c.log.progress = True  # console progress bar
  c.log.plots = True  # PNG plots at the end of the run
  c.log.norm_overhead_every = 10  # time a plain gradient step every this many steps; logs time/norm_overhead
  return c
