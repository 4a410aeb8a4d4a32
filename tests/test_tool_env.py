"""Tests for vcpo_jax.tasks.tool_env with a character tokenizer and a scripted fake sampler.

Token id = ord(char); id 0 is EOS. The fake sampler replays a script of model
turns per prompt, so every token, mask and log-prob is known by hand.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import estimator
from vcpo_jax.tasks import tool_env
from vcpo_jax.tasks.sandbox import SandboxConfig
from vcpo_jax.tasks.tool_env import ToolEnvConfig, pad_episodes, run_episodes

EOS = 0
SB = SandboxConfig(cpu_seconds=1, wall_seconds=3.0)


def encode(text):
  return [ord(c) for c in text]


def decode(ids):
  return "".join(chr(i) for i in ids if i != EOS)


def fake_logp(pos, tok):
  """Deterministic 'behavior' log-prob of token `tok` at absolute position `pos`."""
  return -(0.05 + (tok % 13) / 100 + (pos % 5) / 1000)


class ScriptedSampler:
  """generate_fn replaying scripted model turns ("\x00" = EOS).

  The turn index is the number of <output> blocks already in the context; the
  part of the current turn already emitted is skipped, so a turn can be
  resumed. stop_char simulates a sampler stop id that is not the end of the
  closing tag (it stops after every such char).
  """

  def __init__(self, scripts, stop_char=None):
    self.scripts, self.stop_char, self.calls = scripts, stop_char, 0

  def __call__(self, contexts, max_new_tokens):
    self.calls += 1
    outs = []
    for ctx in contexts:
      raw = "".join(chr(i) for i in ctx)
      prompt = next(p for p in self.scripts if raw.startswith(p))
      response = raw[len(prompt) :]
      k = response.count("<output>")
      partial = response.rsplit("</output>\n", 1)[-1] if k else response
      turn = self.scripts[prompt][k]
      assert turn.startswith(partial), (turn, partial)
      rest = turn[len(partial) :][:max_new_tokens]
      if self.stop_char and self.stop_char in rest:
        rest = rest[: rest.index(self.stop_char) + 1]
      ids = encode(rest)
      outs.append((ids, [fake_logp(len(ctx) + j, t) for j, t in enumerate(ids)]))
    return outs


def contains_reward(text, reference):
  return float(str(reference) in text)


def make_cfg(**kw):
  base = dict(
    reward_fn=contains_reward,
    max_turns=4,
    max_new_tokens=200,
    max_response_tokens=2000,
    max_tool_output_tokens=100,
    eos_token_ids=(EOS,),
    sandbox=SB,
  )
  base.update(kw)
  return ToolEnvConfig(**base)


TWO_TURNS = {"Q: 6*7?\n": ["Let me run <code>print(6*7)</code>", "The answer is 42\x00"]}


def test_two_turn_episode_hand_checked():
  (ep,) = run_episodes(ScriptedSampler(TWO_TURNS), encode, decode, ["Q: 6*7?\n"], [42], make_cfg())
  prompt, turn1, tool, turn2 = (
    "Q: 6*7?\n",
    "Let me run <code>print(6*7)</code>",
    "<output>\n42\n</output>\n",
    "The answer is 42\x00",
  )
  assert ep.tokens.tolist() == encode(prompt + turn1 + tool + turn2)
  segments = [(prompt, 0, 0), (turn1, 1, 1), (tool, 1, 0), (turn2, 1, 1)]
  want_response = np.concatenate([[r] * len(s) for s, r, _ in segments])
  want_loss = np.concatenate([[l] * len(s) for s, _, l in segments])
  np.testing.assert_array_equal(ep.response_mask, want_response)
  np.testing.assert_array_equal(ep.loss_mask, want_loss)
  want_logp = [fake_logp(p, t) if l else 0.0 for p, (t, l) in enumerate(zip(ep.tokens.tolist(), want_loss))]
  np.testing.assert_allclose(ep.behavior_logp, want_logp, rtol=1e-6)
  assert (ep.reward, ep.num_turns, ep.tool_kinds, ep.finish_reason) == (1.0, 2, ("ok",), "answer")
  assert ep.final_text == "The answer is 42" and ep.prompt_len == len(prompt)
  assert ep.response_text == decode(encode(turn1 + tool + turn2))


def test_tokens_past_the_closing_tag_are_dropped():
  scripts = {"Q\n": ["<code>print(1)</code>JUNK that must go", "done 1\x00"]}
  (ep,) = run_episodes(ScriptedSampler(scripts), encode, decode, ["Q\n"], [1], make_cfg())
  assert "JUNK" not in decode(ep.tokens.tolist())
  assert decode(ep.tokens.tolist()) == "Q\n<code>print(1)</code><output>\n1\n</output>\ndone 1"
  assert len(ep.behavior_logp) == len(ep.tokens) == len(ep.loss_mask)


def test_resuming_after_non_final_stop_gives_same_episode():
  # A sampler that stops after every '>' (as a token-level stop id on the last
  # token of "</code>" would) must yield exactly the same episode.
  whole = run_episodes(ScriptedSampler(TWO_TURNS), encode, decode, ["Q: 6*7?\n"], [42], make_cfg())[0]
  sampler = ScriptedSampler(TWO_TURNS, stop_char=">")
  pieces = run_episodes(sampler, encode, decode, ["Q: 6*7?\n"], [42], make_cfg())[0]
  assert sampler.calls > 2
  np.testing.assert_array_equal(whole.tokens, pieces.tokens)
  np.testing.assert_array_equal(whole.loss_mask, pieces.loss_mask)
  np.testing.assert_array_equal(whole.behavior_logp, pieces.behavior_logp)
  assert pieces.num_turns == 2


def test_turn_limit_stops_without_executing_last_code():
  scripts = {"Q\n": ["<code>print(1)</code>", "<code>print(2)</code>", "<code>print(3)</code>"]}
  (ep,) = run_episodes(ScriptedSampler(scripts), encode, decode, ["Q\n"], ["x"], make_cfg(max_turns=2))
  assert (ep.num_turns, ep.tool_kinds, ep.finish_reason, ep.reward) == (2, ("ok",), "max_turns", 0.0)
  assert decode(ep.tokens.tolist()).endswith("<code>print(2)</code>")


def test_tool_output_truncated_to_token_budget():
  scripts = {"Q\n": ["<code>print('y' * 5000)</code>", "ok\x00"]}
  (ep,) = run_episodes(ScriptedSampler(scripts), encode, decode, ["Q\n"], ["ok"], make_cfg())
  tool_len = int(((ep.response_mask == 1) & (ep.loss_mask == 0)).sum())
  overhead = len("<output>\n") + len("</output>\n")
  assert tool_len == 100 + overhead
  assert tool_env.TRUNCATION_NOTE in ep.response_text and ep.reward == 1.0


def test_response_budget_ends_episode():
  scripts = {"Q\n": ["<code>print(1)</code>", "a" * 500 + "\x00"]}
  (ep,) = run_episodes(ScriptedSampler(scripts), encode, decode, ["Q\n"], ["zzz"], make_cfg(max_response_tokens=60))
  assert len(ep.tokens) - ep.prompt_len == 60 and ep.finish_reason == "max_tokens"


def test_batch_with_mixed_lengths_and_token_prompts():
  scripts = {"A\n": ["final 1\x00"], "B\n": ["<code>print(2+3)</code>", "<code>print(5*5)</code>", "25\x00"]}
  eps = run_episodes(ScriptedSampler(scripts), encode, decode, ["A\n", encode("B\n")], ["1", "25"], make_cfg())
  assert [e.num_turns for e in eps] == [1, 3]
  assert [e.tool_kinds for e in eps] == [(), ("ok", "ok")]
  assert [e.reward for e in eps] == [1.0, 1.0]


def test_tool_tokens_excluded_from_importance_ratios():
  (ep,) = run_episodes(ScriptedSampler(TWO_TURNS), encode, decode, ["Q: 6*7?\n"], [42], make_cfg())
  b = pad_episodes([ep], length=len(ep.tokens) + 7)
  loss_nt, resp_nt = b["loss_mask"], b["response_mask"]
  tool_nt = resp_nt * (1 - loss_nt)
  assert tool_nt.sum() == len("<output>\n42\n</output>\n")
  # Learner log-probs: equal to behavior on policy tokens, garbage elsewhere
  # (tool tokens were never sampled by the policy).
  rng = np.random.default_rng(0)
  logp_nt = np.where(loss_nt == 1, b["behavior_logp"], -rng.uniform(1, 30, loss_nt.shape)).astype(np.float32)
  l_n = estimator.sequence_log_ratio(logp_nt, b["behavior_logp"], loss_nt)
  assert float(l_n[0]) == 0.0  # on-policy: ratio exactly 1 whatever the tool tokens hold
  # The same data with the response mask (the bug this guards against) is far off.
  assert float(estimator.sequence_log_ratio(logp_nt, b["behavior_logp"], resp_nt)[0]) < -10
  # Off-policy by +0.1 per policy token: l = 0.1 * (#policy tokens), hand count.
  n_policy = len("Let me run <code>print(6*7)</code>") + len("The answer is 42\x00")
  shifted = np.where(loss_nt == 1, b["behavior_logp"] + 0.1, logp_nt).astype(np.float32)
  l_n = estimator.sequence_log_ratio(shifted, b["behavior_logp"], loss_nt)
  np.testing.assert_allclose(float(l_n[0]), 0.1 * n_policy, rtol=1e-4)
  # A masked policy-gradient loss puts zero gradient on tool and padding tokens.
  g = jax.grad(lambda lp: -jnp.sum(jnp.asarray(loss_nt) * lp))(jnp.asarray(logp_nt))
  assert np.all(np.asarray(g)[loss_nt == 0] == 0) and np.all(np.asarray(g)[loss_nt == 1] == -1)


ADVERSARIAL = {
  "P0 loop\n": ("while True:\n    pass", "timeout"),
  "P1 fork\n": ("import os\nwhile True:\n    os.fork()", "forbidden"),
  "P2 huge\n": ("while True:\n    print('x' * 10000)", "output_limit"),
  "P3 subprocess\n": ("import subprocess\nsubprocess.run(['id'])", "forbidden"),
  "P4 passwd\n": ("print(open('/etc/passwd').read())", "forbidden"),
  "P5 write\n": ("open('/tmp/vcpo_tool_env_escape', 'w').write('x')", "forbidden"),
  "P6 socket\n": ("import socket\nsocket.create_connection(('1.1.1.1', 80))", "forbidden"),
  "P7 memory\n": ("x = bytearray(10**10)", "memory"),
  "P8 long\n": ("x = 1\n" * 20_000, "forbidden"),  # 120 kB: over the code-size limit
}


def test_adversarial_episodes_are_contained_and_training_continues():
  import os

  scripts = {p: [f"<code>{code}</code>", "I give up: 0\x00"] for p, (code, _) in ADVERSARIAL.items()}
  cfg = make_cfg(
    max_new_tokens=200_000,
    max_response_tokens=200_000,
    sandbox=SandboxConfig(cpu_seconds=1, wall_seconds=3.0, max_code_bytes=50_000),
  )
  prompts = list(ADVERSARIAL)
  eps = run_episodes(ScriptedSampler(scripts), encode, decode, prompts, ["0"] * len(prompts), cfg)
  for p, e in zip(prompts, eps):
    assert e.tool_kinds == (ADVERSARIAL[p][1],), (p, e.tool_kinds, e.response_text[-300:])
    assert e.num_turns == 2 and e.finish_reason == "answer" and e.reward == 1.0
    tool_len = int(((e.response_mask == 1) & (e.loss_mask == 0)).sum())
    assert tool_len <= cfg.max_tool_output_tokens + len("<output>\n</output>\n")
    assert "root:" not in e.response_text
  assert not os.path.exists("/tmp/vcpo_tool_env_escape")
  # Training-style continuation: a masked, ratio-weighted policy-gradient step
  # on a tiny unigram policy is finite, and the next round of episodes runs.
  b = pad_episodes(eps)
  tokens_nt, loss_nt = jnp.asarray(b["tokens"]), jnp.asarray(b["loss_mask"])

  def loss_fn(logits_v):
    logp_nt = jax.nn.log_softmax(logits_v)[tokens_nt]
    w_n = jnp.exp(jnp.clip(estimator.sequence_log_ratio(logp_nt, b["behavior_logp"], loss_nt), -20, 20))
    adv_n = jnp.asarray(b["rewards"]) - jnp.mean(jnp.asarray(b["rewards"]))
    return -jnp.mean(w_n * adv_n * jnp.sum(loss_nt * logp_nt, -1) / jnp.sum(loss_nt, -1))

  g = jax.jit(jax.grad(loss_fn))(jnp.zeros(128))
  assert np.all(np.isfinite(np.asarray(g)))
  (ep,) = run_episodes(ScriptedSampler(TWO_TURNS), encode, decode, ["Q: 6*7?\n"], [42], make_cfg())
  assert ep.tool_kinds == ("ok",) and ep.reward == 1.0


def test_validation_errors():
  with pytest.raises(ValueError, match="reward_fn"):
    ToolEnvConfig(reward_fn=None)
  with pytest.raises(ValueError, match="max_turns"):
    make_cfg(max_turns=0)
  with pytest.raises(ValueError, match="code_close"):
    make_cfg(code_close="")
  with pytest.raises(ValueError, match="equal length"):
    run_episodes(ScriptedSampler(TWO_TURNS), encode, decode, ["Q: 6*7?\n"], [], make_cfg())
  bad = lambda ctxs, n: [([1, 2], [0.0])] * len(ctxs)  # noqa: E731
  with pytest.raises(ValueError, match="log-probs"):
    run_episodes(bad, encode, decode, ["Q\n"], [1], make_cfg())
  with pytest.raises(ValueError, match="length"):
    ep = run_episodes(ScriptedSampler(TWO_TURNS), encode, decode, ["Q: 6*7?\n"], [42], make_cfg())
    pad_episodes(ep, length=3)
