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
  generation_config.json                 eos / pad ids and the run's evaluation sampling (temperature, top_p)

`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load it;
its logits and greedy generations equal the run's policy's. A bad argument is one line on stderr, exit 2.
"""

from __future__ import annotations

import json
import os
import sys

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
  return {"step": chosen, "out": os.fspath(out)}


def _write_generation_config(out: str, tokenizer, spec):
  """generation_config.json: stop / pad ids and the run's evaluation sampling (greedy when it evaluated so)."""
  from transformers import GenerationConfig

  p = spec.eval
  gen = GenerationConfig(
    eos_token_id=tokenizer.eos_token_id,
    pad_token_id=tokenizer.pad_token_id,
    bos_token_id=tokenizer.bos_token_id,
    do_sample=not p.greedy,
    temperature=None if p.greedy else float(p.temperature),
    top_p=None if p.greedy else float(p.top_p),
    top_k=None if p.greedy else 0,
    max_new_tokens=int(p.max_new_tokens),
  )
  gen.save_pretrained(out)


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
  print(f"exported step {result['step']} of {args.workdir} to {result['out']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
