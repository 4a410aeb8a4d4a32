"""Compile seconds against depth: the learner step, the sampler's generate and the initializer.

    python -m benchmarks.compile_time                                  # 2, 8, 28 layers, every part
    python -m benchmarks.compile_time --layers=2,28 --parts=learner,init
    python -m benchmarks.compile_time --unrolled                        # model.scan_layers=False, for comparison

The released config's architecture (--config, default gsm8k: the Qwen2.5-1.5B widths, hidden 1536, 12 heads,
2 kv heads, MLP 8960, vocab 151936) at each depth of --layers, on one device. Nothing is allocated: every
input is abstract (jax.ShapeDtypeStruct / eval_shape) and each program is only lowered and compiled, as
benchmarks.memory compiles them:

  learner   the trainer's jitted learner step (the config's method, ghost norms, optimizer update), N rows
            of T tokens (--batch / --prompt_len / --new_tokens shrink them; 0: the config's).
  generate  `Sampler.lower(part="generate")`: prefill + the decode while_loop as `Sampler.generate` jits it,
            bfloat16 weights as on an accelerator.
  init      `policy.init_sharded`'s program: jit(init, out_shardings) of every parameter.

A warm-up compile (the initializer at 1 layer) runs first, so the first figure carries no one-off cost of
the process. Reported per part: lower and compile seconds at each depth and the ratio of the deepest to
the shallowest total (the goal: <= 1.5 with the layers scanned, `ModelConfig.scan_layers`). Seconds are
wall clock on whatever else the machine runs: the load average (os.getloadavg) is printed before and
after. The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import time

PARTS = ("learner", "generate", "init")


def _timed(lower):
  """(lower seconds, compile seconds) of lower() -> a jax Lowered."""
  t0 = time.perf_counter()
  lowered = lower()
  t1 = time.perf_counter()
  lowered.compile()
  return t1 - t0, time.perf_counter() - t1


def _init_lowering(model_cfg, mesh):
  """policy.init_sharded's jit(init, out_shardings), lowered (nothing drawn)."""
  import jax
  from flax import nnx

  from vcpo_jax import sharding
  from vcpo_jax.model import transformer

  _, abstract = transformer.split(nnx.eval_shape(lambda: transformer.init(model_cfg, 0)))
  shardings = sharding.param_shardings(abstract, sharding.TRANSFORMER_RULES, mesh)
  return jax.jit(lambda: transformer.split(transformer.init(model_cfg, 0))[1], out_shardings=shardings).lower()


def _learner_lowering(setting, model_cfg, mesh):
  """benchmarks.memory.compile_learner's step, lowered."""
  import jax

  from benchmarks import memory
  from vcpo_jax import batch as batch_lib
  from vcpo_jax import learner, sharding

  spec = setting.spec
  tx = memory._optimizer(spec)
  graphdef, abs_params = memory._abstract_params(model_cfg)
  abs_state = jax.eval_shape(lambda p: learner.init_state(p, tx), abs_params)
  state_sh = sharding.param_shardings(abs_state, sharding.TRANSFORMER_RULES, mesh)
  batch_sh = sharding.batch_sharding(mesh)
  keys = batch_lib.DEVICE_KEYS
  abs_batch = {
    k: memory._sds(s, d, batch_sh) for k, (d, s) in batch_lib.schema(setting.n, setting.t).items() if k in keys
  }
  lc = memory.learner_config(spec, mesh, setting.n, model_cfg, setting.t)
  step = jax.jit(
    learner.make_train_step(graphdef, tx, lc),
    in_shardings=(state_sh, batch_sh),
    out_shardings=(state_sh, sharding.replicated(mesh)),
    donate_argnums=0,
  )
  with jax.set_mesh(mesh):
    return step.lower(abs_state, abs_batch)


def _generate_lowering(setting, model_cfg, mesh):
  """benchmarks.memory.compile_sampler's "sampler" program (Sampler.generate's jit), lowered."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  from benchmarks import memory
  from vcpo_jax import sampler

  graphdef, abs_params = memory._abstract_params(model_cfg)
  scfg = dataclasses.replace(setting.sampler_cfg, param_dtype="bfloat16")
  cast = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype)
  smp = sampler.Sampler(graphdef, model_cfg, scfg, mesh=mesh)
  b = setting.sampler_b
  return smp.lower(jax.tree.map(cast, abs_params), b, setting.sampler_tp, setting.sampler_tn, part="generate")


def measure(setting, parts, depths, scan: bool) -> dict:
  """{part: {depth: (lower s, compile s)}} on one device."""
  import jax

  from benchmarks import memory

  mesh = memory._mesh((1, 1, 1), jax.devices()[:1])
  base = setting.model_cfg.replace(scan_layers=scan)
  _timed(lambda: _init_lowering(base.replace(num_layers=1), mesh))  # warm-up
  build = {"learner": _learner_lowering, "generate": _generate_lowering}
  out = {}
  for part in parts:
    out[part] = {}
    for depth in depths:
      cfg = base.replace(num_layers=depth)
      if part == "init":
        lower = lambda cfg=cfg: _init_lowering(cfg, mesh)
      else:
        lower = lambda cfg=cfg, part=part: build[part](setting, cfg, mesh)
      lo, co = _timed(lower)
      out[part][depth] = (lo, co)
      print(f"{part:9s} L={depth:3d}  lower {lo:7.2f} s  compile {co:7.2f} s  total {lo + co:7.2f} s", flush=True)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="gsm8k", help="configs/ name whose model.shape gives the widths")
  p.add_argument("--layers", default="2,8,28", help="comma-separated depths")
  p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
  p.add_argument("--batch", type=int, default=0, help="learner rows N (0 = the config's)")
  p.add_argument("--prompt_len", type=int, default=0, help="max prompt length (0 = the config's)")
  p.add_argument("--new_tokens", type=int, default=0, help="response budget (0 = the config's)")
  p.add_argument("--unrolled", action="store_true", help="model.scan_layers=False (the layers unrolled)")
  args = p.parse_args(argv)
  from benchmarks import memory

  parts = [x for x in args.parts.split(",") if x]
  unknown = set(parts) - set(PARTS)
  if unknown:
    raise SystemExit(f"--parts: unknown {sorted(unknown)}; choose from {PARTS}")
  depths = sorted(int(x) for x in args.layers.split(","))
  setting = memory.load_setting(args.config, batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
  load = [os.getloadavg()]
  print(
    f"{args.config}: D={setting.model_cfg.hidden_size} F={setting.model_cfg.intermediate_size} "
    f"V={setting.model_cfg.vocab_size}, learner N={setting.n} T={setting.t}, sampler B={setting.sampler_b} "
    f"Tp={setting.sampler_tp} Tn={setting.sampler_tn}, scan_layers={not args.unrolled}, load {load[0]}",
    flush=True,
  )
  out = measure(setting, parts, depths, scan=not args.unrolled)
  load.append(os.getloadavg())
  ratios = {part: sum(r[depths[-1]]) / sum(r[depths[0]]) for part, r in out.items()}
  for part, ratio in ratios.items():
    print(f"{part:9s} {depths[-1]}/{depths[0]} layers: {ratio:.2f}x (goal <= 1.5x)")
  print(f"load average before / after: {load[0]} / {load[1]}")
  result = {
    "config": args.config,
    "scan_layers": not args.unrolled,
    "seconds": {part: {str(d): {"lower": v[0], "compile": v[1]} for d, v in r.items()} for part, r in out.items()},
    "ratio": ratios,
    "load": load,
  }
  print(json.dumps(result))


if __name__ == "__main__":
  main()
