"""Defaults shared by every config; each experiment config overrides what it needs.

Every field carries a one-line comment; `python main.py --config=FILE --config_help`
prints them with that config's values (`field_comments` reads them from this
file, then from the experiment file). The `c.vcpo` block is generated from
`dataclasses.fields(estimator.PGConfig)`, so every estimator field can be set
from the command line; its placeholders (None) mean "use the method preset's
value", e.g. `--config.vcpo.ess_lr=False`.
"""

import ast
import dataclasses
import inspect
import io
import os
import tokenize
import typing

import ml_collections
from ml_collections import config_dict

from vcpo_jax import estimator


def _untyped(value):
  """A field that takes values of several types (ml_collections otherwise locks a field to its first type)."""
  return ml_collections.FieldReference(value, field_type=object)


def get_base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # master seed: model init, problem order, sampling (fold_in(key, step))
  c.steps = 100  # learner steps (optimizer updates)
  c.mode = "sync"  # "sync" (k = 0) | "lag" (exact staleness k, one process) | "async" (sampler process)
  # estimator.PRESETS name: sync none seq_tis clip mask token_tis geo_mask vcpo vcpo_* | policy losses:
  # ppo_clip decoupled_ppo gspo cispo m2po_paper m2po_released icepop dppo_tv ipo kpop | vcpo_tis_ess (ESS-targeted cap)
  c.method = "vcpo"  # estimator preset (estimator.PRESETS): vcpo, seq_tis, ppo_clip, gspo, vcpo_tis_ess, ...

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
  c.model.attention = "dense"  # kernel: dense (reference) | xla | chunked (no [B,H,T,T]) | cudnn | splash
  c.model.attention_chunk = 512  # query chunk of "chunked", key block of the cached decode attention (tokens)
  c.model.remat = "none"  # per-block rematerialization: none | block | a jax.checkpoint_policies name
  c.model.logprob_chunk = 512  # positions per chunk of the log-prob head (0 = all at once: [N, T, V] logits)
  c.model.logprob_vocab_chunk = 0  # vocabulary entries per head chunk (0 = whole vocabulary)
  c.model.lora_rank = 0  # LoRA adapters' rank r (0 = off: full fine-tuning); > 0 freezes the base
  c.model.lora_alpha = 16.0  # LoRA alpha: the adapter path is scaled by alpha / r
  c.model.lora_targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # projections with adapters
  c.model.tokenizer = ""  # tokenizer directory ("" = checkpoint dir, or the built-in char tokenizer)

  c.sampler = ml_collections.ConfigDict()
  c.sampler.temperature = 1.0  # training rollouts (released runs: 1.0)
  c.sampler.top_p = 1.0  # 1.0 = off (keeps behavior log-probs equal to the policy's)
  c.sampler.top_k = 0  # 0 = off
  c.sampler.draw = "inverse_cdf"  # token draw: inverse_cdf (2 uniforms/row) | gumbel (earlier runs' stream per seed)
  c.sampler.param_dtype = "auto"  # sampler weights: auto (bf16 on accelerators, as given on CPU) | float32 | bfloat16
  c.sampler.mesh_shape = (-1, 1, 1)  # async sampler's (data, fsdp, tensor) mesh over its devices (sync/lag: learner's)
  c.sampler.prefill_chunk = 0  # prompt tokens per prefill pass; 0 = one pass (bounds prefill memory at long prompts)
  c.sampler.max_batch = 0  # rows per sampler call (whole groups); 0 = all; more rows run as sequential calls

  c.vcpo = vcpo_overrides()  # overrides of the method preset: one None placeholder per estimator.PGConfig field

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1e-6  # base learning rate eta (AdamW)
  c.optim.weight_decay = 0.1  # decoupled AdamW decay (released runs: 0.1)
  c.optim.clip_norm = 1.0  # global-norm clip before AdamW
  c.optim.b1 = 0.9  # Adam first-moment decay, in [0, 1)
  c.optim.b2 = 0.999  # Adam second-moment decay, in [0, 1)
  c.optim.schedule = "constant"  # optim.SCHEDULES: constant | warmup_cosine (decay to 0 over the run; warm-up 0 steps)

  c.learner = ml_collections.ConfigDict()
  c.learner.grad_path = "ghost"  # ghost (fast exact norms) | vmap (reference path)
  # ghost backward passes: 1 (all layers' (A, D) kept) | 2 (norms block by block, long T) | "auto": 1 while what one
  # pass keeps alive (grad_norms.one_pass_bytes, per device and micro-batch) fits learner.one_pass_budget_gib (default 24), else 2
  c.learner.ghost_passes = _untyped(1)  # int 1 | 2, or the str "auto"
  c.learner.microbatch_size = 0  # rows per micro-batch, whole groups (a multiple of task.group_size); 0: one pass
  c.learner.ppo_epochs = 1  # passes over each batch per step (policy-loss methods only; 1: one update per step)
  c.learner.minibatches = 1  # updates per pass, each on whole groups; pi_old is recomputed once per trainer step
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
  c.async_.background_publish = _untyped(
    "auto"
  )  # "true"/True: copy in a thread | "false": learner's path | auto: CPU false
  c.async_.publish_path = "shm"  # shm: process, shm slot | device: thread, device_put | transfer: process, pull
  c.async_.publish_dtype = "auto"  # slot dtype of floating params: "auto" (bf16 on accelerators, f32 on CPU)
  c.async_.publish_buffers = 1  # parameter copies in the shm slot: 1 | 2 | 0 = 1 with background publish, else 2
  c.async_.publish_checksum = "true"  # shm slot checksum, echoed + checked: true | false | background (thread only)
  c.async_.decode = "static"  # sampler process: static (one device loop) | chunked | refill (continuous batching)
  c.async_.chunk_tokens = 16  # decode steps per jitted chunk ("chunked" / "refill" / in-flight updates)
  c.async_.inflight_updates = False  # switch to newer params between decode chunks; per-token versions
  c.async_.update_every_tokens = 16  # in-flight: check the parameter slot every this many decode steps
  c.async_.recompute_kv = False  # in-flight: recompute the KV cache under the new params (False: keep it)
  c.async_.max_sampler_restarts = 3  # a dead sampler, or one with no batch in timeout_s, is replaced this often
  c.async_.restart_window_s = 3600.0  # ... per this many seconds; one more failure checkpoints and exits 1
  c.async_.heartbeat_timeout_s = 0.0  # a sampler whose heartbeat stops this long is hung, replaced; 0 = timeout_s
  c.async_.peer_lost_s = 30.0  # multi-host: a learner process silent (no heartbeat) this long is lost; the others exit

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
  c.eval.background = False  # mode=async: the sampler process evaluates, tagged with the version; no learner stop

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 50  # save every this many steps (and at the end / on SIGTERM)
  c.checkpoint.keep_last = 2  # newest checkpoints kept (plus keep_best)
  c.checkpoint.keep_best = 1  # ranked by eval accuracy

  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 0  # supervised warm start on solver solutions (0 = off); cached per config
  c.sft.lr = 3e-3  # warm-start AdamW peak rate (warmup-cosine)
  c.sft.batch_size = 64  # warm-start examples per step
  c.sft.noise = 0.0  # fraction of warm-start targets replaced by a well-formed wrong answer (a noisy demonstrator)
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
  c.log.norm_overhead_every = 0  # opt-in (0 = off): time a plain gradient step every N steps (time/norm_overhead)
  c.log.ref_grad_every = 0  # opt-in (0 = off; sync / lag): grad/ref_cosine to a fresh on-policy batch every N steps
  return c


# ----------------------------------------------------------------------------- the generated c.vcpo block

# One line per PGConfig field for --config_help. A field missing here (e.g. one just added to PGConfig)
# falls back to the comment on its line in PGConfig; tests/test_configs.py fails if neither exists.
VCPO_COMMENTS = {
  "advantage": "base estimator",
  "is_variant": "importance-weight variant",
  "tis_c": "upper truncation c (8 in released runs)",
  "clip_lower": '"clip": lower end a of the interval [a, b]',
  "clip_upper": '"clip": upper end b',
  "mask_lower": '"mask": weights below this are masked (weight 0)',
  "mask_upper": '"mask": weights above this are masked',
  "token_tis_c": '"token_tis": per-token truncation level',
  "geo_lower": '"geo_mask": rows whose exp(l / L) is below this are masked',
  "geo_upper": '"geo_mask": rows whose exp(l / L) is above this are masked',
  "log_ratio_clamp": "c of the applied weights exp(clamp(l, -c, c))",
  "loss_agg": "loss aggregation",
  "opob": "off-policy optimal baseline on/off",
  "opob_weights": "OPOB weights: unclipped (paper) or applied (review #1)",
  "opob_leave_one_out": "unbiased leave-one-out baseline",
  "opob_scope": "OPOB over a prompt's group (raw rewards) or the minibatch (advantages)",
  "length_normalize_norms": "OPOB weights use ||s_i||^2 / L_i^2 (token-mean score)",
  "reference_mode": "reproduce the reference's two inconsistencies",
  "std": 'group std of "grpo"',
  "std_eps": "groups with std <= std_eps contribute nothing",
  "ess_lr": "ESS-scaled learning rate on/off",
  "ess_rule": "ESS learning-rate rule",
  "rho_on": "on-policy reference ESS ratio",
}
# Fields chosen by name from an estimator registry: --config_help lists the registry's current names.
VCPO_CHOICES = {
  "advantage": "ADVANTAGE_ESTIMATORS",
  "is_variant": "WEIGHT_VARIANTS",
  "loss_agg": "LOSS_AGGREGATIONS",
  "mask_normalizer": "MASK_NORMALIZERS",
  "opob_weights": "OPOB_WEIGHTS",
  "opob_scope": "OPOB_SCOPES",
  "std": "STD_KINDS",
  "ess_rule": "ESS_LR_RULES",
}


def vcpo_overrides() -> ml_collections.ConfigDict:
  """c.vcpo: one None placeholder (= the preset's value) per estimator.PGConfig field, typed like it."""
  hints = typing.get_type_hints(estimator.PGConfig)
  v = ml_collections.ConfigDict()
  for f in dataclasses.fields(estimator.PGConfig):
    args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]  # `float | None` -> float
    v[f.name] = config_dict.placeholder(args[0] if args else hints[f.name])
  return v


def vcpo_comments() -> dict[str, str]:
  """{PGConfig field: one-line comment}: VCPO_COMMENTS, else the comment on the field's line in PGConfig,
  followed by the registry's names for a field chosen by name (VCPO_CHOICES)."""
  source = inspect.getsource(estimator.PGConfig)
  comments = _line_comments(source)
  own = {
    node.target.id: comments.get(node.end_lineno, "")
    for node in ast.parse(source).body[0].body
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
  }
  out = {}
  for f in dataclasses.fields(estimator.PGConfig):
    text = VCPO_COMMENTS.get(f.name) or own.get(f.name, "")
    choices = list(getattr(estimator, VCPO_CHOICES.get(f.name, ""), None) or ())
    if choices and not all(c in text for c in choices):
      text = f"{text}: {' | '.join(choices)}" if text else " | ".join(choices)
    out[f.name] = text
  return out


# ----------------------------------------------------------------------------- --config_help


def _line_comments(source: str) -> dict[int, str]:
  """{line number: text of the comment on that line}."""
  toks = tokenize.generate_tokens(io.StringIO(source).readline)
  return {t.start[0]: t.string.lstrip("#").strip() for t in toks if t.type == tokenize.COMMENT}


def _assignment_comments(path: str) -> dict[str, str]:
  """{"task.name": comment} for every `c.task.name = ...  # comment` statement of a config file."""
  with open(path) as f:
    source = f.read()
  comments = _line_comments(source)
  out: dict[str, str] = {}
  for node in sorted((n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
    text = comments.get(node.end_lineno) or comments.get(node.lineno)
    for target in node.targets:
      parts = []
      while isinstance(target, ast.Attribute):
        parts.append(target.attr)
        target = target.value
      if parts and isinstance(target, ast.Name) and target.id == "c" and text:
        out.setdefault(".".join(reversed(parts)), text)  # the first comment of a field (its main path) wins
  return out


def field_comments(config_file: str | None = None) -> dict[str, str]:
  """{dotted field: one-line comment}: this file's (what a field is), then config_file's (the fields it adds)."""
  out = {f"vcpo.{k}": v for k, v in vcpo_comments().items()}
  out.update(_assignment_comments(__file__))
  if config_file:
    for k, v in _assignment_comments(config_file).items():
      out.setdefault(k, v)
  return out


def leaves(c: ml_collections.ConfigDict, prefix: str = ""):
  """(dotted path, value, type name) of every field, sorted by name (ConfigDict order); an empty sub-dict is one."""
  for k, v in c.items(preserve_field_references=False):
    if isinstance(v, ml_collections.ConfigDict) and len(v):
      yield from leaves(v, f"{prefix}{k}.")
    else:
      t = "dict" if isinstance(v, ml_collections.ConfigDict) else getattr(c.get_type(k), "__name__", "?")
      yield f"{prefix}{k}", (v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v), t


def help_text(c: ml_collections.ConfigDict, config_file: str | None = None) -> str:
  """Every field of `c` with its value and one-line comment (what `python main.py --config_help` prints).

  A `vcpo.*` placeholder (None: the method preset's value) shows the value in effect, e.g.
  `vcpo.tis_c: float = None -> 8.0 (preset 'vcpo')`."""
  comments = field_comments(config_file)
  method = c.get("method")
  preset = estimator.pg_config_from_preset(method) if method in estimator.PRESETS else None
  lines = [f"Fields of {config_file or os.path.relpath(__file__)} (set with --config.FIELD=VALUE; None = preset):"]
  for path, value, type_name in leaves(c):
    shown = repr(value)
    if preset is not None and value is None and path.startswith("vcpo.") and hasattr(preset, path[5:]):
      shown = f"None -> {getattr(preset, path[5:])!r} (preset {method!r})"
    lines.append(f"  {path}: {type_name} = {shown}  # {comments.get(path, '(no comment)')}")
  return "\n".join(lines)
