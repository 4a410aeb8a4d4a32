"""Hugging Face interop: safetensors checkpoints <-> the NNX `Transformer`.

Loading reads `config.json` with transformers' config classes (`ModelConfig.from_hf`)
and the weights with the `safetensors` library into numpy: no torch at run time.
Export writes `model.safetensors` + `config.json` (Qwen2Config / Qwen3Config / Qwen3MoeConfig / LlamaConfig) that
`transformers.AutoModelForCausalLM.from_pretrained` loads.

Name mapping (HF torch Linear weights are [out, in]; our kernels are [in, out]; the decoder's blocks are
stacked, so model.layers.i.* is index i of our layers.* [L, ...]):
  model.embed_tokens.weight [V, D]                  <-> embed_tokens.embedding [V, D]
  model.layers.i.self_attn.{q,k,v,o}_proj.weight    <-> layers.self_attn.{q,k,v,o}_proj.kernel[i] (transposed)
  model.layers.i.self_attn.{q,k,v}_proj.bias        <-> layers.self_attn.{q,k,v}_proj.bias[i] (Qwen2)
  model.layers.i.self_attn.{q,k}_norm.weight [H]    <-> layers.self_attn.{q,k}_norm.scale[i] (Qwen3)
  model.layers.i.mlp.{gate,up,down}_proj.weight     <-> layers.mlp.{gate,up,down}_proj.kernel[i] (transposed)
  model.layers.i.{input,post_attention}_layernorm.weight <-> layers.{...}_layernorm.scale[i]
  model.layers.i.mlp.gate.weight [E, D]             <-> layers.mlp.gate.kernel[i] [D, E] (Qwen3-MoE router)
  model.layers.i.mlp.experts.j.{gate,up,down}_proj.weight <-> layers.mlp.experts.{...}_proj[i, j] (transposed;
                                                        save_pretrained writes experts unfused, one tensor each)
  model.norm.weight                                 <-> norm.scale
  lm_head.weight [V, D]                             <-> lm_head.kernel [D, V] (untied models only)
Tied checkpoints may or may not store lm_head.weight; if they do it must equal the embedding.

LoRA (vcpo_jax.model.lora): `save_hf` of `lora.merge_into_base(...)` writes merged weights; `save_peft_adapter`
writes a PEFT adapter directory (adapter_config.json + adapter_model.safetensors:
base_model.model.model.layers.i.<proj>.lora_A.weight [r, Din] <-> layers.<proj>.lora_a.kernel[i] [Din, r],
lora_B [Dout, r]).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vcpo_jax import sharding as sh
from vcpo_jax.model import lora
from vcpo_jax.model import transformer as tf
from vcpo_jax.model.config import EXECUTION_FIELDS, ModelConfig, tiny_llama, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe

INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that hold no parameters of the architecture (recomputed buffers).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

Path = tuple  # an nnx parameter path, e.g. ("layers", "self_attn", "q_proj", "kernel") (stacked [L, ...])


@dataclasses.dataclass(frozen=True)
class _Entry:
  path: Path
  transpose: bool  # HF [out, in] <-> our [in, out]
  layer: int | None = None  # a decoder block's tensor: index `layer` of the stacked parameter [L, ...]
  expert: int | None = None  # an MoE expert's tensor: index [layer, expert] of the parameter [L, E, ...]

  @property
  def lead(self) -> int:
    """Leading stacked axes of our parameter that the HF tensor indexes away (0, 1: layers, 2: + experts)."""
    return 0 if self.layer is None else (1 if self.expert is None else 2)

  def shape(self, var) -> tuple[int, ...]:
    """The HF tensor's shape, from our parameter `var` (its layer (and expert) slice for a stacked one)."""
    shape = tuple(var.shape)[self.lead :]
    return shape[::-1] if self.transpose else shape


def hf_name_map(cfg: ModelConfig) -> dict[str, _Entry]:
  """HF tensor name -> (our parameter path, transpose?) for every parameter of `cfg`'s model."""
  m = {
    "model.embed_tokens.weight": _Entry(("embed_tokens", "embedding"), False),
    "model.norm.weight": _Entry(("norm", "scale"), False),
  }
  for i in range(cfg.num_layers):  # model.layers.{i}.* <-> index i of the stacked layers.* [L, ...]
    hf, ours = f"model.layers.{i}", ("layers",)
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
      m[f"{hf}.self_attn.{p}.weight"] = _Entry(ours + ("self_attn", p, "kernel"), True, i)
    if cfg.qkv_bias:
      for p in ("q_proj", "k_proj", "v_proj"):
        m[f"{hf}.self_attn.{p}.bias"] = _Entry(ours + ("self_attn", p, "bias"), False, i)
    if cfg.qk_norm:
      for p in ("q_norm", "k_norm"):
        m[f"{hf}.self_attn.{p}.weight"] = _Entry(ours + ("self_attn", p, "scale"), False, i)
    if cfg.moe is None:
      for p in ("gate_proj", "up_proj", "down_proj"):
        m[f"{hf}.mlp.{p}.weight"] = _Entry(ours + ("mlp", p, "kernel"), True, i)
    else:  # Qwen3-MoE: the router and E experts per layer (experts layer-major, expert-minor: [L, E, ...])
      m[f"{hf}.mlp.gate.weight"] = _Entry(ours + ("mlp", "gate", "kernel"), True, i)
      for j in range(cfg.num_experts):
        for p in ("gate_proj", "up_proj", "down_proj"):
          m[f"{hf}.mlp.experts.{j}.{p}.weight"] = _Entry(ours + ("mlp", "experts", p), True, i, j)
    for p in ("input_layernorm", "post_attention_layernorm"):
      m[f"{hf}.{p}.weight"] = _Entry(ours + (p, "scale"), False, i)
  if not cfg.tie_embeddings:
    m["lm_head.weight"] = _Entry(("lm_head", "kernel"), True)
  return m


def _abstract(cfg: ModelConfig):
  """(graphdef, flat abstract params) without allocating or initializing anything."""
  model = nnx.eval_shape(lambda: tf.Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model, nnx.Param)
  return graphdef, {tuple(p): v for p, v in nnx.to_flat_state(state)}


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """HF tensor name -> shape in HF layout, for every parameter of `cfg`'s model."""
  _, abstract = _abstract(cfg)
  return {n: e.shape(abstract[e.path]) for n, e in hf_name_map(cfg).items()}


# ----------------------------------------------------------------------------- reading


def _tensor_files(checkpoint_dir: str) -> dict[str, str]:
  """Tensor name -> safetensors file holding it (index file if present, else every *.safetensors)."""
  index_path = os.path.join(checkpoint_dir, INDEX_FILE)
  if os.path.isfile(index_path):
    with open(index_path) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index_path}: no 'weight_map' object; the index file is corrupt.")
    out = {}
    for name, fname in weight_map.items():
      path = os.path.join(checkpoint_dir, fname)
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{index_path} maps tensor {name!r} to {fname!r}, which does not exist.")
      out[name] = path
    return out
  files = sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors")))
  if not files:
    other = [
      n for n in ("pytorch_model.bin", "model.pt", "tf_model.h5") if os.path.isfile(os.path.join(checkpoint_dir, n))
    ]
    hint = (
      (
        f" Found {other}: convert it to safetensors (transformers: load it and call "
        "save_pretrained(dir, safe_serialization=True))."
      )
      if other
      else ""
    )
    raise FileNotFoundError(f"No *.safetensors files (and no {INDEX_FILE}) in {checkpoint_dir!r}.{hint}")
  from safetensors import safe_open

  out = {}
  for path in files:
    with safe_open(path, framework="numpy") as f:
      for name in f.keys():
        if name in out:
          raise ValueError(f"Tensor {name!r} is stored twice: in {out[name]!r} and {path!r}.")
        out[name] = path
  return out


def _read_tensors(files: Mapping[str, str], names) -> dict[str, np.ndarray]:
  """Reads `names` as float32 numpy arrays (bf16/f16 upcast), one open per file."""
  from safetensors import safe_open

  by_file: dict[str, list[str]] = {}
  for n in names:
    by_file.setdefault(files[n], []).append(n)
  out = {}
  for path, group in by_file.items():
    with safe_open(path, framework="numpy") as f:
      dtypes = {n: f.get_slice(n).get_dtype() for n in group}
      for n in group:
        if dtypes[n] != "BF16":
          out[n] = np.asarray(f.get_tensor(n), np.float32)
    bf16 = [n for n in group if dtypes[n] == "BF16"]
    if bf16:  # numpy has no bfloat16: read these through JAX, which does
      with safe_open(path, framework="flax") as f:
        for n in bf16:
          out[n] = np.asarray(jax.device_get(f.get_tensor(n)), np.float32)
  return out


def read_state_dict(checkpoint_dir) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """All tensors of a HF checkpoint as float32 numpy, and the file each came from."""
  checkpoint_dir = os.fspath(checkpoint_dir)
  files = _tensor_files(checkpoint_dir)
  return _read_tensors(files, list(files)), files


def _check_names_and_shapes(
  shapes: Mapping[str, tuple[int, ...]],
  cfg: ModelConfig,
  abstract,
  *,
  sources: Mapping[str, str],
  strict: bool,
  tied_head_equal: Callable[[], bool],
) -> None:
  """Every tensor `cfg` needs is present with its shape; unexpected ones raise (strict) or warn.

  Works from names and shapes only (a checkpoint's header), so a sharded load checks everything before it
  reads a byte of weights. tied_head_equal() is asked only for a tied config whose checkpoint stores
  lm_head.weight.
  """
  where = lambda n: f" in {sources[n]!r}" if n in sources else ""
  name_map = hf_name_map(cfg)
  missing = [n for n in name_map if n not in shapes]
  if missing:
    files = sorted(set(sources.values()))
    raise ValueError(
      f"Checkpoint is missing {len(missing)} tensor(s) the {cfg.model_type} config needs, "
      f"e.g. {missing[:5]} (looked in {files or 'the given tensors'})."
    )
  unexpected = [n for n in shapes if n not in name_map and not _IGNORED.search(n)]
  if cfg.tie_embeddings and "lm_head.weight" in unexpected:
    unexpected.remove("lm_head.weight")
    same_shape = tuple(shapes["lm_head.weight"]) == tuple(shapes["model.embed_tokens.weight"])
    if not same_shape or not tied_head_equal():
      raise ValueError(
        f"config.json says tie_word_embeddings=true but lm_head.weight{where('lm_head.weight')} "
        "differs from model.embed_tokens.weight; set tie_word_embeddings=false to load it."
      )
  if unexpected:
    msg = (
      f"Checkpoint has {len(unexpected)} tensor(s) the {cfg.model_type} architecture does not "
      f"model: {[n + where(n) for n in unexpected[:5]]}."
    )
    if strict:
      raise ValueError(msg + " Pass strict=False to ignore them (the loaded model will differ).")
    warnings.warn(msg + " Ignored.")
  for name, entry in name_map.items():
    want = entry.shape(abstract[entry.path])
    if tuple(shapes[name]) != want:
      raise ValueError(f"Tensor {name!r}{where(name)} has shape {tuple(shapes[name])}, but config.json implies {want}.")


def params_from_hf(
  tensors: Mapping[str, np.ndarray], cfg: ModelConfig, *, sources: Mapping[str, str] | None = None, strict: bool = True
) -> tf.Transformer:
  """A `Transformer` holding the HF-named in-memory `tensors` (float32 parameters, cfg.dtype compute).

  Args:
    tensors: HF tensor name -> array (HF layout, [out, in] for linear weights).
    cfg: the architecture; every tensor it needs must be present with the right shape.
    sources: tensor name -> file, only used to name files in error messages.
    strict: unexpected tensors raise (True) or warn (False). Dropping weights the
      architecture does not model (e.g. Llama o_proj biases) would silently give a
      different model, hence the strict default.
  """
  graphdef, abstract = _abstract(cfg)
  _check_names_and_shapes(
    {n: np.shape(t) for n, t in tensors.items()},
    cfg,
    abstract,
    sources=sources or {},
    strict=strict,
    tied_head_equal=lambda: np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]),
  )
  arrays: dict[Path, list] = {}  # our path -> its array, or its layers' arrays in order
  for name, entry in hf_name_map(cfg).items():
    arr = np.asarray(tensors[name], np.float32)
    arrays.setdefault(entry.path, []).append(arr.T if entry.transpose else arr)
  flat = []
  for path, parts in arrays.items():
    stacked = path[0] == "layers"
    value = np.stack(parts).reshape(abstract[path].shape) if stacked else parts[0]  # [L (, E), ...]
    flat.append((path, abstract[path].replace(jnp.asarray(value))))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


class _Reader:
  """Float32 numpy reads of whole tensors or of slices of them, from safetensors files (memory-mapped).

  safetensors' numpy framework has no bfloat16: BF16 tensors are sliced through its "flax" framework on the
  host CPU device, then upcast. A slice reads only its own bytes.
  """

  def __init__(self, files: Mapping[str, str]):
    self.files = files

  def header(self) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(name -> shape, name -> dtype) without reading any weights."""
    from safetensors import safe_open

    shapes, dtypes = {}, {}
    for path in sorted(set(self.files.values())):
      with safe_open(path, framework="numpy") as f:
        for n in f.keys():
          if self.files.get(n) == path:
            sl = f.get_slice(n)
            shapes[n], dtypes[n] = tuple(sl.get_shape()), sl.get_dtype()
    return shapes, dtypes

  def read(self, name: str, dtype: str, index: tuple[slice, ...] | None = None, transpose: bool = False) -> np.ndarray:
    """Tensor `name` (stored as `dtype`), or its block `index`, as C-contiguous float32.

    transpose: return the [in, out] transpose of a 2-D HF [out, in] weight; `index` is then in that
    transposed layout (the file slice is index[::-1]).
    """
    from safetensors import safe_open

    if transpose and index is not None:
      index = tuple(index)[::-1]
    if dtype != "BF16":
      with safe_open(self.files[name], framework="numpy") as f:
        sl = f.get_slice(name)
        out = np.asarray(sl[index] if index is not None else sl[:], np.float32)
    else:
      cpu = jax.local_devices(backend="cpu")[0]
      with jax.default_device(cpu), safe_open(self.files[name], framework="flax") as f:
        sl = f.get_slice(name)
        out = np.asarray(jax.device_get(sl[index] if index is not None else sl[:]), np.float32)
    return np.ascontiguousarray(out.T) if transpose else out


def _blocks(sharding, shape: tuple[int, ...], addressable: bool = True) -> list[tuple[tuple[slice, ...], list]]:
  """The distinct blocks of `sharding` over `shape`: (index, the devices holding it), in device order.

  A block replicated over several devices appears once. addressable=False lists every process's devices
  (the same list on every host).
  """
  per_device = sharding.addressable_devices_indices_map(shape) if addressable else sharding.devices_indices_map(shape)
  out: dict[tuple, tuple[tuple[slice, ...], list]] = {}
  for device, index in per_device.items():
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    key = tuple(sl.indices(n) for sl, n in zip(index, shape))
    out.setdefault(key, (index, []))[1].append(device)
  return list(out.values())


def _read_block(reader: _Reader, names: list[str], dtypes: Mapping[str, str], entries: list[_Entry], index=None):
  """Block `index` (our layout) of one parameter: a single tensor's, or for a stacked parameter (names: its
  layers' HF tensors, in order; an expert parameter's: layer-major, expert-minor) the slice of the leading
  stacked axes index[:lead] of those tensors' blocks index[lead:], stacked."""
  lead = entries[0].lead
  if lead == 0:
    return reader.read(names[0], dtypes[names[0]], index, transpose=entries[0].transpose)
  n_exp = len(names) // (entries[-1].layer + 1) if lead == 2 else 1
  index = tuple(index) if index is not None else ()
  index = index + (slice(None),) * (lead - len(index))
  rest = index[lead:] or None
  layers = range(*index[0].indices(len(names) // n_exp))
  experts = range(*index[1].indices(n_exp)) if lead == 2 else [0]
  read = lambda i: reader.read(names[i], dtypes[names[i]], rest, transpose=entries[i].transpose)
  out = np.stack([np.stack([read(li * n_exp + e) for e in experts]) for li in layers])
  return out if lead == 2 else out[:, 0]


def _place(reader: _Reader, names: list[str], dtypes, entries: list[_Entry], var, sharding) -> jax.Array:
  """One parameter as a float32 jax.Array: whole (sharding None), or shard by shard into `sharding`.

  With a sharding, each distinct block this process's devices hold is read from the file as its own slice
  (transposed tensors: the HF slice is the block's index reversed), put on every device that holds it,
  and dropped before the next block is read: the host holds one block at a time, never a whole tensor
  (jax.make_array_from_callback would gather every local block on the host first). A multi-host load reads
  on each host only what that host's devices hold; a replicated block is read once per host.
  """
  if sharding is None:
    return jnp.asarray(_read_block(reader, names, dtypes, entries))
  shape = tuple(var.shape)
  shards = {}
  for index, devices in _blocks(sharding, shape):
    block = _read_block(reader, names, dtypes, entries, index)
    placed = [jax.device_put(block, d) for d in devices]
    jax.block_until_ready(placed)  # done with `block` (XLA:CPU may have adopted it as a device buffer)
    shards.update(zip(devices, placed))
    del block
  arrays = [shards[d] for d in sharding.addressable_devices_indices_map(shape)]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _tied_equal_blockwise(reader: _Reader, dtypes: Mapping[str, str], indices) -> bool:
  """lm_head.weight == model.embed_tokens.weight, compared one block (`indices`, HF layout) at a time."""
  for idx in indices:
    a = reader.read("lm_head.weight", dtypes["lm_head.weight"], idx)
    b = reader.read("model.embed_tokens.weight", dtypes["model.embed_tokens.weight"], idx)
    if not np.array_equal(a, b):
      return False
    del a, b  # before the next pair is read: one block pair at a time
  return True


def _tied_check_indices(shape: tuple[int, ...], sharding, rows: int = 4096) -> list[tuple[slice, ...]]:
  """Blocks the tied-head check reads: the embedding's device blocks over every process (the same on every
  host, so all hosts agree), else `rows` rows at a time."""
  if sharding is not None:
    return [index for index, _ in _blocks(sharding, shape, addressable=False)]
  return [(slice(lo, min(shape[0], lo + rows)),) for lo in range(0, shape[0], rows)]


def load_hf(
  checkpoint_dir, dtype: str = "float32", strict: bool = True, *, mesh=None, rules=None, **execution
) -> tuple[ModelConfig, tf.Transformer]:
  """(ModelConfig, Transformer) from a local HF directory (config.json + *.safetensors).

  Names and shapes are checked from the files' headers before any weight is read. Without a mesh every
  tensor is read whole into a host array. With `mesh`, each parameter is born sharded by `rules`
  (default sharding.TRANSFORMER_RULES, the policy's layout): every device's block is read from the file as
  a slice, so neither the host nor any device ever holds a whole tensor it does not shard (a 7B model never
  passes through one host's memory).

  Args:
    checkpoint_dir: directory with config.json and model.safetensors, or sharded
      model-*.safetensors with model.safetensors.index.json.
    dtype: compute dtype, "float32" or "bfloat16" (parameters are float32 either way;
      bf16/f16 checkpoints are upcast).
    strict: see `params_from_hf`.
    mesh, rules: load straight into NamedShardings on `mesh` (see above).
    **execution: ModelConfig fields of `EXECUTION_FIELDS` (attention, remat, log-prob chunks).
  """
  checkpoint_dir = os.fspath(checkpoint_dir)
  if not os.path.isdir(checkpoint_dir):
    raise FileNotFoundError(f"Checkpoint directory {checkpoint_dir!r} does not exist.")
  cfg = ModelConfig.from_hf(checkpoint_dir, dtype=dtype)
  unknown = set(execution) - set(EXECUTION_FIELDS)
  if unknown:
    raise TypeError(f"load_hf: {sorted(unknown)} are not execution fields {EXECUTION_FIELDS}")
  cfg = cfg.replace(**execution)
  _check_supported(checkpoint_dir)
  files = _tensor_files(checkpoint_dir)
  reader = _Reader(files)
  shapes, dtypes = reader.header()
  graphdef, abstract = _abstract(cfg)
  shardings = {}
  if mesh is not None:
    state = nnx.from_flat_state([(p, v) for p, v in abstract.items()])
    shardings = dict(nnx.to_flat_state(sh.param_shardings(state, rules or sh.TRANSFORMER_RULES, mesh)))
    shardings = {tuple(p): getattr(s, "value", s) for p, s in shardings.items()}
  emb = ("embed_tokens", "embedding")  # [V, D], the HF layout too
  tied_blocks = lambda: _tied_check_indices(tuple(abstract[emb].shape), shardings.get(emb))
  _check_names_and_shapes(
    shapes,
    cfg,
    abstract,
    sources=files,
    strict=strict,
    tied_head_equal=lambda: _tied_equal_blockwise(reader, dtypes, tied_blocks()),
  )
  by_path: dict[Path, list[tuple[str, _Entry]]] = {}  # a stacked parameter: its layers' tensors, in order
  for n, e in hf_name_map(cfg).items():
    by_path.setdefault(e.path, []).append((n, e))
  flat = []
  for path, pairs in by_path.items():
    names, entries = [n for n, _ in pairs], [e for _, e in pairs]
    placed = _place(reader, names, dtypes, entries, abstract[path], shardings.get(path))
    flat.append((path, abstract[path].replace(placed)))
  return cfg, nnx.merge(graphdef, nnx.from_flat_state(flat))


def _check_supported(checkpoint_dir: str) -> None:
  """Rejects config.json features the Transformer does not implement."""
  path = os.path.join(checkpoint_dir, "config.json")
  with open(path) as f:
    raw = json.load(f)
  if raw.get("use_sliding_window"):
    raise ValueError(f"{path}: use_sliding_window=true is not supported (full attention only).")
  if raw.get("model_type") in ("llama", "qwen3", "qwen3_moe") and raw.get("attention_bias"):
    raise ValueError(
      f"{path}: {raw['model_type']} attention_bias=true (biases on q/k/v and o_proj) is not "
      "supported; only Qwen2-style q/k/v biases are."
    )
  act = raw.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"{path}: hidden_act={act!r} is not supported (SwiGLU with silu only).")


# ----------------------------------------------------------------------------- writing


def _flat_params(model_or_params) -> dict[Path, np.ndarray]:
  """Our parameter path -> float32 numpy, from a Transformer, an nnx.State or a nested dict."""
  if isinstance(model_or_params, nnx.Module):
    model_or_params = nnx.state(model_or_params, nnx.Param)
  if isinstance(model_or_params, nnx.State):
    items = nnx.to_flat_state(model_or_params)
  elif isinstance(model_or_params, Mapping):
    items = jax.tree_util.tree_flatten_with_path(model_or_params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    items = [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p), v) for p, v in items]
  else:
    raise ValueError(
      f"model_or_params: expected a Transformer, an nnx.State of its params or a "
      f"nested dict, got {type(model_or_params).__name__}."
    )
  out = {}
  for path, v in items:
    v = v[...] if isinstance(v, nnx.Variable) else v
    out[tuple(path)] = np.asarray(jax.device_get(v), np.float32)
  return out


def params_to_hf(model_or_params, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """HF-named float32 tensors (HF layout) of a Transformer's parameters."""
  flat = _flat_params(model_or_params)
  _, abstract = _abstract(cfg)
  name_map = hf_name_map(cfg)
  known = {e.path for e in name_map.values()}
  missing = [p for p in known if p not in flat]
  extra = [p for p in flat if p not in known]
  if missing or extra:
    raise ValueError(
      f"model_or_params does not match cfg: missing {sorted(map(str, missing))[:5]}, "
      f"unexpected {sorted(map(str, extra))[:5]}."
    )
  out = {}
  for name, e in name_map.items():
    arr = flat[e.path]
    if arr.shape != tuple(abstract[e.path].shape):
      raise ValueError(
        f"Parameter {'.'.join(map(str, e.path))} has shape {arr.shape}, cfg implies {tuple(abstract[e.path].shape)}."
      )
    arr = arr[e.layer] if e.layer is not None else arr  # a block's tensor: its layer of the stacked parameter
    arr = arr[e.expert] if e.expert is not None else arr  # an expert's: its slot of the layer's [E, ...]
    out[name] = np.ascontiguousarray(arr.T if e.transpose else arr)
  return out


def hf_config(cfg: ModelConfig, tokenizer=None):
  """A transformers Qwen2Config / Qwen3Config / Qwen3MoeConfig / LlamaConfig describing `cfg` (float32 weights)."""
  import transformers

  common = dict(
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.hidden_size,
    intermediate_size=cfg.intermediate_size,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=cfg.num_heads,
    num_key_value_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
    # "dynamic" RoPE's reference length is max_position_embeddings itself
    max_position_embeddings=(
      cfg.rope_scaling.original_max_position if cfg.rope_scaling.rope_type == "dynamic" else cfg.max_position
    ),
    rms_norm_eps=cfg.rms_eps,
    rope_parameters=cfg.rope_scaling.to_hf(cfg.rope_theta),
    tie_word_embeddings=cfg.tie_embeddings,
    hidden_act="silu",
    dtype="float32",
  )
  if tokenizer is not None:
    common.update(
      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
  if (cfg.model_type in ("qwen3", "qwen3_moe")) != cfg.qk_norm:
    raise ValueError(
      f"ModelConfig.qk_norm={cfg.qk_norm} cannot be exported as model_type={cfg.model_type!r} "
      "(HF Qwen3 always has q/k norms, Qwen2 and Llama never); set model_type='qwen3' iff qk_norm."
    )
  if cfg.model_type == "qwen3_moe":
    if cfg.qkv_bias:
      raise ValueError("ModelConfig.qkv_bias=True cannot be exported as model_type='qwen3_moe'.")
    spec = cfg.moe
    hf = transformers.Qwen3MoeConfig(
      attention_bias=False,
      use_sliding_window=False,
      num_experts=spec.num_experts,
      num_experts_per_tok=spec.num_experts_per_tok,
      moe_intermediate_size=spec.moe_intermediate_size,
      norm_topk_prob=spec.norm_topk_prob,
      decoder_sparse_step=spec.decoder_sparse_step,
      mlp_only_layers=list(spec.mlp_only_layers),
      output_router_logits=spec.router_aux_loss_coef > 0,
      router_aux_loss_coef=spec.router_aux_loss_coef or 0.001,
      **common,
    )
    hf.architectures = ["Qwen3MoeForCausalLM"]
  elif cfg.model_type == "qwen3":
    if cfg.qkv_bias:
      raise ValueError("ModelConfig.qkv_bias=True cannot be exported as model_type='qwen3'; use 'qwen2'.")
    hf = transformers.Qwen3Config(attention_bias=False, use_sliding_window=False, **common)
    hf.architectures = ["Qwen3ForCausalLM"]
  elif cfg.model_type == "qwen2":
    if not cfg.qkv_bias:
      raise ValueError(
        "ModelConfig.qkv_bias=False cannot be exported as model_type='qwen2' (HF Qwen2 "
        "always has q/k/v biases); use model_type='llama'."
      )
    hf = transformers.Qwen2Config(use_sliding_window=False, **common)
    hf.architectures = ["Qwen2ForCausalLM"]
  elif cfg.model_type == "llama":
    if cfg.qkv_bias:
      raise ValueError(
        "ModelConfig.qkv_bias=True cannot be exported as model_type='llama' (HF Llama "
        "biases cover o_proj too); use model_type='qwen2'."
      )
    hf = transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    hf.architectures = ["LlamaForCausalLM"]
  else:  # ModelConfig validates model_type; kept for future families
    raise ValueError(f"Unsupported model_type {cfg.model_type!r} for export.")
  return hf


def save_hf(model_or_params, cfg: ModelConfig, out_dir, tokenizer=None) -> str:
  """Writes config.json + model.safetensors (+ tokenizer files) loadable by transformers.

  Args:
    model_or_params: a Transformer, its nnx.State of params (`transformer.split(m)[1]`)
      or the equivalent nested dict.
    cfg: its ModelConfig.
    out_dir: created if needed; existing files of the same names are overwritten.
    tokenizer: optional transformers tokenizer, saved alongside (its eos/bos/pad ids
      go into config.json).

  Returns:
    out_dir as a str.
  """
  return _write(params_to_hf(model_or_params, cfg), hf_config(cfg, tokenizer), out_dir, tokenizer)


PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def peft_tensors(params) -> dict[str, np.ndarray]:
  """PEFT-named float32 LoRA tensors of a LoRA model's params: lora_A.weight [r, Din], lora_B.weight [Dout, r]
  (torch's [out, in] layout of our A [Din, r], B [r, Dout]), keyed as peft's save_pretrained writes them."""
  out = {}
  for path, (a, b) in lora.lora_kernels(params).items():  # stacked: A [L, Din, r], B [L, r, Dout]
    a, b = np.asarray(jax.device_get(a), np.float32), np.asarray(jax.device_get(b), np.float32)
    rest = path[len("layers.") :]
    for i in range(a.shape[0]):  # layers.<proj> [i] <-> model.layers.{i}.<proj>
      name = f"base_model.model.model.layers.{i}.{rest}"
      out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
      out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
  return out


def save_peft_adapter(params, cfg: ModelConfig, out_dir, base_model: str = "") -> str:
  """Writes a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors).

  `peft.PeftModel.from_pretrained(base, out_dir)` on the Hugging Face base model (the run's frozen base:
  hf_io.save_hf of `lora.split(params)[1]`, or the checkpoint it was loaded from) gives this model's logits.
  base_model: recorded as base_model_name_or_path (the base checkpoint's path, "" for a random preset)."""
  from safetensors.numpy import save_file

  if not cfg.lora:
    raise ValueError("save_peft_adapter: cfg.lora_rank is 0, the model has no adapters (set model.lora_rank > 0).")
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  adapter = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": base_model or None,
    "r": cfg.lora_rank,
    "lora_alpha": cfg.lora_alpha,
    "lora_dropout": 0.0,
    "target_modules": sorted(cfg.lora_targets),
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "init_lora_weights": True,
    "inference_mode": True,
    "modules_to_save": None,
  }
  with open(os.path.join(out_dir, PEFT_CONFIG), "w") as f:
    json.dump(adapter, f, indent=2)
  save_file(peft_tensors(params), os.path.join(out_dir, PEFT_WEIGHTS), metadata={"format": "pt"})
  return out_dir


def _write(tensors: dict[str, np.ndarray], hf, out_dir, tokenizer) -> str:
  from safetensors.numpy import save_file

  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  # Stale shards from an earlier save would shadow or duplicate the new weights.
  for stale in glob.glob(os.path.join(out_dir, "*.safetensors")) + [os.path.join(out_dir, INDEX_FILE)]:
    if os.path.isfile(stale):
      os.remove(stale)
  save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  hf.save_pretrained(out_dir)
  if tokenizer is not None:
    from vcpo_jax.model.tokenizer import save_tokenizer

    save_tokenizer(tokenizer, out_dir)  # AutoTokenizer then loads tokenizer.json as written
  return out_dir


def make_tiny_checkpoint(
  out_dir, family: str = "qwen2", vocab_size: int | None = None, seed: int = 0, tokenizer: bool = True, **overrides
) -> str:
  """A tiny random HF checkpoint (+ char tokenizer) for CPU demos; no torch needed.

  Args:
    out_dir: where to write config.json, model.safetensors and tokenizer files.
    family: "qwen2" (GQA, q/k/v bias, tied), "qwen3" (q/k norms, no bias, tied), "qwen3_moe" (Qwen3's
      attention, 8 experts, 2 per token, untied) or "llama" (untied, no bias); the `tiny_*` presets.
    vocab_size: defaults to the tokenizer's size (len(tokenizer)), or 256 without one.
    seed: numpy seed of the init (N(0, 0.02^2) weights, zero biases, unit scales,
      as `Transformer` initializes them).
    tokenizer: also write `build_char_tokenizer()` there.
    **overrides: ModelConfig fields to change (hidden_size=..., num_layers=...).

  Returns:
    out_dir as a str; `load_hf(out_dir)` and `load_tokenizer(out_dir)` read it back.
  """
  from vcpo_jax.model.tokenizer import build_char_tokenizer

  presets = {"qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "qwen3_moe": tiny_qwen3_moe, "llama": tiny_llama}
  if family not in presets:
    raise ValueError(f"family must be one of {sorted(presets)}, got {family!r}.")
  tok = build_char_tokenizer() if tokenizer else None
  if vocab_size is None:
    vocab_size = len(tok) if tok is not None else 256
  if tok is not None and vocab_size < len(tok):
    raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tok)} tokens).")
  cfg = presets[family](vocab_size=vocab_size, **overrides)
  # The Transformer's own init, drawn in numpy: building the NNX module eagerly
  # costs seconds of op dispatch, and only the tensors are wanted here.
  rng = np.random.default_rng(seed)

  def draw(name, shape):
    if name.endswith("norm.weight"):
      return np.ones(shape, np.float32)
    if name.endswith(".bias"):
      return np.zeros(shape, np.float32)
    return (0.02 * rng.standard_normal(shape)).astype(np.float32)

  tensors = {n: draw(n, sh) for n, sh in hf_shapes(cfg).items()}
  return _write(tensors, hf_config(cfg, tok), out_dir, tok)


# ----------------------------------------------------------------------------- convenience forward

_LOADED: dict[tuple, tuple[Any, Any]] = {}


def _fingerprint(checkpoint_dir: str) -> tuple:
  """Changes whenever a weight or config file changes, so the cache never serves stale weights."""
  names = sorted(
    glob.glob(os.path.join(checkpoint_dir, "*.safetensors")) + glob.glob(os.path.join(checkpoint_dir, "*.json"))
  )
  return tuple((n, os.stat(n).st_mtime_ns, os.stat(n).st_size) for n in names)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, tokens_bt, valid_bt):
  positions, mask = tf.padded_positions_and_mask(valid_bt)
  return tf.forward(graphdef, params, tokens_bt, positions, mask)[0]


def hf_forward(checkpoint_dir, token_ids, attention_mask=None, dtype: str = "float32") -> np.ndarray:
  """float32 logits [B, T, V] of a local HF checkpoint (loaded once, then cached).

  Args:
    checkpoint_dir: a HF directory, see `load_hf`.
    token_ids: int [B, T] (or [T], treated as B = 1).
    attention_mask: optional [B, T] of 0/1, 1 = real token; left or right padding.
      Positions count real tokens (as HF's cumsum(mask) - 1); logits at padding
      positions are meaningless.
    dtype: compute dtype, "float32" or "bfloat16".
  """
  checkpoint_dir = os.path.realpath(os.fspath(checkpoint_dir))
  tokens = np.asarray(token_ids)
  if tokens.ndim == 1:
    tokens = tokens[None]
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"token_ids must be integers of shape [B, T] or [T], got {tokens.dtype} {tokens.shape}.")
  valid = np.ones(tokens.shape, bool) if attention_mask is None else np.asarray(attention_mask)
  if valid.ndim == 1:
    valid = valid[None]
  if valid.shape != tokens.shape:
    raise ValueError(f"attention_mask shape {valid.shape} must equal token_ids shape {tokens.shape}.")
  key = (checkpoint_dir, dtype, _fingerprint(checkpoint_dir))
  if key not in _LOADED:
    for k in [k for k in _LOADED if k[:2] == key[:2]]:  # drop stale versions of this checkpoint
      del _LOADED[k]
    cfg, model = load_hf(checkpoint_dir, dtype=dtype)
    _LOADED[key] = (cfg, tf.split(model))
  cfg, graphdef_params = _LOADED[key]
  if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
    raise ValueError(f"token_ids must lie in [0, {cfg.vocab_size}), got range [{tokens.min()}, {tokens.max()}].")
  out = _logits(*graphdef_params, jnp.asarray(tokens, jnp.int32), jnp.asarray(valid.astype(bool)))
  return np.asarray(out, np.float32)
