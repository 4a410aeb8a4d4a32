"""python -m vcpo_jax.export: a smoke run's checkpoint -> a Hugging Face directory that transformers loads,
with the run's logits, greedy generations and token ids."""

import contextlib
import io
import json
import os
import re

import jax
import numpy as np
import pytest

from tests import fixtures
from vcpo_jax import export, run_config, trainer
from vcpo_jax.checkpoint import Checkpointer
from vcpo_jax.model import hf_io
from vcpo_jax.model import transformer as tf
from vcpo_jax.model.tokenizer import apply_chat_template_or_plain, build_char_tokenizer
from vcpo_jax.rollout import common as rollout_common
from vcpo_jax.sampler import Sampler, SamplerConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(workdir, {step: params}): a 3-step smoke run with checkpoints at 2 and 3, its parameters as saved."""
  workdir = str(tmp_path_factory.mktemp("export") / "run")
  saved = {}
  real_save = trainer._save

  def recording_save(ckpt, step, state, *a, **k):
    saved[step] = jax.tree.map(lambda x: np.array(x, copy=True), state.params)  # donated buffers are reused
    return real_save(ckpt, step, state, *a, **k)

  mp = pytest.MonkeyPatch()
  mp.setattr(trainer, "_save", recording_save)
  # A reward with signal for a random policy (the fraction of digits), so that every step moves the weights.
  dense = lambda problems, outputs, extraction=None: ([sum(map(str.isdigit, o)) / max(len(o), 1) for o in outputs], 0)
  mp.setattr(rollout_common.tasks, "score_problems", dense)
  try:
    c = fixtures.tiny_countdown_config(
      steps=3, **{"optim.lr": 1e-2, "checkpoint.every": 2, "eval.every": 2, "log.plots": False}
    )
    trainer.run(c, workdir)
  finally:
    mp.undo()
  return workdir, saved


def _project_greedy(graphdef, cfg, params, prompts, tokenizer, max_new):
  sampler = Sampler(
    graphdef,
    cfg,
    SamplerConfig(
      temperature=0.0, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, max_new_tokens=max_new
    ),
  )
  out = sampler.generate(params, prompts, jax.random.key(0), max_new_tokens=max_new)
  toks, resp = np.asarray(out.tokens), np.asarray(out.response_mask)
  return [list(map(int, toks[i][resp[i]])) for i in range(len(prompts))]


@pytest.mark.slow
def test_export_loads_in_transformers_with_the_runs_logits_and_greedy_answers(run, tmp_path):
  workdir, saved = run
  out = str(tmp_path / "hf")
  assert export.export(workdir, out)["step"] == 3  # the newest checkpoint
  assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(os.listdir(out))
  model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  tok = transformers.AutoTokenizer.from_pretrained(out)
  config = export.run_config(workdir)
  cfg, _ = hf_io.load_hf(out)
  graphdef, params = tf.split(tf.init(cfg, seed=0))[0], saved[3]
  # The run's own prompts, tokenized as in training (the built-in char tokenizer).
  train_tok = build_char_tokenizer()
  texts = [apply_chat_template_or_plain(train_tok, f"[3, {i}, 6]>{i + 4}:") for i in range(4)]
  prompts = [train_tok(t, add_special_tokens=False)["input_ids"] for t in texts]
  assert [tok(t, add_special_tokens=False)["input_ids"] for t in texts] == prompts

  tokens = np.array(prompts, np.int32)
  ours = np.asarray(hf_io._logits(graphdef, params, tokens, np.ones(tokens.shape, bool)))
  theirs = fixtures.hf_logits(model, tokens)
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
  # The step-3 parameters, not the initial ones or step 2's.
  other = np.asarray(hf_io._logits(graphdef, saved[2], tokens, np.ones(tokens.shape, bool)))
  assert np.abs(other - theirs).max() > 1e-3

  max_new = 8
  mine = _project_greedy(graphdef, cfg, params, prompts, train_tok, max_new)
  gen = model.generate(
    torch.tensor(tokens, dtype=torch.long),
    do_sample=False,
    max_new_tokens=max_new,
    attention_mask=torch.ones(tokens.shape),
  )
  eos = train_tok.eos_token_id
  for row, ref in zip(gen[:, tokens.shape[1] :].tolist(), mine):
    row = row[: row.index(eos) + 1] if eos in row else row
    assert row == ref
  with open(os.path.join(out, "generation_config.json")) as f:
    gen_cfg = json.load(f)
  s = config.sampler
  assert gen_cfg["eos_token_id"] == eos and gen_cfg["do_sample"] is (s.temperature > 0)
  assert (gen_cfg["temperature"], gen_cfg["top_p"], gen_cfg["top_k"]) == (s.temperature, s.top_p, s.top_k)
  assert gen_cfg["max_new_tokens"] == config.task.max_new_tokens


@pytest.mark.slow
def test_model_card_snippet_runs_and_generates_as_the_export_does(run, tmp_path):
  """README.md in the export: the source run, its config, the task's prompt format with an example made by
  the task (countdown: `[12, 7]>19:`), and a 3-line snippet that runs: seeded alike, it prints what
  `generate` on the export gives for that prompt (the sampling of generation_config.json)."""
  workdir, _ = run
  out = str(tmp_path / "hf")
  result = export.export(workdir, out)
  with open(os.path.join(out, "README.md")) as f:
    card = f.read()
  spec = run_config.parse_config(export.run_config(workdir), check_prompts=False)
  prompt = export.example_prompt(spec)
  assert re.fullmatch(r"\[\d+(, \d+)*\]>\d+:", prompt), prompt  # countdown's "{numbers}>{target}:"
  assert f"`{prompt}`" in card and "`{numbers}>{target}:`" in card and os.path.abspath(workdir) in card
  assert "step 3 of 3" in card and "method `vcpo`" in card and os.path.exists(os.path.join(out, "vcpo_config.json"))
  code = card.split("```python\n")[1].split("```")[0]
  assert code.strip() == result["snippet"] and len(code.strip().splitlines()) == 3
  printed = io.StringIO()
  torch.manual_seed(0)
  with contextlib.redirect_stdout(printed):
    exec(code, {})  # noqa: S102 -- the model card's snippet, run as a user would paste it
  tok = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
  torch.manual_seed(0)
  gen = model.generate(ids, attention_mask=torch.ones(ids.shape, dtype=torch.long))
  want = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
  assert printed.getvalue() == want + "\n" and len(want) > 0


@pytest.mark.slow
def test_export_step_choice_and_errors(run, tmp_path):
  workdir, saved = run
  assert export.export(workdir, str(tmp_path / "s2"), step="2")["step"] == 2
  _, model = hf_io.load_hf(str(tmp_path / "s2"))
  got = jax.tree.leaves(tf.split(model)[1])
  want = jax.tree.leaves(saved[2])
  assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want))
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
  best = ckpt.best_step()
  ckpt.close()
  assert best in (2, 3) and export.export(workdir, str(tmp_path / "best"), step="best")["step"] == best
  with pytest.raises(export.ExportError, match=r"--step=5: no such checkpoint; the kept steps are \[2, 3\]"):
    export.export(workdir, str(tmp_path / "x"), step=5)
  with pytest.raises(export.ExportError, match="no config.json"):
    export.export(str(tmp_path), str(tmp_path / "x"))


@pytest.mark.slow
def test_export_command_line(run, tmp_path):
  workdir, _ = run
  cmd = ["-m", "vcpo_jax.export"]
  r = fixtures.run_python([*cmd, f"--workdir={workdir}", f"--out={tmp_path / 'hf'}", "--step=2"], timeout=300)
  assert r.returncode == 0, r.stderr
  assert f"exported step 2 of {workdir}" in r.stdout
  with open(tmp_path / "hf" / "README.md") as f:
    card_snippet = f.read().split("```python\n")[1].split("```")[0].strip()
  assert r.stdout.strip().splitlines()[-3:] == card_snippet.splitlines()  # the command ends with the snippet
  for args, needle in [([f"--workdir={workdir}"], "--out"), ([f"--workdir={tmp_path}", "--out=x"], "no config.json")]:
    r = fixtures.run_python([*cmd, *args], timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr
