"""A trained run's policy as a Hugging Face directory: weights, tokenizer and generation config.

  python -m vcpo_jax.export --workdir=RUN --out=DIR [--step=N | --step=best]

reads RUN/config.json (the run's config), rebuilds the policy's structure from it (nothing is trained
or compiled beyond the optimizer state's abstract shapes), takes the parameters of the newest checkpoint
(or step N, or "best": the kept checkpoint that retention ranks first, vcpo_jax.checkpoint.best_steps) and writes

  config.json, model.safetensors         hf_io.save_hf (float32; transformers' Qwen2 / Llama); with LoRA
                                         (model.lora_rank > 0) the adapters merged into the base weights
  adapter/                               LoRA only: the PEFT adapter directory (hf_io.save_peft_adapter);
                                         peft.PeftModel.from_pretrained(base, DIR/adapter) on the run's base
  tokenizer.json, tokenizer_config.json  tokenizer.save_tokenizer (AutoTokenizer gives the training ids)
  generation_config.json                 the run's sampler: eos / pad ids, temperature, top_p, top_k and the
                                         response budget (task.max_new_tokens)
  README.md                              a model card: the source run and step, its config's main fields, the
                                         task's prompt format (an example prompt made by the task) and a
                                         3-line transformers snippet (`snippet`), which the command prints last
  vcpo_config.json                       the run's full config (its config.json, provenance included)

`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load it
(torch is needed: `pip install -e .[hf]`); its logits and greedy generations equal the run's policy's. A bad
argument is one line on stderr, exit 2.
"""

from __future__ import annotations

import json
import os
import sys

from vcpo_jax.rl import choices

RUN_RECORD_KEYS = ("provenance", "config_history", "from_step")  # config.json entries that are not config


class ExportError(ValueError):
  """A bad --workdir / --out / --step, reported on one line."""


def _tuples(x):
  """JSON lists back to the tuples the config holds (mesh.shape, eval.pass_at_k, ...)."""
  if isinstance(x, dict):
    return {k: _tuples(v) for k, v in x.items()}
  if isinstance(x, list):
    return tuple(_tuples(v) for v in x)
  return x


def run_config(workdir: str):
  """The run's ConfigDict, read back from workdir/config.json."""
  import ml_collections

  from vcpo_jax import fs

  path = fs.join(workdir, "config.json")
  if not fs.exists(path):
    raise ExportError(f"--workdir={workdir!r}: no config.json there; pass the directory of a run made by main.py")
  record = json.loads(fs.read_text(path))
  return ml_collections.ConfigDict(_tuples({k: v for k, v in record.items() if k not in RUN_RECORD_KEYS}))


def _pick_step(ckpt, step: str | int | None, workdir: str) -> int:
  steps = ckpt.all_steps()
  if not steps:
    raise ExportError(f"--workdir={workdir!r}: no checkpoint in {workdir}/checkpoints; train the run first")
  if step in (None, ""):
    return max(steps)
  if step == "best":
    best = ckpt.best_step()  # the ranking retention keeps by (background and final evaluations included)
    if best is None:
      raise ExportError(f"--step='best': no kept checkpoint of {workdir!r} carries an evaluation; pass --step=N")
    return best
  try:
    step = int(step)
  except ValueError:
    raise ExportError(f"--step={step!r}: not a step; pass an integer, 'best', or nothing for the newest") from None
  if step not in steps:
    raise ExportError(f"--step={step}: no such checkpoint; the kept steps are {sorted(steps)}")
  return step


def export(workdir: str, out: str, step: str | int | None = None) -> dict:
  """Writes the run's policy at a checkpoint (newest, `step`, or "best") to `out`; returns {"step", "out"}.

  Raises:
    ExportError: a missing run, checkpoint or step; the message is one line naming the argument.
  """
  import jax
  import numpy as np

  from vcpo_jax import fs, learner, sharding
  from vcpo_jax.checkpoint import Checkpointer
  from vcpo_jax.model import hf_io, lora, policy
  from vcpo_jax.run_config import parse_config

  config = run_config(workdir)
  spec = parse_config(config, check_prompts=False)
  if os.path.exists(out) and not os.path.isdir(out):
    raise ExportError(f"--out={out!r}: a file of that name exists; pass a directory")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)
  model_cfg, tokenizer, _, params = policy.build_policy(
    spec.model_cfg, mesh, seed=spec.seed, checkpoint=spec.model_checkpoint, tokenizer_dir=spec.tokenizer_dir
  )
  ckpt = Checkpointer(fs.join(workdir, "checkpoints"))
  try:
    chosen = _pick_step(ckpt, step, workdir)
    leaves = ckpt.restore_leaves(chosen)
  finally:
    ckpt.close()
  # The saved tree is {"queued": [...], "train": TrainState, "versions": [...]} flattened in that (sorted) key
  # order; TrainState's first field is the parameters, and `versions` holds one parameter tree per version.
  tx = spec.optim.build(total_steps=spec.steps)
  n_train = len(jax.tree.leaves(jax.eval_shape(lambda p: learner.init_state(p, tx), params)))
  param_leaves, treedef = jax.tree.flatten(params)
  n_params = len(param_leaves)
  n_kept = len(jax.tree.leaves(lora.split(params)[0]))  # a kept lag version: the trainable part (LoRA: adapters)
  n_versions = (len(leaves) - n_train) // n_kept if len(leaves) >= n_train else -1
  start = len(leaves) - n_train - n_versions * n_kept
  if n_versions < 0 or start < 0:
    raise ExportError(
      f"--workdir={workdir!r}: the checkpoint at step {chosen} holds {len(leaves)} arrays, which the run's "
      "config.json cannot account for; export with the code version that trained it"
    )
  saved = [np.asarray(x) for x in leaves[start : start + n_params]]
  for i, (a, b) in enumerate(zip(saved, param_leaves)):
    if a.shape != b.shape:
      raise ExportError(f"--workdir={workdir!r}: parameter #{i} has shape {a.shape}, the config says {b.shape}")
  trained = jax.tree.unflatten(treedef, saved)
  if model_cfg.lora:
    hf_io.save_peft_adapter(trained, model_cfg, os.path.join(out, "adapter"), base_model=spec.model_checkpoint)
  base_cfg, merged = lora.merge_into_base(trained, model_cfg)  # the plain model (unchanged without LoRA)
  hf_io.save_hf(merged, base_cfg, out, tokenizer=tokenizer)
  _write_generation_config(out, tokenizer, spec)
  prompt = example_prompt(spec)
  _write_model_card(out, workdir, chosen, step, spec, prompt)
  return {"step": chosen, "out": os.fspath(out), "snippet": snippet(out, prompt, spec.rollout.chat_template)}


def _write_generation_config(out: str, tokenizer, spec):
  """generation_config.json: stop / pad ids and the run's training sampler (greedy when it sampled so), with
  the training response budget: `generate` on an export samples as the run's rollouts did."""
  from transformers import GenerationConfig

  s = spec.sampling
  greedy = s.temperature == 0.0
  gen = GenerationConfig(
    eos_token_id=tokenizer.eos_token_id,
    pad_token_id=tokenizer.pad_token_id,
    bos_token_id=tokenizer.bos_token_id,
    do_sample=not greedy,
    temperature=None if greedy else float(s.temperature),
    top_p=None if greedy else float(s.top_p),
    top_k=None if greedy else int(s.top_k),  # 0 = off, as in the sampler
    max_new_tokens=int(spec.config.task.max_new_tokens),
  )
  gen.save_pretrained(out)


def example_prompt(spec) -> str:
  """The first held-out prompt the run's task makes (its template filled in), e.g. countdown's `[12, 7]>19:`."""
  problems = spec.make_eval_problems()
  return problems[0].prompt if problems else ""


def snippet(out: str, prompt: str, chat_template: bool = False) -> str:
  """Three lines of Python that load the export with transformers and print one answer to `prompt`.

  The pipeline reads generation_config.json (the run's sampling and response budget); with the run's chat
  template the prompt goes in as one user turn, which the pipeline wraps as the run did."""
  path = os.path.abspath(out)
  query = repr([{"role": "user", "content": prompt}]) if chat_template else repr(prompt)
  answer = '[0]["generated_text"]' + ("[-1][\"content\"]" if chat_template else "")
  return (
    "from transformers import pipeline\n"
    f"generate = pipeline(\"text-generation\", model={path!r})\n"
    f"print(generate({query}, return_full_text=False){answer})"
  )


def _write_model_card(out: str, workdir: str, step: int, asked, spec, prompt: str):
  """README.md (the model card) and vcpo_config.json (the run's config.json as it is)."""
  from vcpo_jax import fs

  record = fs.read_text(fs.join(workdir, "config.json"))
  with open(os.path.join(out, "vcpo_config.json"), "w") as f:
    f.write(record)
  c = spec.config
  method = choices.describe(c.method)
  which = {None: "the newest", "": "the newest", "best": "the best-ranked"}.get(asked, "the requested")
  s, e = spec.sampling, spec.eval
  eval_sampling = "greedy" if e.greedy else f"temperature {e.temperature}, top_p {e.top_p}"
  template = c.task.template or "(the task's default template)"
  model = c.model.checkpoint or f"{c.model.preset} (random init)"
  lines = [
    f"# {method} on {c.task.name}: a vcpo_jax export",
    "",
    f"- Source run: `{os.path.abspath(workdir) if '://' not in workdir else workdir}`, {which} checkpoint,",
    f"  step {step} of {c.steps}; the run's full config is `vcpo_config.json` (config.json of the run).",
    f"- Config: method `{method}`, mode `{c.mode}` (k = {c.lag.k}), task `{c.task.name}`, model {model},",
    f"  seed {c.seed}, lr {c.optim.lr}.",
    f"- Prompt format: the task's template `{template}` filled per problem"
    + (", wrapped in the tokenizer's chat template (one user turn)" if spec.rollout.chat_template else "")
    + f"; e.g. `{prompt}`.",
    f"- `generation_config.json`: the run's training sampler (temperature {s.temperature}, top_p {s.top_p},",
    f"  top_k {s.top_k}, up to {c.task.max_new_tokens} new tokens, stop at EOS); the run evaluated with",
    f"  {eval_sampling}, up to {e.max_new_tokens} new tokens.",
    "",
    "Try it (`pip install -e .[hf]` in vcpo_jax brings torch, transformers and safetensors):",
    "",
    "```python",
    snippet(out, prompt, spec.rollout.chat_template),
    "```",
    "",
  ]
  with open(os.path.join(out, "README.md"), "w") as f:
    f.write("\n".join(lines))


def main(argv=None) -> int:
  import argparse

  parser = argparse.ArgumentParser(prog="python -m vcpo_jax.export", description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="the run's directory (main.py --workdir)")
  parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
  parser.add_argument("--step", default=None, help="a kept checkpoint step, or 'best' (default: the newest)")

  def error(message):  # argparse prints the usage too; one line is the house rule
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)

  parser.error = error
  args = parser.parse_args(argv)
  from vcpo_jax.run_config import ConfigError

  try:
    result = export(args.workdir, args.out, args.step)
  except (ExportError, ConfigError) as e:
    error(str(e).splitlines()[0])
  print(f"exported step {result['step']} of {args.workdir} to {result['out']}; try it (pip install -e .[hf]):")
  print(result["snippet"])
  return 0


if __name__ == "__main__":
  sys.exit(main())
