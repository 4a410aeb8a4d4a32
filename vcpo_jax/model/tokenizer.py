"""Tokenizers: load a checkpoint's own (AutoTokenizer, local only) or build a tiny char-level one.

The char-level tokenizer is for tests and CPU demos with tiny random policies:
one token per printable ASCII character plus newline and tab, and the Qwen-style
chat specials, with a ChatML template. Every id is human-readable ("7" is the
token for the digit 7), which makes sampled trajectories easy to inspect.

Ids (fixed, so tests can hard-code them):
  0 <|endoftext|> (pad), 1 <|im_start|>, 2 <|im_end|> (eos), 3 <unk>,
  4 "\\n", 5 "\\t", 6.. printable ASCII 32..126 (char c has id ord(c) - 26: space 6, "0" 22, "a" 71).
"""

from __future__ import annotations

import os

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)
CHARS = ("\n", "\t") + tuple(chr(i) for i in range(32, 127))

# ChatML, as Qwen2 instruct models use it (no default system prompt).
CHAT_TEMPLATE = (
  "{% for message in messages %}"
  "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
  "{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_char_tokenizer(save_dir: str | os.PathLike | None = None):
  """A char-level `transformers.PreTrainedTokenizerFast` over printable ASCII + chat specials.

  Characters outside the alphabet map to <unk> (id 3). Decoding concatenates
  characters (no inserted spaces), so decode(encode(s)) == s for ASCII text.
  eos_token is <|im_end|> (ends a chat turn), pad_token is <|endoftext|>.

  Args:
    save_dir: if given, the tokenizer is also written there with `save_pretrained`
      (`save_tokenizer`: tokenizer.json, tokenizer_config.json, chat_template.jinja), loadable with
      `load_tokenizer(save_dir)` and `transformers.AutoTokenizer`.
  """
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
  # Every character (newlines included, hence [\s\S]) is its own pre-token.
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()  # join characters back without spaces
  tok.add_special_tokens(list(SPECIAL_TOKENS))
  out = PreTrainedTokenizerFast(
    tokenizer_object=tok,
    eos_token=IM_END,
    pad_token=PAD_TOKEN,
    unk_token=UNK_TOKEN,
    chat_template=CHAT_TEMPLATE,
    padding_side="left",
  )
  if save_dir is not None:
    save_tokenizer(out, save_dir)
  return out


# The pass-through class an exported directory declares (see save_tokenizer): transformers' TokenizersBackend
# with no __init__ of its own, so tokenizer.json is loaded as written.
_MODULE = "tokenization_vcpo"
_CLASS = "VcpoTokenizer"
_MODULE_SOURCE = f'''"""Loads tokenizer.json exactly as written (no rebuild from vocab / merges by model type)."""

from transformers import TokenizersBackend


class {_CLASS}(TokenizersBackend):
  pass
'''


def save_tokenizer(tokenizer, out_dir: str | os.PathLike) -> str:
  """Writes `tokenizer` so that `transformers.AutoTokenizer` and `load_tokenizer` give its own token ids.

  transformers 5 picks a tokenizer class from config.json's model_type and, for some types (qwen2 among
  them, whatever tokenizer_config.json declares), rebuilds the tokenizer from tokenizer.json's vocab and
  merges with that family's own pre-tokenizer: the char-level tokenizer would lose every space. The saved
  tokenizer_config.json therefore declares `tokenizer_class: TokenizersBackend` (tokenizer.json as written)
  and an `auto_map` to a pass-through subclass (tokenization_vcpo.py, written alongside): transformers
  honours a declared auto_map before the model type's class. Without trust_remote_code it then loads the
  declared TokenizersBackend, with it the pass-through class; both read tokenizer.json as it is.

  Returns:
    out_dir as a str.
  """
  import json

  out_dir = os.fspath(out_dir)
  tokenizer.save_pretrained(out_dir)
  path = os.path.join(out_dir, "tokenizer_config.json")
  with open(path) as f:
    cfg = json.load(f)
  cfg["tokenizer_class"] = "TokenizersBackend"
  cfg["auto_map"] = {"AutoTokenizer": [None, f"{_MODULE}.{_CLASS}"]}
  with open(path, "w") as f:
    json.dump(cfg, f, indent=2, ensure_ascii=False)
  with open(os.path.join(out_dir, f"{_MODULE}.py"), "w") as f:
    f.write(_MODULE_SOURCE)
  return out_dir


def load_tokenizer(checkpoint_dir: str | os.PathLike):
  """The tokenizer of a local directory (never the network): tokenizer.json exactly as written when there
  is one (transformers' TokenizersBackend, with tokenizer_config.json's specials and chat template), else
  `transformers.AutoTokenizer` (sentencepiece / vocab files).

  AutoTokenizer alone would, for a qwen2 config.json, rebuild a byte-level Qwen2 tokenizer from the
  vocabulary whatever tokenizer.json says (see save_tokenizer)."""
  path = os.fspath(checkpoint_dir)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"Tokenizer directory {path!r} does not exist.")
  names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
  if not any(os.path.isfile(os.path.join(path, n)) for n in names):
    raise FileNotFoundError(
      f"No tokenizer files in {path!r} (expected one of {names}); save one there with "
      "tokenizer.save_pretrained(dir) or vcpo_jax.model.tokenizer.build_char_tokenizer(dir)."
    )
  if os.path.isfile(os.path.join(path, "tokenizer.json")):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
  from transformers import AutoTokenizer

  return AutoTokenizer.from_pretrained(path, local_files_only=True)


def apply_chat_template_or_plain(tokenizer, prompt, system: str | None = None) -> str:
  """The text the policy is conditioned on for one prompt.

  With a chat template: one user turn (after an optional system turn) and the
  assistant generation prompt, rendered as text (not tokenized). Without one:
  the prompt itself (`system` then must be None, there is nowhere to put it).

  Args:
    tokenizer: a transformers tokenizer.
    prompt: the user message (str) or a full list of {"role", "content"} messages.
    system: optional system message prepended to a str prompt.

  Returns:
    str. Tokenize it with `add_special_tokens=False`: the template already holds
    every special token the model expects.
  """
  if getattr(tokenizer, "chat_template", None):
    if isinstance(prompt, str):
      messages = [{"role": "system", "content": system}] if system is not None else []
      messages.append({"role": "user", "content": prompt})
    else:
      messages = list(prompt)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  if not isinstance(prompt, str):
    raise ValueError(
      "prompt: a list of chat messages needs a tokenizer with a chat_template; pass a plain string prompt instead."
    )
  if system is not None:
    raise ValueError(
      "system: the tokenizer has no chat_template, so a system message cannot be "
      "placed; prepend it to the prompt yourself or pass system=None."
    )
  return prompt


def encode_prompts(tokenizer, problems, chat_template: bool) -> list[list[int]]:
  """[P] prompt token ids: each problem's `.prompt` text (chat-wrapped when chat_template) encoded plainly.

  Args:
    tokenizer: a Hugging Face tokenizer or build_char_tokenizer()'s.
    problems: P objects with a `.prompt` string (tasks.Problem).
    chat_template: wrap each prompt with apply_chat_template_or_plain (one user turn + generation prompt).
  Returns:
    P lists of ints, no special tokens added (the chat template writes its own).
  """
  out = []
  for p in problems:
    text = apply_chat_template_or_plain(tokenizer, p.prompt) if chat_template else p.prompt
    out.append(list(tokenizer.encode(text, add_special_tokens=False)))
  return out
