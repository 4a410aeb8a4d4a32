"""Supervised warm start: targets the verifier accepts, response-only loss mask, loss decrease, cache."""

import dataclasses
import json
import os
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import countdown as countdown_config
from tests import fixtures
from vcpo_jax import fs, sft, tasks
from vcpo_jax.model import tokenizer as tok_lib
from vcpo_jax.model import transformer
from vcpo_jax.run_config import parse_config
from vcpo_jax.tasks.arithmetic import ArithmeticTask
from vcpo_jax.tasks.countdown import DEFAULT_TEMPLATE, CountdownTask

SHORT = "{numbers}>{target}:"
GEN = dict(num_numbers=(2, 3), number_range=(1, 9), target_range=(1, 30))


@pytest.fixture(scope="module")
def tok():
  return tok_lib.build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
  return fixtures.tiny_char_policy(tok)


def _spec(tmp_path, **over):
  c = countdown_config.get_config("smoke")
  c.task.template = SHORT
  c.task.gen.num_numbers = GEN["num_numbers"]
  c.task.num_train_problems = 32
  c.task.max_prompt_len = 16
  c.task.max_new_tokens = 16
  c.sft.steps = 4
  c.sft.batch_size = 8
  c.sft.cache_dir = str(tmp_path / "cache")
  spec = parse_config(c)
  return dataclasses.replace(spec, **over)


# ----------------------------------------------------------------------------- targets and examples


def test_targets_are_what_the_verifier_accepts():
  short = CountdownTask(template=SHORT, **GEN).make_problems("train", 50, seed=1)
  for p in short:
    y = sft.target_text(p)
    assert " " not in y and "<answer>" not in y
    assert tasks.score("countdown", y, p.reference) == 1.0
  tagged = CountdownTask(template=DEFAULT_TEMPLATE, **GEN).make_problems("train", 20, seed=1)
  for p in tagged:
    y = sft.target_text(p)
    assert y.startswith("<answer>") and y.endswith("</answer>")
    assert tasks.score("countdown", y, p.reference) == 1.0
  for p in ArithmeticTask().make_problems("train", 20, seed=1):
    assert tasks.score("arithmetic", sft.target_text(p), p.reference) == 1.0
  with pytest.raises(ValueError, match="no solution"):
    sft.target_text(tasks.Problem(id="x", task="gsm8k", prompt="q", reference="1"))


def test_wrong_targets_are_well_formed_and_wrong():
  """sft.noise's demonstrator: every number used once, only the value is wrong (countdown); arithmetic off by
  1..9. What a bug would give: a correct answer (score 1) or a malformed one (the format the verifier rejects)."""
  import random

  from vcpo_jax.tasks.countdown import evaluate_expression

  rng = random.Random(0)
  for p in CountdownTask(template=SHORT, **GEN).make_problems("train", 200, seed=1):
    y = sft.wrong_target_text(p, rng)
    value, err = evaluate_expression(y, p.reference["numbers"])
    assert value is not None, err  # valid: the given numbers, each once, operators only
    assert sorted(int(t) for t in __import__("re").findall(r"\d+", y)) == sorted(p.reference["numbers"])
    assert value != p.reference["target"] and tasks.score("countdown", y, p.reference) == 0.0
  for p in ArithmeticTask().make_problems("train", 100, seed=1):
    y = sft.wrong_target_text(p, rng)
    assert 1 <= abs(int(y) - int(p.solution)) <= 9 and int(y) >= 0
    assert tasks.score("arithmetic", y, p.reference) == 0.0
  with pytest.raises(ValueError, match="cannot write wrong answers"):
    sft.wrong_target_text(tasks.Problem(id="x", task="gsm8k", prompt="q", reference="1", solution="1"), rng)


def test_a_registered_task_supplies_its_own_demonstrations(tok, tmp_path, monkeypatch):
  """sft asks the problem's task for its targets: a fake task's "=odd" / "=even" (not its solution column
  "<k> mod 2", not a shipped task's rule), its wrong answers under noise, and its can_demonstrate_wrong for the
  sft.noise check. What a bug would give: the solution column as the target, or a 'cannot write wrong answers'
  error for a task that can."""
  parity = fixtures.register_parity(monkeypatch)
  probs = parity.make_problems("train", 40, seed=0)
  assert [sft.target_text(p) for p in probs[:2]] == ["=even", "=odd"]
  assert sft.wrong_target_text(probs[1], None) == "=even"
  hand = tasks.Problem(id="h", task="parity", prompt="P3?", reference="odd")  # no grader: the registry's instance
  assert sft.target_text(hand) == "=odd"
  ex = sft.build_examples(probs, tok, max_prompt_len=8, max_new_tokens=8, noise=0.5, seed=1)
  decoded = [tok.decode(ex.tokens_mt[i][ex.loss_mt[i]][:-1]) for i in range(len(ex))]  # the targets, EOS off
  right = [d == f"={p.reference}" for d, p in zip(decoded, probs)]
  assert set(decoded) == {"=even", "=odd"} and 0 < sum(right) < len(right)  # right and wrong ones, nothing else
  cfg = dataclasses.replace(_spec(tmp_path).sft_config(), task="parity", noise=0.5)  # parity can: accepted
  assert cfg.task == "parity"
  monkeypatch.setattr(type(parity), "can_demonstrate_wrong", False)
  with pytest.raises(ValueError, match="task 'parity' cannot write wrong answers"):
    dataclasses.replace(cfg, noise=0.25)


def test_noise_replaces_a_seeded_fraction_of_targets(tok):
  probs = CountdownTask(template=SHORT, **GEN).make_problems("train", 400, seed=1)
  clean = sft.build_examples(probs, tok, max_prompt_len=16, max_new_tokens=12)
  noisy = sft.build_examples(probs, tok, max_prompt_len=16, max_new_tokens=12, noise=0.75, seed=3)
  again = sft.build_examples(probs, tok, max_prompt_len=16, max_new_tokens=12, noise=0.75, seed=3)
  np.testing.assert_array_equal(noisy.tokens_mt, again.tokens_mt)  # a function of the seed
  changed = (noisy.tokens_mt != clean.tokens_mt).any(axis=1)
  assert 0.68 < changed.mean() < 0.82  # ~Binomial(400, 0.75) / 400 (+-3.5 sd)
  np.testing.assert_array_equal(noisy.tokens_mt[~changed], clean.tokens_mt[~changed])
  np.testing.assert_array_equal(noisy.tokens_mt[:, :16], clean.tokens_mt[:, :16])  # prompts untouched
  assert (noisy.loss_mt.sum(1) > 0).all()


def test_noise_is_checked_and_keyed(tok, model, tmp_path):
  for bad in (-0.1, 1.0):
    with pytest.raises(ValueError, match=r"sft.noise="):
      dataclasses.replace(_spec(tmp_path).sft_config(), noise=bad)
  with pytest.raises(ValueError, match="cannot write wrong answers"):
    dataclasses.replace(_spec(tmp_path).sft_config(), task="gsm8k", noise=0.5)
  cfg, _, params = model
  spec = _spec(tmp_path)
  probs = spec.task.make_problems("train", 32, spec.seed)
  base = spec.sft_config()
  key = lambda c: sft.cache_key(sft.key_fields(params, cfg, tok, probs, c))
  assert "sft_noise" not in sft.key_fields(params, cfg, tok, probs, base)  # 0: earlier caches keep hitting
  assert key(dataclasses.replace(base, noise=0.5)) != key(base)


def test_loss_mask_covers_exactly_target_and_eos(tok):
  probs = CountdownTask(template=SHORT, **GEN).make_problems("train", 12, seed=0)
  ex = sft.build_examples(probs, tok, max_prompt_len=16, max_new_tokens=12)
  assert ex.tokens_mt.shape == ex.valid_mt.shape == ex.loss_mt.shape == (12, 28)
  assert not (ex.loss_mt & ~ex.valid_mt).any()  # loss only on real tokens
  assert not ex.loss_mt[:, :16].any()  # never on the prompt bucket
  for i, p in enumerate(probs):
    resp = ex.tokens_mt[i][ex.loss_mt[i]].tolist()
    assert resp[-1] == tok.eos_token_id  # the policy learns to stop
    assert tok.decode(resp[:-1]) == sft.target_text(p)
    prompt = ex.tokens_mt[i][ex.valid_mt[i] & ~ex.loss_mt[i]].tolist()
    assert tok.decode(prompt) == p.prompt
    # left-padded prompt ends right at the bucket edge; the target starts there
    assert ex.valid_mt[i, 15] and ex.loss_mt[i, 16]
  with pytest.raises(ValueError, match="max_new_tokens"):
    sft.build_examples(probs, tok, max_prompt_len=16, max_new_tokens=3)
  with pytest.raises(ValueError, match="max_prompt_len"):
    sft.build_examples(probs, tok, max_prompt_len=4, max_new_tokens=12)


def test_sft_loss_equals_masked_nll_reference(tok, model):
  cfg, graphdef, params = model
  # Same-length rows (one compile for the reference), left-padded in the batch (8 pad tokens).
  probs = [p for p in ArithmeticTask(max_digits=1).make_problems("train", 40, seed=0) if len(p.reference) == 2][:4]
  ex = sft.build_examples(probs, tok, max_prompt_len=12, max_new_tokens=6)
  loss = sft.sft_loss(graphdef, params, ex.tokens_mt, ex.valid_mt, ex.loss_mt)
  # Reference: each row alone, unpadded, full causal forward; NLL of target tokens from the previous position.
  fwd = jax.jit(transformer.forward, static_argnums=0)
  nll, count = 0.0, 0
  for i in range(len(probs)):
    row = ex.tokens_mt[i][ex.valid_mt[i]]
    lm = ex.loss_mt[i][ex.valid_mt[i]]
    t = len(row)
    logits, _ = fwd(
      graphdef, params, jnp.asarray(row)[None], jnp.arange(t)[None], jnp.tril(jnp.ones((t, t), bool))[None]
    )
    logp = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
    for j in np.nonzero(lm)[0]:
      nll -= logp[j - 1, row[j]]
      count += 1
  np.testing.assert_allclose(float(loss), nll / count, rtol=1e-5)
  # Padding content is invisible; prompt tokens change the loss only through conditioning.
  junk = np.where(ex.valid_mt, ex.tokens_mt, 7)
  np.testing.assert_allclose(
    float(sft.sft_loss(graphdef, params, junk, ex.valid_mt, ex.loss_mt)), float(loss), rtol=1e-6
  )


def test_sft_loss_decreases(tok, model):
  cfg, graphdef, params = model
  probs = ArithmeticTask(max_digits=1).make_problems("train", 32, seed=0)
  ex = sft.build_examples(probs, tok, max_prompt_len=8, max_new_tokens=4)
  new_params, losses = sft.train(graphdef, params, ex, steps=40, lr=1e-2, batch_size=16, seed=0)
  assert losses.shape == (40,) and np.isfinite(losses).all()
  assert losses[-5:].mean() < 0.6 * losses[:5].mean()
  assert jax.tree.structure(new_params) == jax.tree.structure(params)


@pytest.mark.slow
def test_optimizer_is_optim_builder_with_the_old_chain_updates(model):
  """sft builds through optim.make_optimizer; its updates equal the former clip -> adamw(schedule) chain."""
  import optax

  _, _, params = model
  steps, lr = 40, 3e-3
  new = sft.make_optimizer(lr, steps)
  warmup = max(1, steps // 20)
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr / 10)
  old = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
  p_new = p_old = params
  s_new, s_old = new.init(params), old.init(params)
  for i in range(3):
    key = jax.random.key(i)
    grads = jax.tree.map(lambda x: jax.random.normal(key, x.shape, x.dtype) * (0.1 + 5.0 * i), params)  # clips at i>0
    u_new, s_new = new.update(grads, s_new, p_new)
    u_old, s_old = old.update(grads, s_old, p_old)
    p_new, p_old = optax.apply_updates(p_new, u_new), optax.apply_updates(p_old, u_old)
    for a, b in zip(jax.tree.leaves(p_new), jax.tree.leaves(p_old)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert float(sft.make_schedule(lr, steps)(steps)) == pytest.approx(lr / 10)


# ----------------------------------------------------------------------------- cache


def test_cache_names_leaves_like_the_partition_rules(model, tmp_path):
  from safetensors.numpy import load_file

  from vcpo_jax import sharding

  _, _, params = model
  path = str(tmp_path / "p.safetensors")
  sft.save_params(path, params, {"a": 1})
  want = [sharding.path_str(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  assert sorted(load_file(path)) == sorted(want) and len(set(want)) == len(want)
  assert not any("[" in n for n in want)  # dotted names, not jax keystr brackets
  loaded, meta = sft.load_params(path, params)
  assert meta == {"a": 1}
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert os.listdir(tmp_path) == ["p.safetensors"]  # the atomic write left no temporary file


def test_cache_file_through_the_fs_layer(model, tmp_path, monkeypatch):
  """A cache directory given as a URL (fsspec memory://): the same bytes as a local file, nothing written
  locally; a corrupt or mismatched file is a miss (None), not an error."""
  _, _, params = model
  monkeypatch.chdir(tmp_path)
  url = f"memory://test_sft/{uuid.uuid4().hex}/p.safetensors"
  sft.save_params(url, params, {"a": [1, 2]})
  sft.save_params(str(tmp_path / "local.safetensors"), params, {"a": [1, 2]})
  assert fs.read_bytes(url) == (tmp_path / "local.safetensors").read_bytes()
  assert os.listdir(tmp_path) == ["local.safetensors"]  # no ./memory:/... directory
  loaded, meta = sft.load_params(url, params)
  assert meta == {"a": [1, 2]}
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert sft.load_params(url + ".missing", params) is None
  fs.write_bytes(url, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
  assert sft.load_params(url, params) is None
  sft.save_params(url, {"other": jnp.zeros(3)}, {})
  assert sft.load_params(url, params) is None


def test_warm_start_is_cached_and_reused(tok, model, tmp_path, monkeypatch):
  cfg, graphdef, params = model
  spec = _spec(tmp_path)
  probs = spec.task.make_problems("train", spec.rollout.num_train_problems, spec.seed)
  sft_cfg = spec.sft_config()
  first = sft.warm_start(graphdef, params, cfg, tok, probs, sft_cfg, str(tmp_path / "wd1"))
  files = os.listdir(sft_cfg.cache_dir)
  assert len(files) == 1 and files[0].endswith(".safetensors")  # no temporary files left behind
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(params)))

  def no_training(*a, **k):
    raise AssertionError("a cached warm start must not train")

  monkeypatch.setattr(sft, "train", no_training)
  wd2 = f"memory://test_sft/{uuid.uuid4().hex}/wd2"  # sft.json through the fs layer (a remote workdir)
  second = sft.warm_start(graphdef, params, cfg, tok, probs, sft_cfg, wd2)
  assert jax.tree.structure(second) == jax.tree.structure(first)
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  rec1 = json.loads(fs.read_text(str(tmp_path / "wd1" / "sft.json")))
  rec2 = json.loads(fs.read_text(fs.join(wd2, "sft.json")))
  assert rec1["cached"] is False and rec2["cached"] is True and rec1["key"] == rec2["key"]
  # who trained the parameters: recorded when they were built, carried through the cache
  assert rec1["provenance"] == rec2["provenance"] and rec1["provenance"]["versions"]["jax"] == jax.__version__
  assert 0.0 <= rec1["greedy_accuracy"] <= 1.0 and np.isfinite(rec1["final_loss"])
  assert rec1["fields"]["numerics"] == rec2["fields"]["numerics"]
  # A different config misses the cache (and would train); so does another machine's (a cache shared over a
  # network file system by two kinds of CPU).
  with pytest.raises(AssertionError, match="must not train"):
    sft.warm_start(graphdef, params, cfg, tok, probs, dataclasses.replace(sft_cfg, lr=sft_cfg.lr * 2))
  from vcpo_jax import provenance

  real = provenance.numerics()
  monkeypatch.setattr(provenance, "numerics", lambda: {**real, "cpu": {**real["cpu"], "model": "another CPU"}})
  with pytest.raises(AssertionError, match="must not train"):
    sft.warm_start(graphdef, params, cfg, tok, probs, sft_cfg)


def test_cache_key_changes_with_every_relevant_field(tok, model, tmp_path):
  cfg, graphdef, params = model
  spec = _spec(tmp_path)
  sft_cfg = spec.sft_config()
  probs = spec.task.make_problems("train", 32, spec.seed)

  def key(params=params, cfg=cfg, tok=tok, probs=probs, **over):
    return sft.cache_key(sft.key_fields(params, cfg, tok, probs, dataclasses.replace(sft_cfg, **over)))

  base = key()
  assert key() == base  # deterministic
  assert key(cache_dir="/elsewhere") == base  # where it is stored does not determine it
  assert key(temperature=0.5, progress=not sft_cfg.progress) == base  # the report and the bar neither
  variants = {
    "sft_steps": key(steps=sft_cfg.steps + 1),
    "sft_lr": key(lr=sft_cfg.lr / 2),
    "sft_batch_size": key(batch_size=4),
    "seed": key(seed=1),
    "task": key(task="arithmetic"),
    "template": key(template="{target}<{numbers}:"),
    "task_gen": key(task_gen={**sft_cfg.task_gen, "number_range": (1, 5)}),
    "max_prompt_len": key(max_prompt_len=20),
    "max_new_tokens": key(max_new_tokens=20),
    "chat_template": key(chat_template=True),
    "model_cfg": key(cfg=cfg.replace(rms_eps=1e-5)),
    "init_params": key(params=jax.tree.map(lambda x: x + 1.0, params)),
    "problems": key(probs=probs[:-1]),
  }
  t2 = tok_lib.build_char_tokenizer()
  t2.add_tokens(["<extra>"])
  variants["tokenizer"] = key(tok=t2)
  for name, k in variants.items():
    assert k != base, name
  assert len(set(variants.values())) == len(variants)


def test_cache_key_is_pinned(tok, model, tmp_path):
  """Regression pin: existing warm-start caches (~/.cache/vcpo_jax/sft/<key>.safetensors) must keep hitting.

  The expected key was computed on main at 763115d, before SFTConfig existed, when key_fields read the
  RunSpec (sft_steps / sft_lr / sft_batch_size / seed / task_template / task_gen / rollout budgets) for this
  same fixed input; it is hard-coded, not recomputed. Parameters are fixed arrays (not a random init), so the
  pin checks how the key is built, not the initializer's numerics. If it changes on purpose, bump
  sft.CACHE_VERSION and re-pin."""
  cfg, _, _ = model
  spec = _spec(tmp_path)
  probs = spec.task.make_problems("train", spec.rollout.num_train_problems, spec.seed)
  fixed = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.int32)}
  fields = sft.key_fields(fixed, cfg, tok, probs, spec.sft_config())
  assert fields["problems_sha256"] == "1031237fef154c0e4054e2920f1c671aadfdea4f34e71555241a1ac8e63757a9"
  # 6d7c3e3611b2ec1b1a540e6d at CACHE_VERSION 2 (the same fields); 0160f6092b49a9571747601c at 3 (the
  # parameters' leaves are stacked layers); 4: the key holds the numerics as well (`numerics_fields`)
  assert sft.cache_key(fields) == "239dfe162afe14adf7248858"


def test_cache_key_holds_the_numerics(tok, model, tmp_path, monkeypatch):
  """The train step's program, the rows it reads, the XLA build and the machine enter the key: a change to the
  step's arithmetic, the examples, jaxlib or the CPU's instruction sets trains anew; the same arithmetic written
  elsewhere (other source lines) keeps the key, and so does a second call."""
  import jaxlib

  from vcpo_jax import provenance

  cfg, graphdef, params = model
  spec = _spec(tmp_path)
  sft_cfg = spec.sft_config()
  probs = spec.task.make_problems("train", 32, spec.seed)
  ex = sft.build_examples(probs, tok, sft_cfg.max_prompt_len, sft_cfg.max_new_tokens)

  def numerics(examples=ex, **over):
    return sft.numerics_fields(graphdef, params, examples, dataclasses.replace(sft_cfg, **over))

  base = numerics()
  assert numerics() == base
  assert base["device"] == f"cpu:{jax.devices()[0].device_kind}" and base["jaxlib"] == jaxlib.__version__
  assert base["cpu"]["threads"] >= 1 and len(base["train_step_sha256"]) == 64
  loss = sft.sft_loss

  def same_loss(graphdef, params, tokens_bt, valid_bt, loss_bt):  # the same ops, from another source line
    return loss(graphdef, params, tokens_bt, valid_bt, loss_bt)

  monkeypatch.setattr(sft, "sft_loss", same_loss)
  assert numerics() == base
  monkeypatch.setattr(sft, "sft_loss", lambda *a: 2.0 * loss(*a))  # other arithmetic: another program
  doubled = numerics()
  monkeypatch.setattr(sft, "sft_loss", loss)
  steps = [doubled, numerics(lr=sft_cfg.lr / 2), numerics(batch_size=4)]  # the lr schedule is traced into it
  assert len({n["train_step_sha256"] for n in [base, *steps]}) == 4
  tokens = ex.tokens_mt.copy()
  tokens[0, -1] += 1
  other_rows = numerics(examples=dataclasses.replace(ex, tokens_mt=tokens))
  assert other_rows["examples_sha256"] != base["examples_sha256"]
  assert other_rows["train_step_sha256"] == base["train_step_sha256"]  # the same program, other data
  key = sft.cache_key({"numerics": base})
  real = provenance.numerics()
  for change in ({"jaxlib": "0.0.1"}, {"cpu": {**real["cpu"], "flags_sha256": "another"}}, {"xla_flags": "--x"}):
    monkeypatch.setattr(provenance, "numerics", lambda change=change: {**real, **change})
    assert sft.cache_key({"numerics": numerics()}) != key, change


def test_moe_warm_start_trains_and_is_shared_with_and_without_replay(tok, tmp_path, monkeypatch):
  """A tiny Qwen3-MoE warm-starts like a dense policy (the loss falls, the experts and router move); runs with
  and without routing replay, or another grouped matmul, hit the same cache file; the MoE shape is keyed."""
  from vcpo_jax.model import config as model_config

  cfg = model_config.tiny_qwen3_moe(
    vocab_size=len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position=64
  )
  graphdef, params = transformer.split(transformer.init(cfg, seed=0))
  spec = _spec(tmp_path)
  probs = spec.task.make_problems("train", spec.rollout.num_train_problems, spec.seed)
  sft_cfg = spec.sft_config()
  examples = sft.build_examples(probs, tok, sft_cfg.max_prompt_len, sft_cfg.max_new_tokens)
  trained, losses = sft.train(graphdef, params, examples, steps=8, lr=3e-3, batch_size=8, seed=0)
  assert losses[-1] < losses[0]
  moved = {
    n: not np.array_equal(np.asarray(a), np.asarray(b))
    for n, a, b in zip(sft._names(params), jax.tree.leaves(params), jax.tree.leaves(trained))
  }
  assert any(v for n, v in moved.items() if "mlp.gate." in n) and any(v for n, v in moved.items() if "expert" in n)

  first = sft.warm_start(graphdef, params, cfg, tok, probs, sft_cfg)
  monkeypatch.setattr(sft, "train", lambda *a, **k: pytest.fail("a cached warm start must not train"))
  for other in (cfg.replace(routing_replay=True), cfg.replace(moe_matmul="scan")):
    again = sft.warm_start(graphdef, params, other, tok, probs, sft_cfg)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def key(c):
    return sft.cache_key(sft.key_fields(params, c, tok, probs, sft_cfg))

  assert key(cfg.replace(num_experts_per_tok=1)) != key(cfg) != key(cfg.replace(moe_intermediate_size=16))
  assert "num_experts" in sft.key_fields(params, cfg, tok, probs, sft_cfg)["model_cfg"]
