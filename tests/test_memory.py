"""benchmarks/memory.py: compile-only memory of the learner and sampler steps on fake CPU devices.

Memory from compilation is deterministic (XLA's buffer assignment, not a timing). One driver run
(one worker subprocess with 8 fake devices) compiles a tiny-width, tiny-vocabulary version of configs/gsm8k.py
on meshes of 2 and 8 devices for the three parts (the learner at 1 layer, `--layers=1`; the sampler prefill
and decode at 2, `--sampler_layers=2`: the full 28 of the default doubles the run's time), at T = 32 + 32
tokens and at the T0 = 16 + 16 of batch_gib; the tests read its JSON line.
"""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import memory
from tests import xla_flags

pytestmark = pytest.mark.slow  # compile-only sizing of whole steps: long compiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tiny widths and vocabulary: the activations [N, T, D] still dominate what grows with the batch.
TINY = "hidden_size=64,intermediate_size=128,num_heads=4,num_kv_heads=2,head_dim=16,vocab_size=512"
GIB = 2.0**30
FIELDS = ("config", "devices", "part", "argument_gib", "temp_gib", "peak_gib", "layers_compiled")


@pytest.fixture(scope="module")
def run():
  """The driver's stdout on 2 and 8 devices: (table lines, parsed last JSON line)."""
  cmd = [
    sys.executable,
    "-m",
    "benchmarks.memory",
    "--configs=gsm8k",
    "--devices=2,8",
    "--layers=1",
    "--sampler_layers=2",
    f"--model={TINY}",
    "--prompt_len=32",
    "--new_tokens=32",
    "--batch=64",
    "--batch_dependent",
  ]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the driver adds its device count
  env["XLA_FLAGS"] = xla_flags.MEMORY_COMPILE  # same buffer assignment, faster compiles (tests/xla_flags.py)
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.strip().splitlines()
  return lines, json.loads(lines[-1])


def _rows(out):
  return {(r["devices"], r["part"]): r for r in out["results"]}


def test_json_line_has_the_documented_fields(run):
  lines, out = run
  assert lines[0].startswith("config | dev | part")  # the table comes first
  rows = _rows(out)
  assert set(rows) == {(d, p) for d in (2, 8) for p in memory.PARTS}
  for r in out["results"]:
    assert "error" not in r, r
    assert set(FIELDS) <= set(r)
    depth = [1] if r["part"] == "learner" else [2]  # --layers for the learner, --sampler_layers for the sampler
    assert r["config"] == "gsm8k" and r["layers_compiled"] == depth and not r["extrapolated"]
    assert r["num_layers"] == depth[0]
    # peak = argument + temp + outputs that are not donated-input aliases (>= argument + temp)
    assert r["peak_gib"] == pytest.approx(r["argument_gib"] + r["temp_gib"] + r["output_gib"])
    assert r["temp_gib"] > 0 and r["argument_gib"] > 0
  assert rows[(2, "learner")]["rows"] == 64 and rows[(2, "learner")]["seq_len"] == 64  # N = 8 x 8, T = 32 + 32
  for part in ("sampler_prefill", "sampler_decode"):
    assert rows[(2, part)]["prompt_len"] == 32 and rows[(2, part)]["new_tokens"] == 32
    assert rows[(2, part)]["rows"] == 64 and rows[(2, part)]["seq_len"] == 64  # B = N, S = Tp + Tn
  assert rows[(2, "learner")]["tiny_seq_len"] == 32  # T0 = min(TINY_TOKENS, T / 2)
  assert rows[(8, "learner")]["microbatch"] == 16  # the config's micro-batch: 2 rows per device


def test_arguments_are_sharded(run):
  """Parameters + optimizer state are FSDP-sharded: 4x fewer bytes per device on 8 devices than on 2.

  The learner's arguments are params (f32) + Adam mu, nu (f32) + the [64, 128] batch, all split over
  fsdp; only a few small leaves (norm scales, the step count) are replicated, hence the tolerance.
  """
  rows = _rows(run[1])
  ratio = rows[(2, "learner")]["argument_gib"] / rows[(8, "learner")]["argument_gib"]
  assert 3.5 < ratio <= 4.0


@pytest.mark.parametrize("part", ["learner", "sampler_prefill"])
def test_batch_memory_falls_with_devices(run, part):
  """Batch-dependent temp memory per device falls in proportion to data x fsdp (4x from 2 to 8 devices).

  batch_gib = temp(N, T) - temp(N, T0) per device, the same rows at a tiny sequence: what a bug that
  replicates an [N, T, ...] activation over the mesh keeps constant as devices are added.
  """
  rows = _rows(run[1])
  assert rows[(2, part)]["batch_gib"] > 0
  assert rows[(2, part)]["batch_gib"] / rows[(8, part)]["batch_gib"] >= 3.0


def test_decode_cache_is_split_over_the_mesh(run):
  """The decode step's arguments (bf16 params + the donated KV cache [B, S, K, H], k and v of one layer:
  2 x 64 x 64 x 2 x 16 x 2 B = 512 KiB) are split over fsdp: 4x fewer bytes per device on 8 devices than on 2.

  Its temporaries hardly depend on the cache length (one query position), so batch_gib says little here;
  a replicated cache would keep the argument bytes constant.
  """
  rows = _rows(run[1])
  ratio = rows[(2, "sampler_decode")]["argument_gib"] / rows[(8, "sampler_decode")]["argument_gib"]
  assert 3.5 < ratio <= 4.0
  assert rows[(2, "sampler_decode")]["argument_gib"] * GIB >= 256 * 2**10  # half of the cache on each device


def test_released_shapes_match_the_published_parameter_counts():
  """The configs' model.shape blocks give the checkpoints' published sizes (Qwen2: 1.54B, Qwen2.5: 7.62B)."""
  counts = {}
  for name in memory.CONFIGS:
    s = memory.load_setting(name)
    cfg = s.model_cfg
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    counts[name] = (cfg.num_params, cfg.num_params - embed)
  assert counts["gsm8k"][0] == pytest.approx(1.54e9, rel=0.005)  # Qwen2-1.5B: 1.54B, 1.31B non-embedding
  assert counts["gsm8k"][1] == pytest.approx(1.31e9, rel=0.005)
  assert counts["math"][0] == 7_615_616_512  # Qwen2.5-7B model card: 7.61B, 6.53B non-embedding
  assert counts["math"][1] == pytest.approx(6.53e9, rel=0.002)
  assert counts["multiturn"] == counts["math"]


def test_released_run_shapes():
  """What the benchmark compiles: the learner batch [N, T] and the sampler buckets of each config."""
  g, m, mt = (memory.load_setting(n) for n in memory.CONFIGS)
  assert (g.n, g.t, g.sampler_b, g.sampler_tp, g.sampler_tn) == (64, 4096, 64, 2048, 2048)
  assert (m.n, m.t, m.sampler_b, m.sampler_tp, m.sampler_tn) == (512, 3072, 512, 1024, 2048)
  # tool use: contexts grow to T = 4096 + 12288, each call adds up to max_turn_tokens = 4096
  assert (mt.n, mt.t, mt.sampler_b, mt.sampler_tp, mt.sampler_tn) == (2048, 16384, 2048, 16384, 4096)
  assert g.model_cfg.dtype == m.model_cfg.dtype == "bfloat16"


def test_sampler_is_compiled_at_the_capped_bucket(monkeypatch):
  """sampler.max_batch caps the rows of a sampler call; the benchmark compiles that bucket, not N (2048)."""
  import configs.multiturn as mt_config

  real = mt_config.get_config

  def capped(arg=None):
    c = real(arg)
    c.sampler.max_batch = 1024
    return c

  monkeypatch.setattr(mt_config, "get_config", capped)
  s = memory.load_setting("multiturn")
  assert (s.n, s.sampler_b, s.sampler_cfg.batch_buckets) == (2048, 1024, (128, 512, 1024))
  assert s.sampler_cfg.mesh_shape == (-1, 1, 4)  # the config's sampler mesh (--sampler_mesh=config)


def test_every_part_defaults_to_full_depth():
  """A per-layer extrapolation from 1 and 2 layers misreads both: the sampler's temporaries are a maximum over
  layers, which it turned into a sum (math's prefill: 41.8 GiB extrapolated, 30.7 compiled at 28 layers), and
  the learner's XLA schedule reuses buffers at 1-2 layers that it cannot at depth (math on 64 chips: 18.5
  extrapolated, 40.0 compiled). Both are compiled at full depth by default."""
  args = memory.parser().parse_args([])
  assert (args.sampler_layers, args.layers) == ("full", "full")


def test_extrapolation_is_linear_per_layer():
  by = {
    1: {"argument": 10, "temp": 100, "output": 1, "alias": 0},
    2: {"argument": 16, "temp": 130, "output": 1, "alias": 0},
  }
  assert memory._extrapolate(by, 28) == {"argument": 10 + 27 * 6, "temp": 100 + 27 * 30, "output": 1, "alias": 0}


def test_bad_flags_are_one_line_errors():
  with pytest.raises(ValueError, match="not an architecture field"):
    memory._parse_overrides("hiden_size=3")
  with pytest.raises(ValueError, match="multiple of the group size"):
    memory.load_setting("gsm8k", batch=12)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_widened_bytes_are_the_float32_copy_of_a_stacked_bf16_weight(dtype):
  """A layer scan over a stacked bf16 weight [L, D, F]: XLA:CPU hoists one float32 copy of the whole stack out of
  the loop (4 bytes an entry), which `widened_parameter_bytes` reads off the optimized HLO; a float32 stack has none."""
  import jax
  import jax.numpy as jnp

  w = jax.ShapeDtypeStruct((6, 64, 96), jnp.dtype(dtype))
  x = jax.ShapeDtypeStruct((8, 64), jnp.dtype(dtype))

  def f(ws, h):
    body = lambda h, w: (jnp.tanh(h @ w)[:, :64], None)
    return jax.lax.scan(body, h, ws)[0]

  text = jax.jit(f).lower(w, x).compile().as_text()
  assert memory.widened_parameter_bytes(text) == (4 * 6 * 64 * 96 if dtype == "bfloat16" else 0)
