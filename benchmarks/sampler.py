"""Generation throughput: vcpo_jax.sampler vs transformers' PyTorch `generate`, side by side.

    python -m benchmarks.sampler                      # batch 16, prompt 32, new 128, best of 3
    python -m benchmarks.sampler --batch 16 --prompt 32 --new 128 --repeats 3 --models tiny,small

Both sides get the same tiny Qwen2 config and weights (a random transformers
Qwen2ForCausalLM, copied into our model with `hf_io.params_from_hf`; the logits
difference is printed), the same prompts (no padding), the same sampling settings,
and always generate exactly `--new` tokens (no EOS). Times are wall-clock per full
generate call, best of `--repeats` after one warm-up call (our warm-up includes the
compile, reported separately). tokens/s = batch * new / time. PyTorch is timed with
each of --torch-threads (default: 1 and torch's default count) and the fastest is used (on a shared,
loaded machine the multi-threaded OpenMP path can be 20x slower than one thread;
taking the best keeps the comparison conservative).
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

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


def best_of(fn, repeats):
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--prompt", type=int, default=32)
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--models", default="tiny,small")
  ap.add_argument("--settings", default=",".join(SETTINGS))
  ap.add_argument(
    "--torch-threads",
    default="1,default",
    help="PyTorch thread counts to try (the fastest is compared); 'default' = torch's own",
  )
  args = ap.parse_args(argv)
  b, tp, tn = args.batch, args.prompt, args.new
  print(
    f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
    f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
    f"cpus {os.cpu_count()}; batch {b}, prompt {tp}, new {tn}, best of {args.repeats}"
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
      ours = best_of(lambda: smp.generate(params, prompt_lists, key), args.repeats)

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
      default_threads = torch.get_num_threads()
      per_threads = {}
      thread_options = {default_threads if t == "default" else int(t) for t in args.torch_threads.split(",")}
      for threads in sorted(thread_options):
        torch.set_num_threads(threads)
        hf_generate()  # warm-up
        per_threads[threads] = best_of(hf_generate, args.repeats)
      torch.set_num_threads(default_threads)
      hf_threads = min(per_threads, key=per_threads.get)
      theirs = per_threads[hf_threads]
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
          hf_threads=hf_threads,
          hf_s_by_threads=per_threads,
          speedup=theirs / ours,
          compile_s=first_call - ours,
          logits_max_abs_diff=parity,
        )
      )

  hdr = (
    f"{'model':6} {'params':>8} {'setting':17} {'ours tok/s':>11} {'HF tok/s':>10} {'HF thr':>6} {'speedup':>8} "
    f"{'ours s':>7} {'HF s':>7} {'compile s':>9} {'|dlogits|':>9}"
  )
  print(hdr)
  print("-" * len(hdr))
  for r in rows:
    print(
      f"{r['model']:6} {r['params']:>8} {r['setting']:17} {r['ours_tok_s']:>11.0f} {r['hf_tok_s']:>10.0f} {r['hf_threads']:>6} "
      f"{r['speedup']:>7.2f}x {r['ours_s']:>7.3f} {r['hf_s']:>7.3f} {r['compile_s']:>9.2f} "
      f"{r['logits_max_abs_diff']:>9.1e}"
    )
  print(json.dumps(dict(benchmark="sampler", goal_speedup=1.5, min_speedup=min(r["speedup"] for r in rows), rows=rows)))


if __name__ == "__main__":
  main()
