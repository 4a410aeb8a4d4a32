"""Tests for vcpo_jax.evaluation: protocol validation, pass@k, mean@n, eval records."""

import json
import math
import os
import types
import uuid
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import fixtures
from vcpo_jax import evaluation as ev
from vcpo_jax import fs, tasks


# ----------------------------------------------------------------------------
# Protocol
# ----------------------------------------------------------------------------
def test_protocol_defaults_match_reference():
  p = ev.EvalProtocol(dataset="math500")
  assert (p.temperature, p.top_p, p.n, p.greedy) == (0.8, 0.7, 3, False)
  assert ev.EvalProtocol(dataset="aime").n == 5
  assert ev.EvalProtocol(dataset="gsm8k", greedy=True).n == 1
  assert ev.EvalProtocol(dataset="aime", n=8).n == 8


@pytest.mark.parametrize(
  "kwargs,field",
  [
    (dict(dataset="svamp"), "dataset"),
    (dict(dataset="gsm8k", greedy=True, n=3), "greedy"),
    (dict(dataset="gsm8k", pass_at_k=(1, 4)), "pass_at_k"),
    (dict(dataset="gsm8k", pass_at_k=()), "pass_at_k"),
    (dict(dataset="gsm8k", top_p=0.0), "top_p"),
    (dict(dataset="gsm8k", temperature=-1.0), "temperature"),
    (dict(dataset="gsm8k", n=0), "n"),
    (dict(dataset="gsm8k", size=0), "size"),
    (dict(dataset="gsm8k", max_new_tokens=0), "max_new_tokens"),
    (dict(dataset="gsm8k", extraction="regex"), "extraction"),
    (dict(dataset="countdown", extraction="boxed"), "extraction"),
  ],
)
def test_protocol_validation_names_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    ev.EvalProtocol(**kwargs)


def test_protocol_roundtrip_and_unknown_fields():
  p = ev.EvalProtocol(dataset="aime", pass_at_k=[1, 5], size=10)
  assert p.pass_at_k == (1, 5)
  d = json.loads(json.dumps(p.to_dict()))
  assert ev.EvalProtocol.from_dict(d) == p
  with pytest.raises(ValueError, match="temprature"):
    ev.EvalProtocol.from_dict({"dataset": "aime", "temprature": 0.5})
  with pytest.raises(dataclasses_frozen_error()):
    p.n = 7


def dataclasses_frozen_error():
  import dataclasses

  return dataclasses.FrozenInstanceError


# ----------------------------------------------------------------------------
# pass@k and mean@n against hand-computed values
# ----------------------------------------------------------------------------
@pytest.mark.parametrize(
  "n,c,k,expected",
  [
    (5, 2, 1, 2 / 5),  # 1 - C(3,1)/C(5,1) = 1 - 3/5
    (5, 2, 2, 7 / 10),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 3, 9 / 10),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (5, 2, 4, 1.0),  # n - c = 3 < k: every 4-subset has a correct sample
    (3, 0, 1, 0.0),
    (3, 3, 3, 1.0),
    (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
    (1000, 1, 1, 1 / 1000),
  ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
  assert ev.pass_at_k(n, [c], k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_means_over_problems():
  # problems with c = 0, 1, 3 of n = 3: pass@2 = mean(0, 1 - C(2,2)/C(3,2), 1) = mean(0, 2/3, 1)
  assert ev.pass_at_k(3, [0, 1, 3], 2) == pytest.approx((0 + 2 / 3 + 1) / 3)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 300).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_exact_binomials(nck):
  n, c, k = nck
  exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
  assert ev.pass_at_k(n, [c], k) == pytest.approx(float(exact), rel=1e-9, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=1, max_size=10))
def test_pass_at_1_equals_mean_at_n_and_monotone(correct):
  arr = np.array(correct)
  c = arr.sum(axis=1)
  assert ev.pass_at_k(4, c, 1) == pytest.approx(ev.mean_at_n(arr))
  vals = [ev.pass_at_k(4, c, k) for k in range(1, 5)]
  assert all(a <= b + 1e-12 for a, b in zip(vals, vals[1:]))
  assert vals[-1] == pytest.approx(float(np.mean(c > 0)))


def test_pass_at_k_rejects_bad_input():
  with pytest.raises(ValueError, match="k"):
    ev.pass_at_k(3, [1], 4)
  with pytest.raises(ValueError, match="correct counts"):
    ev.pass_at_k(3, [4], 1)
  with pytest.raises(ValueError, match="mean_at_n"):
    ev.mean_at_n([])


def test_mean_at_n_hand_value():
  assert ev.mean_at_n([[1, 0, 0], [1, 1, 0]]) == pytest.approx((1 / 3 + 2 / 3) / 2)


# ----------------------------------------------------------------------------
# evaluate() with a deterministic fake generate_fn
# ----------------------------------------------------------------------------
class FakeWriter:
  def __init__(self):
    self.scalars = []

  def add_scalar(self, name, value, step):
    self.scalars.append((name, value, step))


def _problems(protocol):
  """The protocol's problems, as RunSpec.make_eval_problems makes them for a generated task."""
  return tasks.TASKS[protocol.dataset].make_problems(protocol.split, protocol.size, protocol.seed)


def make_fake_generate(problems, correct_counts):
  """Problem i gets correct_counts[i] correct completions, then wrong ones."""
  calls = []
  by_prompt = {p.prompt: (p, c) for p, c in zip(problems, correct_counts)}

  def generate_fn(prompts, n, temperature, top_p, max_new_tokens, greedy):
    calls.append(
      dict(
        prompts=list(prompts), n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, greedy=greedy
      )
    )
    out = []
    for prompt in prompts:
      p, c = by_prompt[prompt]
      right, wrong = p.reference, str(int(p.reference) + 1)
      out.append([right if j < c else wrong for j in range(n)])
    return out

  return generate_fn, calls


def test_evaluate_record_contents(tmp_path):
  protocol = ev.EvalProtocol(dataset="arithmetic", size=4, n=3, pass_at_k=(1, 2, 3), max_new_tokens=8)
  problems = _problems(protocol)
  assert len(problems) == 4
  gen, calls = make_fake_generate(problems, [0, 1, 2, 3])
  writer = FakeWriter()
  path = os.path.join(tmp_path, "evals", "eval.jsonl")
  rec = ev.evaluate(
    gen, problems, protocol, step=120, writer=writer, jsonl_path=path, tag="final", extra={"wall_clock_s": 12.5}
  )
  # the sampler saw exactly the protocol's decoding settings
  assert calls == [
    dict(prompts=[p.prompt for p in problems], n=3, temperature=0.8, top_p=0.7, max_new_tokens=8, greedy=False)
  ]
  # c = 0, 1, 2, 3 of n = 3
  assert rec["mean_at_n"] == pytest.approx((0 + 1 / 3 + 2 / 3 + 1) / 4)
  # pass@2 per problem: 0, 1 - C(2,2)/C(3,2) = 2/3, 1, 1
  assert rec["pass_at_k"]["2"] == pytest.approx((0 + 2 / 3 + 1 + 1) / 4)
  assert rec["pass_at_k"]["3"] == pytest.approx(3 / 4)
  assert rec["pass_at_k"]["1"] == pytest.approx(rec["mean_at_n"])
  assert rec["step"] == 120 and rec["tag"] == "final" and rec["kind"] == "eval"
  assert rec["protocol"] == protocol.to_dict()
  assert [r["num_correct"] for r in rec["per_problem"]] == [0, 1, 2, 3]
  assert rec["wall_clock_s"] == 12.5
  with open(path) as f:
    lines = [json.loads(x) for x in f]
  assert lines == [json.loads(json.dumps(rec))]
  assert ev.EvalProtocol.from_dict(lines[0]["protocol"]) == protocol
  names = {name for name, _, step in writer.scalars if step == 120}
  assert names == {
    "eval/arithmetic/mean@3",
    "eval/arithmetic/pass@1",
    "eval/arithmetic/pass@2",
    "eval/arithmetic/pass@3",
    "eval/arithmetic/mean_reward",
  }


def test_evaluate_text_task_with_fixture():
  protocol = ev.EvalProtocol(dataset="gsm8k", greedy=True, size=5)
  problems = _problems(protocol)

  def gen(prompts, n, temperature, top_p, max_new_tokens, greedy):
    assert greedy and n == 1
    by = {p.prompt: p for p in problems}
    # correct answers in GSM8K format for the first three problems only
    return [[f"#### {by[q].reference}" if i < 3 else "#### 123456"] for i, q in enumerate(prompts)]

  rec = ev.evaluate(gen, problems, protocol, step=0)
  assert rec["mean_at_n"] == pytest.approx(3 / 5)


def test_a_registered_task_sets_the_protocol_and_grades(monkeypatch):
  """A fake task's own eval protocol (eval_n = 4, which no shipped task has) and its own grader decide what
  `evaluate` samples and counts; an explicit n overrides the task's. What a bug would give: n = 3 (a
  hard-coded default) or every sample wrong (a shipped task's grader)."""
  parity = fixtures.register_parity(monkeypatch)
  protocol = ev.EvalProtocol(dataset="parity", size=3, pass_at_k=(1, 4))
  assert protocol.n == 4 and ev.EvalProtocol(dataset="parity", n=2).n == 2
  problems = parity.make_problems("test", 3, seed=0)
  calls = []

  def gen(prompts, n, temperature, top_p, max_new_tokens, greedy):
    calls.append(n)
    by = {p.prompt: p for p in problems}
    return [[f"={by[q].reference}"] * i + ["wrong"] * (n - i) for i, q in enumerate(prompts)]  # i of n correct

  rec = ev.evaluate(gen, problems, protocol, step=0)
  assert calls == [4] and rec["protocol"]["n"] == 4
  assert [r["num_correct"] for r in rec["per_problem"]] == [0, 1, 2]
  assert rec["mean_at_n"] == pytest.approx((0 + 1 / 4 + 2 / 4) / 3)


def test_the_task_eval_rule_is_reachable_from_the_config():
  """config.eval.n = None takes the evaluated task's protocol: AIME's n = 5 (the released rule), countdown's 3;
  a set eval.n wins. Then `evaluate` samples that many per problem. What a bug would give: n = 3 for AIME (the
  rule unreachable, as before) or the task's n overriding an explicit eval.n."""
  from configs import countdown as countdown_config
  from vcpo_jax.run_config import parse_config

  def spec(**eval_fields):
    c = countdown_config.get_config("smoke")
    c.task.template = ""  # each task's own template (the AIME eval set's, countdown's default)
    for k, v in eval_fields.items():
      c.eval[k] = v
    return parse_config(c, check_prompts=False)

  from configs import common

  assert common.get_base_config().eval.n is None  # a config that says nothing gets the task's rule
  aime = spec(dataset="aime", n=None)
  assert aime.eval.dataset == "aime" and aime.eval.n == 5 and aime.eval_batch_size == 5 * aime.eval.size
  assert spec(dataset="aime", n=2).eval.n == 2
  assert spec(n=None).eval.n == 3 and spec(dataset="aime", n=None, greedy=True).eval.n == 1
  problems = aime.eval_task.make_problems("test", aime.eval.size, 0)
  seen = []

  def gen(prompts, n, temperature, top_p, max_new_tokens, greedy):
    seen.append(n)
    return [["\\boxed{0}"] * n for _ in prompts]

  rec = ev.evaluate(gen, problems, aime.eval, step=0)
  assert seen == [5] and rec["protocol"]["n"] == 5


def test_evaluate_rejects_bad_shapes_and_tags():
  protocol = ev.EvalProtocol(dataset="arithmetic", size=2)
  problems = _problems(protocol)
  with pytest.raises(ValueError, match="completions"):
    ev.evaluate(lambda prompts, **kw: [["1"]] * len(prompts), problems, protocol, step=0)
  with pytest.raises(ValueError, match="tag"):
    ev.evaluate(lambda prompts, **kw: [["1"] * 3] * len(prompts), problems, protocol, step=0, tag="last")
  with pytest.raises(ValueError, match="size"):
    ev.evaluate(lambda prompts, **kw: [["1"] * 3] * len(prompts), problems[:1], protocol, step=0)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_best_and_final(tmp_path, where, monkeypatch):
  """Written by evaluate and read back by best_and_final through the fs layer: a local path or a URL."""
  protocol = ev.EvalProtocol(dataset="arithmetic", size=3, n=3)
  problems = _problems(protocol)
  monkeypatch.chdir(tmp_path)
  path = os.path.join(tmp_path, "eval.jsonl") if where == "local" else f"memory://test_eval/{uuid.uuid4().hex}/e.jsonl"
  for step, counts in [(10, [1, 1, 1]), (20, [3, 3, 2]), (30, [2, 2, 2]), (40, [3, 3, 2])]:
    gen, _ = make_fake_generate(problems, counts)
    ev.evaluate(gen, problems, protocol, step=step, jsonl_path=path)
  out = ev.best_and_final(path)
  assert out["final"]["step"] == 40
  assert out["best"]["step"] == 20  # ties broken toward the earlier checkpoint
  assert out["best"]["mean_at_n"] == pytest.approx(8 / 9)
  # explicit tags win
  gen, _ = make_fake_generate(problems, [0, 0, 0])
  ev.evaluate(gen, problems, protocol, step=35, jsonl_path=path, tag="best")
  assert ev.best_and_final(path)["best"]["step"] == 35
  # a different protocol in the same file must not be silently mixed
  other = ev.EvalProtocol(dataset="arithmetic", size=3, n=3, temperature=1.0)
  gen, _ = make_fake_generate(problems, [1, 1, 1])
  ev.evaluate(gen, problems, other, step=50, jsonl_path=path)
  with pytest.raises(ValueError, match="protocols"):
    ev.best_and_final(path)
  assert len(fs.read_text(path).splitlines()) == 6
  assert os.listdir(tmp_path) == (["eval.jsonl"] if where == "local" else [])  # no ./memory:/... directory


def test_countdown_eval_counts_format_only_as_wrong():
  protocol = ev.EvalProtocol(dataset="countdown", size=2, n=3, pass_at_k=(1, 3))
  problems = _problems(protocol)
  sols = {p.prompt: p.solution for p in problems}

  def gen(prompts, n, **kw):
    return [[f"<answer>{sols[q]}</answer>", "<answer>1</answer>", "nothing"] for q in prompts]

  rec = ev.evaluate(gen, problems, protocol, step=1)
  assert rec["mean_at_n"] == pytest.approx(1 / 3)
  assert rec["pass_at_k"]["3"] == 1.0
  assert rec["mean_reward"] == pytest.approx((1.0 + 0.1 + 0.0) / 3)
  assert tasks.is_correct(1.0) and not tasks.is_correct(0.1)


# ----------------------------------------------------------------------------
# EvalSampling: the protocol's settings reach the sampler
# ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy():
  import jax

  from vcpo_jax.model import tokenizer as tok_lib
  from vcpo_jax.sampler import SamplerConfig

  tok = tok_lib.build_char_tokenizer()
  cfg, graphdef, params = fixtures.tiny_char_policy(tok)
  # a sharp random policy: scaled logits make temperature matter
  params = jax.tree.map(lambda x: x * 3.0, params)
  base = SamplerConfig(
    eos_id=tok.eos_token_id,
    pad_id=tok.pad_token_id,
    prompt_buckets=(16,),
    new_token_buckets=(8,),
    max_new_tokens=8,
    batch_buckets=(1, 4, 8),
  )
  return tok, cfg, graphdef, params, base


def _sampling(policy, built=None):
  from vcpo_jax.sampler import Sampler

  tok, cfg, graphdef, _, base = policy
  return ev.EvalSampling(lambda c: (built is None or built.append(c), Sampler(graphdef, cfg, c))[1], base, tok)


def test_eval_sampling_honours_greedy_temperature_and_top_p(policy):
  import jax
  import jax.numpy as jnp

  from vcpo_jax.model import transformer

  tok, _, graphdef, params, _ = policy
  built = []
  gen = _sampling(policy, built).generate_fn(params, jax.random.key(1))
  prompts = ["12+3=", "2+2="]
  greedy = gen(prompts, n=1, temperature=0.8, top_p=0.7, max_new_tokens=4, greedy=True)
  # greedy is the argmax continuation of a full (cache-free) forward pass, one token at a time: each pass
  # reads the logits after the last real token of a row right-padded to one width (padding keys are never
  # attended to), so a single jitted shape serves every prefix instead of eager op-by-op passes per length
  width = max(len(tok.encode(p, add_special_tokens=False)) for p in prompts) + 4

  @jax.jit
  def last_logits(x, length):
    valid = jnp.arange(width)[None] < length
    pos, mask = transformer.padded_positions_and_mask(valid)
    return transformer.forward(graphdef, params, x, pos, mask)[0][0, length - 1]

  for prompt, (text,) in zip(prompts, greedy):
    ids, new = list(tok.encode(prompt, add_special_tokens=False)), []
    while len(new) < 4 and (not new or new[-1] != tok.eos_token_id):
      row = ids + new
      x = jnp.asarray([row + [tok.pad_token_id] * (width - len(row))], jnp.int32)
      new.append(int(jnp.argmax(last_logits(x, len(row)))))
    assert text == tok.decode(new, skip_special_tokens=True)
  # a nucleus of mass 1e-6 keeps only the most likely token: sampling at any temperature is greedy
  assert gen(prompts, n=1, temperature=1.0, top_p=1e-6, max_new_tokens=4, greedy=False) == greedy
  # hot sampling draws different texts per sample (the greedy policy would repeat itself n times)
  hot = gen(prompts, n=3, temperature=5.0, top_p=1.0, max_new_tokens=4, greedy=False)
  assert all(len(set(row)) == 3 for row in hot)
  settings = [(c.temperature, c.top_p, c.top_k, c.max_new_tokens) for c in built]
  assert settings == [(0.0, 0.7, 0, 4), (1.0, 1e-6, 0, 4), (5.0, 1.0, 0, 4)]
  gen(prompts, n=1, temperature=1.0, top_p=1e-6, max_new_tokens=4, greedy=False)
  assert len(built) == 3  # one sampler (one compile) per distinct setting
  with pytest.raises(ValueError, match="max_new_tokens=9"):
    gen(prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=9, greedy=False)


class RecordingSampler:
  """Records what generate is asked for; every response is empty."""

  def __init__(self, cfg, calls):
    self.cfg, self.calls = cfg, calls

  def generate(self, params, ids, rng, num_samples, max_new_tokens):
    self.calls.append((self.cfg, len(ids), num_samples, max_new_tokens))
    rows = len(ids) * num_samples
    return types.SimpleNamespace(tokens=np.zeros((rows, 2), np.int32), response_mask=np.zeros((rows, 2), bool))


def test_eval_record_protocol_is_the_decoding_used(policy, tmp_path):
  tok, _, _, _, base = policy
  calls = []
  es = ev.EvalSampling(lambda c: RecordingSampler(c, calls), base, tok)
  path = os.path.join(tmp_path, "eval.jsonl")
  for protocol in (
    ev.EvalProtocol(dataset="arithmetic", size=2, n=3, temperature=0.6, top_p=0.9, max_new_tokens=5),
    ev.EvalProtocol(dataset="arithmetic", size=2, greedy=True, max_new_tokens=7),
  ):
    ev.evaluate(es.generate_fn(None, None), _problems(protocol), protocol, step=3, jsonl_path=path)
  with open(path) as f:
    recs = [json.loads(x) for x in f]
  used = [
    {"temperature": c.temperature, "top_p": c.top_p, "n": n, "max_new_tokens": m, "prompts": p} for c, p, n, m in calls
  ]
  want = [{**{k: r["protocol"][k] for k in ("top_p", "n", "max_new_tokens")}, "prompts": 2} for r in recs]
  want[0]["temperature"], want[1]["temperature"] = recs[0]["protocol"]["temperature"], 0.0  # greedy: argmax
  assert used == want and recs[1]["protocol"]["greedy"]
