"""Generation throughput: vcpo_jax.sampler vs transformers' PyTorch `generate`, side by side.

    python -m benchmarks.sampler                      # batch 16, prompt 32, new 128, 5 rounds, all cores
    python -m benchmarks.sampler --batch 16 --prompt 32 --new 128 --rounds 5 --models tiny,small --threads 2

Both sides get the same tiny Qwen2 config and weights (a random transformers
Qwen2ForCausalLM, copied into our model with `hf_io.params_from_hf`; the logits
difference is printed), the same prompts (no padding), the same sampling settings,
and always generate exactly `--new` tokens (no EOS).

Fairness: both sides get the SAME threads. The process is pinned to `--threads`
cores (os.sched_setaffinity, before jax starts, so XLA's thread pool sees only
those cores) and torch runs `torch.set_num_threads(--threads)`. After one warm-up
call per side (ours includes the compile, reported separately), the sides run
interleaved, round by round (ours, theirs, ours, theirs, ...), so a change of
machine load hits both; each round gives one ratio theirs/ours, and the table
reports the median and range of the per-round ratios, with the load average.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _pin_threads(argv) -> int:
  """Pins this process to the first --threads cores before jax/torch start; returns the count."""
  threads = os.cpu_count() or 1
  args = list(sys.argv[1:] if argv is None else argv)
  for i, a in enumerate(args):
    if a.startswith("--threads"):
      threads = int(a.split("=", 1)[1] if "=" in a else args[i + 1])
  if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
  return threads


if __name__ == "__main__":
  _THREADS = _pin_threads(None)

import jax
import numpy as np
import torch
import transformers

from vcpo_jax import sampler as S
from vcpo_jax.model import config, hf_io, transformer as tf

MODELS = {
  # The test preset: 2 layers, D = 64, V = 256 (~0.1M parameters).
  "tiny": lambda: config.tiny_qwen2(),
  # A larger CPU model: 4 layers, D = 256, V = 8192 (~4.5M parameters).
  "small": lambda: config.tiny_qwen2(
    vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32
  ),
}
SETTINGS = {
  "temp1.0": dict(temperature=1.0, top_k=0, top_p=1.0),  # the RL setting (behavior = policy)
  "temp0.8_top_p0.9": dict(temperature=0.8, top_k=0, top_p=0.9),
}


def build_pair(cfg, seed=0):
  """(hf_model, graphdef, params) holding identical random weights."""
  torch.manual_seed(seed)
  hf = transformers.Qwen2ForCausalLM(hf_io.hf_config(cfg)).eval()
  with torch.no_grad():  # non-zero biases so that the copy of every tensor is exercised
    for name, p in hf.named_parameters():
      if name.endswith(".bias"):
        p.normal_(0.0, 0.02)
  tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
  graphdef, params = tf.split(hf_io.params_from_hf(tensors, cfg))
  return hf, graphdef, params


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def interleaved(ours, theirs, rounds: int) -> tuple[list[float], list[float]]:
  """Runs ours and theirs alternately `rounds` times; returns both lists of wall times."""
  t_ours, t_theirs = [], []
  for _ in range(rounds):
    t_ours.append(_timed(ours))
    t_theirs.append(_timed(theirs))
  return t_ours, t_theirs


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--prompt", type=int, default=32)
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (one call per side each)")
  ap.add_argument("--models", default="tiny,small")
  ap.add_argument("--settings", default=",".join(SETTINGS))
  ap.add_argument("--threads", type=int, default=os.cpu_count(), help="cores (and torch threads) for BOTH sides")
  args = ap.parse_args(argv)
  if argv is not None:  # called as a function: pin here (jax may already run; then only torch is limited)
    _pin_threads(argv)
  torch.set_num_threads(args.threads)
  b, tp, tn = args.batch, args.prompt, args.new
  cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
  print(
    f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
    f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
    f"cores {cores} of {os.cpu_count()}; batch {b}, prompt {tp}, new {tn}, {args.rounds} interleaved rounds"
  )
  rows = []
  for model_name in args.models.split(","):
    cfg = MODELS[model_name]()
    hf, graphdef, params = build_pair(cfg)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, cfg.vocab_size, (b, tp))
    valid = np.ones((b, tp), bool)
    ours_logits = np.asarray(jax.jit(hf_io._logits, static_argnums=0)(graphdef, params, prompts, valid))
    with torch.inference_mode():
      hf_logits = hf(torch.as_tensor(prompts)).logits.numpy()
    parity = float(np.abs(ours_logits - hf_logits).max())
    for setting in args.settings.split(","):
      kw = SETTINGS[setting]
      smp = S.Sampler(
        graphdef,
        cfg,
        S.SamplerConfig(
          **kw, eos_id=None, max_new_tokens=tn, prompt_buckets=(tp,), new_token_buckets=(tn,), batch_buckets=(b,)
        ),
      )
      prompt_lists = prompts.tolist()
      key = jax.random.key(0)
      t0 = time.perf_counter()
      out = smp.generate(params, prompt_lists, key)
      first_call = time.perf_counter() - t0
      assert (out.lengths == tn).all()
      compile_s = first_call - _timed(lambda: smp.generate(params, prompt_lists, key))

      ids = torch.as_tensor(prompts)
      # top_k=0 must be explicit: None falls back to transformers' default top_k=50.
      gen_kw = dict(
        do_sample=True,
        max_new_tokens=tn,
        eos_token_id=None,
        pad_token_id=0,
        temperature=kw["temperature"],
        top_k=kw["top_k"],
        top_p=kw["top_p"],
      )

      def hf_generate():
        with torch.inference_mode():
          res = hf.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw)
        assert res.shape == (b, tp + tn)

      torch.manual_seed(0)
      hf_generate()  # warm-up
      load_before = os.getloadavg()[0]
      t_ours, t_hf = interleaved(lambda: smp.generate(params, prompt_lists, key), hf_generate, args.rounds)
      ratios = [h / o for o, h in zip(t_ours, t_hf)]
      ours, theirs = float(np.median(t_ours)), float(np.median(t_hf))
      rows.append(
        dict(
          model=model_name,
          params=cfg.num_params,
          setting=setting,
          batch=b,
          prompt=tp,
          new=tn,
          ours_s=ours,
          hf_s=theirs,
          ours_tok_s=b * tn / ours,
          hf_tok_s=b * tn / theirs,
          threads=args.threads,
          ours_round_s=t_ours,
          hf_round_s=t_hf,
          speedup=float(np.median(ratios)),
          speedup_min=min(ratios),
          speedup_max=max(ratios),
          load_avg=[load_before, os.getloadavg()[0]],
          compile_s=compile_s,
          logits_max_abs_diff=parity,
        )
      )

  hdr = (
    f"{'model':6} {'params':>8} {'setting':17} {'ours tok/s':>11} {'HF tok/s':>10} {'thr':>3} {'speedup':>8} "
    f"{'range':>13} {'load':>9} {'compile s':>9} {'|dlogits|':>9}"
  )
  print(hdr)
  print("-" * len(hdr))
  for r in rows:
    print(
      f"{r['model']:6} {r['params']:>8} {r['setting']:17} {r['ours_tok_s']:>11.0f} {r['hf_tok_s']:>10.0f} {r['threads']:>3} "
      f"{r['speedup']:>7.2f}x {r['speedup_min']:>5.2f}-{r['speedup_max']:<5.2f}x "
      f"{r['load_avg'][0]:>4.1f}-{r['load_avg'][1]:<4.1f} {r['compile_s']:>9.2f} {r['logits_max_abs_diff']:>9.1e}"
    )
  print(
    json.dumps(
      dict(benchmark="sampler", goal_speedup=1.5, min_median_speedup=min(r["speedup"] for r in rows), rows=rows)
    )
  )


if __name__ == "__main__":
  main()
