"""Generation throughput: vcpo_jax.sampler against this machine's roofline and transformers' `generate`.

    python -m benchmarks.sampler                      # 10M-parameter model, batch 64, prompt 32, new 128, 3 rounds
    python -m benchmarks.sampler --batch 64 --prompt 32 --new 128 --rounds 3 --models 10m --threads 2
    python -m benchmarks.sampler --threads 2 --devices 2  # our sampler on 2 host devices of the 2 cores
    python -m benchmarks.sampler --threads 2 --decode_layers unrolled  # per-layer cache buffers in the decode step
    python -m benchmarks.sampler --threads 2 --matmul_floor  # the step's matmuls alone: the fraction's ceiling

Roofline (issue 14 item 2), measured in the same process just before and just after each of our timed
calls (a round's roofline is the mean of the two; the fraction is reported per round, median and range: on a
shared machine it moves with the load, so one measurement before all rounds mis-stated it), and once at the
start for the printed header: peak matmul
FLOP/s (best of a large jitted float32 dot) and copy bandwidth (best numpy copy of 256 MiB,
read + write bytes). A generate call's roofline time is the sum over its passes (one prefill,
`new - 1` decode steps) of max(FLOPs / peak, bytes / bandwidth) with FLOPs = 2 x params x
tokens + attention (4 x layers x heads x head_dim x context per token) and bytes = the
parameters plus the KV cache read (and written) per pass; `roofline` = that time / the
measured time (1.0 = as fast as the machine allows).

Our sampler holds the weights as a run does (`--param_dtype`, default "auto": bf16 on accelerators, float32
on CPU, where XLA computes bf16 dots in float32 and a run keeps float32), and the roofline counts the bytes
of the weights as held. Both sides get the same tiny Qwen2 config and weights (a random transformers
Qwen2ForCausalLM, copied into our model with `hf_io.params_from_hf`; the logits
difference is printed), the same prompts (no padding), the same sampling settings,
and always generate exactly `--new` tokens (no EOS). `--draws` also times the
earlier Gumbel draw (SamplerConfig.draw="gumbel") for the before/after of the token choice.

`--devices N` runs our sampler on N host devices of the same cores (a (N, 1, 1) data mesh:
`--xla_force_host_platform_device_count=N`, the batch split over them, the weights replicated),
as a sampler process on its own devices does; the roofline and transformers keep the process's
`--threads` cores. On 2 cores, 2 devices keep both busy through the small decode matmuls, which
XLA's intra-op threads split poorly at batch 64.

Fairness: both sides get the SAME threads. The process is pinned to `--threads`
cores (os.sched_setaffinity, before jax starts, so XLA's thread pool sees only
those cores) and torch runs `torch.set_num_threads(--threads)`. After one warm-up
call per side (ours includes the compile, reported separately), the sides run
interleaved, round by round (ours, theirs, ours, theirs, ...), so a change of
machine load hits both; each round gives one ratio theirs/ours, and the table
reports the median and range of the per-round ratios, with the load average
(`os.getloadavg`, as `uptime` prints it) before and after: the machine may be shared.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import functools
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


def _host_devices(argv) -> int:
  """--devices N: N host devices for the sampler (XLA_FLAGS, set before jax starts); returns N."""
  args = list(sys.argv[1:] if argv is None else argv)
  n = 1
  for i, a in enumerate(args):
    if a.startswith("--devices"):
      n = int(a.split("=", 1)[1] if "=" in a else args[i + 1])
  if n > 1:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
  return n


if __name__ == "__main__":
  _THREADS = _pin_threads(None)
  _host_devices(None)

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from vcpo_jax import mesh as mesh_lib
from vcpo_jax import sampler as S
from vcpo_jax.model import config, hf_io
from vcpo_jax.model import transformer as tf

MODELS = {
  # The test preset: 2 layers, D = 64, V = 256 (~0.1M parameters).
  "tiny": lambda: config.tiny_qwen2(),
  # A larger CPU model: 4 layers, D = 256, V = 8192 (~4.5M parameters).
  "small": lambda: config.tiny_qwen2(
    vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32
  ),
  # The issue-14 measurement shape (benchmarks/grad_norms.py's model): 10 layers, D = 256, V = 8192 (9.97M).
  "10m": lambda: config.tiny_qwen2(
    vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=10, num_heads=4, num_kv_heads=2, head_dim=64
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


def measure_roofline(dim: int = 2048, copy_mib: int = 256, repeats: int = 5) -> dict:
  """Peak float32 matmul FLOP/s (a jitted [dim, dim] x [dim, dim] dot, best of `repeats`) and copy
  bandwidth in bytes/s (numpy copy of `copy_mib` MiB, read + write, best of `repeats`)."""
  a = jax.random.normal(jax.random.key(0), (dim, dim), jnp.float32)
  dot = jax.jit(lambda x: x @ x)
  jax.block_until_ready(dot(a))
  t_dot = min(_timed(lambda: jax.block_until_ready(dot(a))) for _ in range(repeats))
  src = np.ones(copy_mib * 2**20 // 4, np.float32)
  dst = np.empty_like(src)
  np.copyto(dst, src)
  t_copy = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
  return dict(peak_flops=2 * dim**3 / t_dot, bandwidth=2 * src.nbytes / t_copy)


def roofline_seconds(cfg, batch: int, prompt: int, new: int, peak_flops: float, bandwidth: float, weight_bytes=None):
  """Lower bound on one generate call: per pass max(FLOPs / peak, bytes / bandwidth), summed (see docstring).

  weight_bytes: the parameters as the sampler holds them (default: float32, 4 bytes each); the KV cache is in
  the model's compute dtype."""
  n, l, kvh = cfg.num_params, cfg.num_layers, cfg.num_kv_heads * cfg.head_dim
  qh = cfg.num_heads * cfg.head_dim
  kv_bytes_per_token = 2 * l * kvh * jnp.dtype(cfg.compute_dtype).itemsize  # k and v
  weight_bytes = 4 * n if weight_bytes is None else weight_bytes

  def one_pass(tokens_per_row: int, context: int) -> float:
    flops = batch * tokens_per_row * (2 * n + 4 * l * qh * context)
    data = weight_bytes + batch * kv_bytes_per_token * (context + tokens_per_row)
    return max(flops / peak_flops, data / bandwidth)

  t = one_pass(prompt, prompt // 2)  # prefill: causal, mean context prompt / 2
  t += sum(one_pass(1, prompt + i) for i in range(1, new))
  return t


def _choice_step(x, keys, i, cfg):
  return S._choose(x, jax.vmap(lambda k: jax.random.fold_in(k, i))(keys), cfg)


def time_choice(batch: int, vocab: int, steps: int = 50, repeats: int = 5) -> list[dict]:
  """Milliseconds per token choice (`sampler._choose` alone, jitted) on random [batch, vocab] logits, per
  draw and filter setting: the share of a decode step the draw costs (median of `repeats` x `steps` calls)."""
  x = 3.0 * jax.random.normal(jax.random.key(1), (batch, vocab))
  keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(0), r))(jnp.arange(batch))
  out = []
  for filt in (dict(), dict(top_p=0.9), dict(temperature=0.8, top_p=0.7)):
    for draw in S.DRAWS:
      cfg = S.SamplerConfig(draw=draw, **filt)
      f = jax.jit(functools.partial(_choice_step, cfg=cfg))
      jax.block_until_ready(f(x, keys, 0))

      def run(f=f):
        for i in range(steps):
          o = f(x, keys, i)
        jax.block_until_ready(o)

      ms = [1e3 * _timed(run) / steps for _ in range(repeats)]
      out.append(dict(draw=draw, filter=filt, ms=float(np.median(ms)), ms_min=min(ms), ms_max=max(ms)))
      print(
        f"choice B={batch} V={vocab} {draw:11} {str(filt):36} {out[-1]['ms']:8.2f} ms ({min(ms):.2f}-{max(ms):.2f})"
      )
  return out


def matmul_floor(cfg, batch: int, prompt: int, new: int, rounds: int) -> dict:
  """The fraction of the roofline that the decode step's matmuls alone reach: `new - 1` steps of only the
  model's dots (per layer q, k, v, o, gate, up, down; the tied head), float32, each layer's weights its own
  buffer, the hidden state carried through a fori_loop, against the roofline of the whole `generate` call
  (`roofline_seconds`) measured just before and after each round. No attention, cache, norm or token choice:
  an upper bound on what `generate` can reach with this machine's dots (the goal 0.5 needs the rest of the
  step to fit in the difference)."""
  d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  keys = iter(jax.random.split(jax.random.key(0), 8 * cfg.num_layers + 2))
  w = lambda *shape: 0.05 * jax.random.normal(next(keys), shape, jnp.float32)
  layers = [
    dict(q=w(d, q), k=w(d, kv), v=w(d, kv), o=w(q, d), g=w(d, f), u=w(d, f), dn=w(f, d)) for _ in range(cfg.num_layers)
  ]
  embed = w(cfg.vocab_size, d)

  @jax.jit
  def steps(x0, layers, embed):
    def body(_, x):
      for p in layers:
        a = x @ p["q"] + 1e-3 * ((x @ p["k"]).sum(-1, keepdims=True) + (x @ p["v"]).sum(-1, keepdims=True))
        x = x + a @ p["o"]
        x = x + (jax.nn.silu(x @ p["g"]) * (x @ p["u"])) @ p["dn"]
      return x + 1e-3 * jnp.einsum("bd,vd->bv", x, embed)[:, :d]  # the tied head, as `Embed.attend`

    return jax.lax.fori_loop(0, new - 1, body, x0)

  x0 = jax.random.normal(next(keys), (batch, d), jnp.float32)
  jax.block_until_ready(steps(x0, layers, embed))
  roofs, times = [], []
  for _ in range(rounds):
    r0 = measure_roofline()
    times.append(_timed(lambda: jax.block_until_ready(steps(x0, layers, embed))))
    r1 = measure_roofline()
    roofs.append(float(np.mean([roofline_seconds(cfg, batch, prompt, new, **r) for r in (r0, r1)])))
  fracs = [r / t for r, t in zip(roofs, times)]
  step_ms = [1e3 * t / (new - 1) for t in times]
  return dict(
    fraction=float(np.median(fracs)),
    fraction_min=min(fracs),
    fraction_max=max(fracs),
    step_ms=float(np.median(step_ms)),
    round_s=times,
    roofline_round_s=roofs,
  )


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def interleaved(ours, theirs, rounds: int, yardstick=None):
  """Runs ours and theirs alternately `rounds` times; returns both lists of wall times, and with a yardstick
  (e.g. `measure_roofline`) a third list: per round (its result just before ours, just after ours)."""
  t_ours, t_theirs, sticks = [], [], []
  for _ in range(rounds):
    before = None if yardstick is None else yardstick()
    t_ours.append(_timed(ours))
    if yardstick is not None:
      sticks.append((before, yardstick()))
    t_theirs.append(_timed(theirs))
  return (t_ours, t_theirs) if yardstick is None else (t_ours, t_theirs, sticks)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--prompt", type=int, default=32)
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (one call per side each)")
  ap.add_argument("--models", default="10m")
  ap.add_argument("--settings", default="temp1.0")
  ap.add_argument("--draws", default="inverse_cdf", help="SamplerConfig.draw values to time (e.g. inverse_cdf,gumbel)")
  ap.add_argument("--threads", type=int, default=os.cpu_count(), help="cores (and torch threads) for BOTH sides")
  ap.add_argument(
    "--param_dtype",
    default="auto",
    help="SamplerConfig.param_dtype of our sampler: auto (as a run: bf16 on accelerators, float32 on CPU)",
  )
  ap.add_argument(
    "--decode_layers",
    default="scan",
    help="SamplerConfig.decode_layers of our sampler: scan (default) or unrolled (per-layer cache buffers)",
  )
  ap.add_argument("--choice", action="store_true", help="only time the token choice (batch x the model's vocab)")
  ap.add_argument(
    "--matmul_floor",
    action="store_true",
    help="only time the decode step's matmuls (no attention, cache or sampling) against generate's roofline",
  )
  ap.add_argument(
    "--devices",
    type=int,
    default=1,
    help="host devices of our sampler: a (N, 1, 1) data mesh, the batch split over them (the same --threads cores)",
  )
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
  if args.choice:
    load = os.getloadavg()[0]
    rows = time_choice(b, MODELS[args.models.split(",")[0]]().vocab_size)
    print(json.dumps(dict(benchmark="sampler_choice", load_avg=[load, os.getloadavg()[0]], rows=rows)))
    return
  if args.matmul_floor:
    load = os.getloadavg()[0]
    rows = []
    for name in args.models.split(","):
      rows.append(dict(model=name, batch=b, prompt=tp, new=tn, **matmul_floor(MODELS[name](), b, tp, tn, args.rounds)))
      r = rows[-1]
      print(
        f"{name}: matmuls only {r['step_ms']:.2f} ms/step, {r['fraction']:.2f} ({r['fraction_min']:.2f}-"
        f"{r['fraction_max']:.2f}) of generate's roofline"
      )
    print(json.dumps(dict(benchmark="sampler_matmul_floor", load_avg=[load, os.getloadavg()[0]], rows=rows)))
    return
  load_start = os.getloadavg()
  roof = measure_roofline()
  print(
    f"roofline: peak matmul {roof['peak_flops'] / 1e9:.1f} GFLOP/s, copy bandwidth {roof['bandwidth'] / 1e9:.1f} GB/s "
    f"(load average {load_start[0]:.1f})"
  )
  if len(jax.devices()) != args.devices:
    raise SystemExit(
      f"--devices={args.devices}: jax sees {len(jax.devices())} devices; run as python -m benchmarks.sampler"
    )
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((args.devices, 1, 1))) if args.devices > 1 else None
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
    for setting, draw in [(st, d) for st in args.settings.split(",") for d in args.draws.split(",")]:
      kw = SETTINGS[setting]
      smp = S.Sampler(
        graphdef,
        cfg,
        S.SamplerConfig(
          **kw,
          draw=draw,
          eos_id=None,
          max_new_tokens=tn,
          prompt_buckets=(tp,),
          new_token_buckets=(tn,),
          batch_buckets=(b,),
          mesh_shape=(args.devices, 1, 1),
          param_dtype=args.param_dtype,
          decode_layers=args.decode_layers,
        ),
        mesh=mesh,
      )
      # Cast and placed (replicated) on the sampler's mesh once, as a sampler does with a published version.
      ours_params = smp.prepare_params(params)
      weight_bytes = sum(x.nbytes for x in jax.tree.leaves(ours_params))
      prompt_lists = prompts.tolist()
      key = jax.random.key(0)
      t0 = time.perf_counter()
      out = smp.generate(ours_params, prompt_lists, key)
      first_call = time.perf_counter() - t0
      assert (out.lengths == tn).all()
      compile_s = first_call - _timed(lambda: smp.generate(ours_params, prompt_lists, key))

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
      t_ours, t_hf, sticks = interleaved(
        lambda: smp.generate(ours_params, prompt_lists, key), hf_generate, args.rounds, measure_roofline
      )
      ratios = [h / o for o, h in zip(t_ours, t_hf)]
      ours, theirs = float(np.median(t_ours)), float(np.median(t_hf))
      # Each round's roofline: the mean of the two measured just before and just after our call.
      roof_s = lambda r: roofline_seconds(cfg, b, tp, tn, r["peak_flops"], r["bandwidth"], weight_bytes)
      t_roofs = [(roof_s(r0) + roof_s(r1)) / 2 for r0, r1 in sticks]
      fracs = [t / o for t, o in zip(t_roofs, t_ours)]
      t_roof = float(np.median(t_roofs))
      rows.append(
        dict(
          model=model_name,
          params=cfg.num_params,
          setting=setting,
          draw=draw,
          roofline=float(np.median(fracs)),
          roofline_min=min(fracs),
          roofline_max=max(fracs),
          roofline_round_s=t_roofs,
          hf_roofline=t_roof / theirs,
          roofline_tok_s=b * tn / t_roof,
          batch=b,
          prompt=tp,
          new=tn,
          ours_s=ours,
          hf_s=theirs,
          ours_tok_s=b * tn / ours,
          hf_tok_s=b * tn / theirs,
          threads=args.threads,
          devices=args.devices,
          param_dtype=str(jax.tree.leaves(ours_params)[0].dtype),
          decode_layers=args.decode_layers,
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
    f"{'model':6} {'params':>8} {'setting':17} {'draw':11} {'ours tok/s':>11} {'roofline':>14} {'HF tok/s':>10} "
    f"{'thr':>3} {'dev':>3} {'speedup':>8} {'range':>13} {'load':>9} {'compile s':>9} {'|dlogits|':>9}"
  )
  print(hdr)
  print("-" * len(hdr))
  for r in rows:
    print(
      f"{r['model']:6} {r['params']:>8} {r['setting']:17} {r['draw']:11} {r['ours_tok_s']:>11.0f} "
      f"{r['roofline']:>5.2f} ({r['roofline_min']:.2f}-{r['roofline_max']:.2f}) {r['hf_tok_s']:>10.0f} {r['threads']:>3} {r['devices']:>3} "
      f"{r['speedup']:>7.2f}x {r['speedup_min']:>5.2f}-{r['speedup_max']:<5.2f}x "
      f"{r['load_avg'][0]:>4.1f}-{r['load_avg'][1]:<4.1f} {r['compile_s']:>9.2f} {r['logits_max_abs_diff']:>9.1e}"
    )
  print(
    json.dumps(
      dict(
        benchmark="sampler",
        goal_speedup=1.5,
        goal_roofline=0.30,
        min_median_speedup=min(r["speedup"] for r in rows),
        min_median_roofline=min(r["roofline"] for r in rows),
        peak_flops=roof["peak_flops"],
        bandwidth=roof["bandwidth"],
        load_avg_start=list(load_start),
        load_avg_end=list(os.getloadavg()),
        rows=rows,
      )
    )
  )


if __name__ == "__main__":
  main()
