"""A whole exact-lag RL run as one pure, jittable function of (PRNG key, learning rate).

purejaxrl-style: the training loop is a `lax.scan`; sampling, the reward, the
estimator (the SAME library code as the learner: `estimator.pg_coefficients` /
`pg_token_weights` through `learner.policy_gradient("ghost")`) and the
optimizer (`optim.make_optimizer`, ESS-scaled AdamW) all run inside it, so a
grid cell (method, k) compiles once and `vmap`s over seeds and learning rates.

Dimension legend: P prompts, G group size, N = P * G trajectories, T tokens of a
row (prompt Tp + response Tr), V vocab, K = k + 1 ring slots, S steps.

Task ("stride counting", reward computed in JAX). The alphabet is 0..A-1; a
prompt is two tokens [a, A + s - 1]: a start symbol a in [0, A) and a stride
s in [1, M] (its own token, so the model can tell the two apart without
absolute positions). The response y_0..y_{Tr-1} should count from a in steps of
s modulo A; position t is correct iff y_t == (y_{t-1} + s) mod A with
y_{-1} = a (errors do not cascade: each token is judged against its actual
predecessor). reward = fraction of correct positions in [0, 1]; a uniform
policy over the V = A + M tokens scores 1/V on average (chance). "accuracy" is
the mean reward of samples of the CURRENT policy on a fixed evaluation set
(every prompt, eval_samples each, temperature 1); "success" the fraction of
those samples that are entirely correct.

Exact lag (PipelineRL convention, as `rollout.lag.LagSource`): the batch used
at learner step t is sampled with the parameters of version max(0, t - k)
(version v = parameters after v updates). The carry holds a ring buffer of the
last K = k + 1 versions (slot v mod K) together with each slot's version
number; step t writes version t into slot t mod K, then reads slot
max(0, t - k) mod K, which still holds that version because t - (t - k) = k < K.
The version read from the ring is recorded per step (`version`), so tests can
check the lag from the data rather than from the arithmetic.

Metrics returned per step ([S]): reward (training batch, i.e. of the behavior
policy), ess_ratio (unclipped weights), ess_ratio_applied, lr_scale, grad_norm
(global norm of the raw policy gradient, before clipping), update_norm,
frac_clipped, log_ratio_max, version; per evaluation ([S // eval_every]):
accuracy, success, eval_step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vcpo_jax import estimator, grad_norms, learner, optim, score_centering
from vcpo_jax.model import transformer
from vcpo_jax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class PureLagConfig:
  """Static settings of one pure exact-lag run (hashable, jit-static)."""

  alphabet: int = 8  # A: response symbols 0..A-1
  max_stride: int = 4  # M: strides 1..M, prompt token A + s - 1
  resp_len: int = 16  # Tr response tokens
  prompts_per_step: int = 8  # P
  group_size: int = 8  # G
  steps: int = 200  # S learner steps
  eval_every: int = 10  # evaluate the current policy every this many steps (divides steps)
  eval_samples: int = 2  # samples per prompt in the evaluation (every prompt is evaluated)
  hidden: int = 32  # D
  layers: int = 1
  heads: int = 2
  mlp: int = 64
  weight_decay: float = 0.1  # AdamW decoupled decay (released runs: 0.1)
  clip_norm: float = 1.0  # global-norm clip before AdamW (released runs: 1.0)
  grad_path: str = "ghost"  # "ghost" | "reference" (learner.policy_gradient("ghost") / ("vmap"))
  debug_trace: bool = False  # also return every batch and every parameter version (tests only)

  def __post_init__(self):
    for f in (
      "alphabet",
      "max_stride",
      "resp_len",
      "prompts_per_step",
      "group_size",
      "steps",
      "eval_every",
      "eval_samples",
      "hidden",
      "layers",
      "heads",
      "mlp",
    ):
      if int(getattr(self, f)) <= 0:
        raise ValueError(f"PureLagConfig.{f}={getattr(self, f)!r}: must be > 0")
    if self.steps % self.eval_every:
      raise ValueError(f"PureLagConfig.eval_every={self.eval_every}: must divide steps={self.steps}")
    if self.hidden % self.heads:
      raise ValueError(f"PureLagConfig.heads={self.heads}: must divide hidden={self.hidden}")
    if self.grad_path not in ("ghost", "reference"):
      raise ValueError(f"PureLagConfig.grad_path={self.grad_path!r}: choose 'ghost' or 'reference'")

  @property
  def vocab(self) -> int:
    return self.alphabet + self.max_stride

  @property
  def num_prompts(self) -> int:
    """Distinct prompts: A start symbols x M strides."""
    return self.alphabet * self.max_stride

  @property
  def chance(self) -> float:
    """Expected reward of the uniform policy over the vocabulary."""
    return 1.0 / self.vocab

  def model_config(self) -> ModelConfig:
    return ModelConfig(
      vocab_size=self.vocab,
      hidden_size=self.hidden,
      intermediate_size=self.mlp,
      num_layers=self.layers,
      num_heads=self.heads,
      num_kv_heads=self.heads,
      head_dim=self.hidden // self.heads,
      rope_theta=10000.0,
      rms_eps=1e-6,
      qkv_bias=False,
      tie_embeddings=False,
      max_position=64,
      model_type="llama",
    )


# ----------------------------------------------------------------------------- task


def all_prompts(cfg: PureLagConfig) -> jax.Array:
  """[A * M, 2] int32: every prompt [a, A + s - 1]."""
  a = jnp.arange(cfg.alphabet)
  s = jnp.arange(cfg.max_stride)
  aa, ss = jnp.meshgrid(a, s, indexing="ij")
  return jnp.stack([aa.ravel(), cfg.alphabet + ss.ravel()], axis=-1).astype(jnp.int32)


def reward(cfg: PureLagConfig, prompt_n2: jax.Array, resp_nt: jax.Array) -> jax.Array:
  """Fraction of correct positions, [N] float32 in [0, 1] (see module docstring).

  Args:
    prompt_n2: [N, 2] int32 prompts [a, A + s - 1].
    resp_nt: [N, Tr] int32 responses.
  """
  a, s = prompt_n2[:, 0], prompt_n2[:, 1] - cfg.alphabet + 1
  prev = jnp.concatenate([a[:, None], resp_nt[:, :-1]], axis=1)
  want = (prev % cfg.alphabet + s[:, None]) % cfg.alphabet
  return jnp.mean((resp_nt == want).astype(jnp.float32), axis=-1)


# ----------------------------------------------------------------------------- sampling


def sample(graphdef, cfg: PureLagConfig, params, prompt_n2, key):
  """Ancestral sampling at temperature 1 with a KV cache.

  Returns:
    tokens_nt [N, 2 + Tr] int32 (prompt then response) and behavior_logp_nt
    [N, 2 + Tr] float32: log softmax(logits)(y) of each sampled token, 0 on the
    prompt (aligned as `transformer.token_logprobs`).
  """
  n, tp = prompt_n2.shape
  t = tp + cfg.resp_len
  cache = transformer.init_cache(cfg.model_config(), n, t)
  pos = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (n, tp))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((tp, t), bool)), (n, tp, t))
  logits, cache = transformer.forward(graphdef, params, prompt_n2, pos, mask, cache, jnp.int32(0))

  def draw(logits_nv, k):
    logp_nv = jax.nn.log_softmax(logits_nv, axis=-1)
    y = jax.random.categorical(k, logp_nv, axis=-1).astype(jnp.int32)
    return y, jnp.take_along_axis(logp_nv, y[:, None], axis=-1)[:, 0]

  keys = jax.random.split(key, cfg.resp_len)
  y0, lp0 = draw(logits[:, -1], keys[0])

  def body(carry, i):
    cache, prev = carry
    idx = tp + i - 1  # cache slot of the token fed now
    m = jnp.broadcast_to((jnp.arange(t) <= idx)[None, None, :], (n, 1, t))
    lg, cache = transformer.forward(graphdef, params, prev[:, None], jnp.full((n, 1), idx, jnp.int32), m, cache, idx)
    y, lp = draw(lg[:, -1], keys[i])
    return (cache, y), (y, lp)

  _, (ys, lps) = jax.lax.scan(body, (cache, y0), jnp.arange(1, cfg.resp_len))
  resp = jnp.concatenate([y0[:, None], ys.T], axis=1)
  lp = jnp.concatenate([lp0[:, None], lps.T], axis=1)
  tokens = jnp.concatenate([prompt_n2, resp], axis=1)
  behavior = jnp.concatenate([jnp.zeros((n, tp), jnp.float32), lp], axis=1)
  return tokens, behavior


@functools.lru_cache(maxsize=None)
def _graphdef(cfg: PureLagConfig):
  graphdef, _ = transformer.split(transformer.init(cfg.model_config(), 0))
  return graphdef


def init_params(cfg: PureLagConfig, key):
  """Initial parameters as a pure function of a PRNG key (so seeds can be vmapped)."""
  graphdef, params = transformer.split(transformer.init(cfg.model_config(), 0))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  # Same init as the model (normal(0.02) kernels, unit norm scales), but drawn from `key`.
  new = [
    jnp.ones_like(x) if x.ndim == 1 else 0.02 * jax.random.normal(kk, x.shape, x.dtype) for x, kk in zip(leaves, keys)
  ]
  return jax.tree.unflatten(treedef, new)


def make_batch(cfg: PureLagConfig, graphdef, params, key):
  """One training batch: P random prompts x G samples, fields as `vcpo_jax.batch.PG_KEYS` (+ valid_mask for the logp function)."""
  kp, ks = jax.random.split(key)
  prompts = all_prompts(cfg)
  pid_p = jax.random.randint(kp, (cfg.prompts_per_step,), 0, cfg.num_prompts)
  prompt_n2 = jnp.repeat(prompts[pid_p], cfg.group_size, axis=0)
  tokens, behavior = sample(graphdef, cfg, params, prompt_n2, ks)
  n, t = tokens.shape
  loss_mask = jnp.broadcast_to(jnp.arange(t) >= 2, (n, t)).astype(jnp.float32)
  return dict(
    tokens=tokens,
    valid_mask=jnp.ones((n, t), bool),
    behavior_logp=behavior,
    loss_mask=loss_mask,
    rewards=reward(cfg, prompt_n2, tokens[:, 2:]),
    group_id=jnp.repeat(jnp.arange(cfg.prompts_per_step, dtype=jnp.int32), cfg.group_size),
  )


def evaluate(cfg: PureLagConfig, graphdef, params, key):
  """(accuracy, success) of the current policy on every prompt x eval_samples, temperature 1."""
  prompt_n2 = jnp.repeat(all_prompts(cfg), cfg.eval_samples, axis=0)
  tokens, _ = sample(graphdef, cfg, params, prompt_n2, key)
  r = reward(cfg, prompt_n2, tokens[:, 2:])
  return jnp.mean(r), jnp.mean((r >= 1.0).astype(jnp.float32))


# ----------------------------------------------------------------------------- the run


def make_run_fn(
  cfg: PureLagConfig,
  pg: estimator.Method,
  max_k: int,
  score_centering_exact: bool = False,
  score_centering_topk: int = 0,
):
  """run(key, lr, k) -> dict of metric arrays: one whole exact-lag training run, pure.

  score_centering_exact: center every token's score exactly with the behaviour version read from the ring
  (vcpo_jax.score_centering.centered_gradient, the vmap reference path; the token-weight cap is
  the cap of the method's token weight, Weights.token_cap); the drift metrics drift_kl_qp (exact KL(q || p) per token),
  drift_k1 and drift_coef_l1 are then recorded per step. score_centering_topk > 0 (with
  score_centering_exact): q known only on the behaviour version's top-k ids, the tail modelled
  (score_centering.make_topk_centered_logp_fn); drift_kl_qp is then the mean head mass of q instead.

  The ring has max_k + 1 slots (static); the lag k <= max_k is a traced
  argument, so one compile per (cfg, pg, max_k) serves every k and `jax.vmap`
  runs many (key, lr, k) at once. The sampling and evaluation RNG are
  fold_in(key, step) streams: the run is a deterministic function of (key, lr, k).
  A k above max_k is clamped to max_k (the ring cannot hold older versions).
  """
  if max_k < 0:
    raise ValueError(f"max_k={max_k}: the lag must be >= 0")
  graphdef = _graphdef(cfg)
  logp_fn = grad_norms.sequence_logp_fn(graphdef)
  grad_fn = learner.policy_gradient("ghost" if cfg.grad_path == "ghost" else "vmap")
  if score_centering_topk and not score_centering_exact:
    raise ValueError(f"score_centering_topk={score_centering_topk} needs score_centering_exact=True")
  if score_centering_exact and pg.peer_loss is not None:
    raise ValueError(f"score_centering_exact with the loss {pg.peer_loss.name!r}: it centers the surrogate only")
  cap = pg.weights.token_cap
  if score_centering_topk:
    centered_fn = score_centering.make_topk_centered_logp_fn(graphdef, score_centering_topk, cap)
  else:
    centered_fn = score_centering.make_centered_logp_fn(graphdef, cap)
  ring_size = max_k + 1
  chunks, every = cfg.steps // cfg.eval_every, cfg.eval_every

  def run(key, lr, k):
    k = jnp.clip(jnp.asarray(k, jnp.int32), 0, max_k)
    k_init, k_sample, k_eval = jax.random.split(key, 3)
    params = init_params(cfg, k_init)
    opt = optim.make_optimizer(lambda _: lr, weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm)
    opt_state = opt.init(params)
    ring = jax.tree.map(lambda x: jnp.zeros((ring_size,) + x.shape, x.dtype), params)
    ring_version = jnp.full((ring_size,), -1, jnp.int32)

    def step(carry, t):
      params, opt_state, ring, ring_version = carry
      # Publish version t (params after t updates), then read version max(0, t - k).
      slot = t % ring_size
      ring = jax.tree.map(lambda r, p: jax.lax.dynamic_update_index_in_dim(r, p, slot, 0), ring, params)
      ring_version = ring_version.at[slot].set(t)
      read = jnp.maximum(t - k, 0) % ring_size
      behavior_params = jax.tree.map(lambda r: jax.lax.dynamic_index_in_dim(r, read, 0, keepdims=False), ring)
      batch = make_batch(cfg, graphdef, behavior_params, jax.random.fold_in(k_sample, t))
      if score_centering_exact:
        grads, aux = score_centering.centered_gradient(centered_fn, params, behavior_params, batch, pg)
      else:
        grads, aux = grad_fn(logp_fn, params, batch, pg)
      updates, opt_state = opt.update(grads, opt_state, params, ess_scale=aux["lr_scale"])
      params = optax.apply_updates(params, updates)
      out = dict(
        reward=jnp.mean(batch["rewards"]),
        ess_ratio=aux["ess_ratio"],
        ess_ratio_applied=aux["ess_ratio_applied"],
        lr_scale=aux["lr_scale"],
        grad_norm=optax.global_norm(grads),
        update_norm=optax.global_norm(updates),
        frac_clipped=aux["frac_clipped"],
        log_ratio_max=aux["log_ratio_max"],
        version=ring_version[read],
      )
      if score_centering_exact:
        out.update(
          drift_kl_qp=aux["drift/q_head_mass" if score_centering_topk else "drift/kl_qp"],
          drift_k1=aux["drift/k1_kl_qp"],
          drift_coef_l1=aux["drift/coef_l1"],
        )
      if cfg.debug_trace:
        out.update(tokens=batch["tokens"], behavior_logp=batch["behavior_logp"], params=params)
      return (params, opt_state, ring, ring_version), out

    def chunk(carry, c):
      carry, out = jax.lax.scan(step, carry, c * every + jnp.arange(every))
      acc, succ = evaluate(cfg, graphdef, carry[0], jax.random.fold_in(k_eval, c))
      return carry, (out, acc, succ)

    carry = (params, opt_state, ring, ring_version)
    _, (out, acc, succ) = jax.lax.scan(chunk, carry, jnp.arange(chunks))
    out = jax.tree.map(lambda x: x.reshape((chunks * every,) + x.shape[2:]), out)
    out.update(accuracy=acc, success=succ, eval_step=(jnp.arange(chunks, dtype=jnp.int32) + 1) * every)
    return out

  return run


@functools.lru_cache(maxsize=None)
def _compiled_grid(cfg: PureLagConfig, pg: estimator.Method, max_k: int, score_centering_exact: bool = False):
  # vmap over the flattened (lr, seed) runs; k is traced: one compile per (cfg, pg, max_k).
  return jax.jit(jax.vmap(make_run_fn(cfg, pg, max_k, score_centering_exact), in_axes=(0, 0, None)))


def run_grid(
  cfg: PureLagConfig,
  pg: estimator.Method,
  k: int,
  seeds,
  lrs,
  max_k: int | None = None,
  score_centering_exact: bool = False,
) -> dict[str, np.ndarray]:
  """Runs every (lr, seed) pair of one (method, k) cell at once.

  Args:
    max_k: ring size - 1 of the compiled function (default k); pass the grid's
      largest k so that every k of a method reuses one compile.
    score_centering_exact: see make_run_fn.
  Returns:
    dict of numpy arrays with leading axes [len(lrs), len(seeds)]: per-step
    metrics [..., S], per-evaluation metrics [..., S // eval_every].
  """
  max_k = int(k) if max_k is None else int(max_k)
  if not 0 <= k <= max_k:
    raise ValueError(f"k={k}: need 0 <= k <= max_k={max_k}")
  seeds, lrs = [int(s) for s in seeds], [float(x) for x in lrs]
  keys = jax.vmap(jax.random.key)(jnp.asarray([s for _ in lrs for s in seeds], jnp.uint32))
  lr_r = jnp.asarray([x for x in lrs for _ in seeds], jnp.float32)
  out = _compiled_grid(cfg, pg, max_k, bool(score_centering_exact))(keys, lr_r, jnp.int32(k))
  return {name: np.asarray(v).reshape((len(lrs), len(seeds)) + v.shape[1:]) for name, v in out.items()}
