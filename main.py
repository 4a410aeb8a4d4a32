"""Entry point: python main.py --config=configs/NAME.py[:variant] --workdir=DIR [--config.field=value ...].

`--config_help` lists every config field with its value and comment, then exits. A bad config value
(unknown field, wrong type, out of range) is reported on one line naming the field, before anything is
built, with exit code 2; `--verbosity=1` shows the traceback too. So is a missing --workdir, one that
cannot be written, and a rerun of a workdir whose checkpoint was trained with other trajectory fields
(vcpo_jax.fingerprint; `--allow_config_change` continues with the new values).
"""

import atexit
import logging
import os
import re
import signal
import sys

INTERRUPT_GRACE_S = 2.0  # a signal before the first update that the run has not acted on by then ends it (trainer)
_PHASE = ["start-up"]  # what a signal interrupts before trainer.run's own handlers are in place / after them


def _interrupted(signum, _frame):
  """SIGINT / SIGTERM outside trainer.run's handlers: the imports, the config, the policy, the warm start, the
  learner's build (nothing trained yet, and every file start-up writes is replaced atomically, so a rerun
  resumes as before), or after the run ended. One line on stderr, exit 130 at once: the interpreter's
  teardown (seconds after the torch / transformers / jax imports) is skipped. trainer.run installs its own
  handlers before it starts anything that must be stopped or saved (the async sampler, the first update)."""
  done = "nothing trained since the last checkpoint" if _PHASE[0] == "start-up" else "the run had ended"
  name = signal.Signals(signum).name
  os.write(2, f"interrupted during {_PHASE[0]} ({name}): {done}; exiting with code 130\n".encode())
  os._exit(130)


if __name__ == "__main__":  # first, before the slow imports (not in a spawned child, which runs this as __mp_main__)
  for _sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_sig, _interrupted)

# transformers' import-time advice ("PyTorch was not found": the runtime needs only its tokenizers and config
# classes) is start-up noise; an explicit TRANSFORMERS_VERBOSITY or --verbosity=1 still shows it.
if not any(re.fullmatch(r"--?(?:verbosity|v)=[1-9]\d*", a) for a in sys.argv):
  os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from absl import app, flags
from ml_collections import config_flags

from vcpo_jax import schema

# --config.method[.PART[.FIELD]]=VALUE: a method part is a named choice whose fields change with its name, which
# ml_collections' override flags (read from sys.argv when the flag is defined) cannot express: they are taken out
# here and main() sets them on the loaded config (rl.choices.set_paths), presets, then choices, then fields.
sys.argv[:], _METHOD_ARGS = schema.split_args(sys.argv, "method")

config_flags.DEFINE_config_file("config", None, "Experiment config (configs/*.py[:variant]).", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, plots. Reused to resume.")
flags.DEFINE_bool(
  "allow_config_change",
  False,
  "Resume a workdir whose checkpoint was trained with other trajectory fields (vcpo_jax.fingerprint): continue "
  "with the new values; config.json keeps each config with the steps it governed. Without it such a resume "
  "is refused.",
)
flags.DEFINE_string(
  "compile_cache",
  "auto",
  "jax's persistent compilation cache of the learner and its sampler process: auto (on accelerators "
  "$XDG_CACHE_HOME/vcpo_jax/jax_cache, off on CPU), off, or a directory (vcpo_jax/compile_cache.py).",
)
flags.DEFINE_bool("config_help", False, "Print every field of --config (default: configs/common.py) and exit.")


_REQUIRED = {
  "config": "pass --config=configs/NAME.py[:variant]",
  "workdir": "pass --workdir=DIR, a new directory or an earlier run's to resume it",
}


def _verbose(argv) -> bool:
  """--verbosity=N / -v=N >= 1 asks for tracebacks (read from argv: flags may not be parsed yet)."""
  found = [m.group(1) for a in argv if (m := re.fullmatch(r"--?(?:verbosity|v)=(-?\d+)", a))]
  return bool(found) and int(found[-1]) >= 1


def _die(error: Exception, argv, msg: str | None = None):
  """One line on stderr and exit 2; the traceback instead if --verbosity asks for it."""
  if _verbose(argv):
    raise error
  lines = [ln.strip() for ln in (msg or str(error)).splitlines() if ln.strip()]
  # A config file that fails to load: ml_collections embeds the traceback; its first and last lines say it all.
  msg = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
  print(f"error: {msg}", file=sys.stderr)
  sys.exit(2)


def _overrides(argv) -> dict[str, str]:
  """{"optim.lr": "3e-4"} for every --config.optim.lr=3e-4 (or --config.optim.lr 3e-4) on the command line."""
  out = {}
  for i, a in enumerate(argv):
    if m := re.match(r"--?(?:no)?config\.([^=]+)(?:=(.*))?$", a):
      out[m.group(1)] = m.group(2) if m.group(2) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
  return out


def parse_flags(argv):
  """absl's flag parsing, with an unknown --config.FIELD or a bad flag value reported on one line."""
  argv = schema.split_args(argv, "method")[0]  # taken out of sys.argv too, above: main() sets them
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _die(e, argv, f"{e}" if "Traceback" in str(e) else f"{e} (--config_help lists every field and its type)")
  except (AttributeError, KeyError):  # ml_collections' answer to an unknown --config.FIELD
    config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith(("--config=", "-config="))), None)
    if config_arg is None:
      raise
    from vcpo_jax import run_config

    config = config_flags.config_flags.ConfigFileFlagParser(name="config").parse(config_arg)
    try:
      run_config.check_override_paths(config, _overrides(argv))
    except run_config.ConfigError as e:
      _die(e, argv)
    raise


def train(config, workdir: str, allow_config_change: bool = False, compile_cache: str = "auto") -> dict:
  """trainer.run(config, workdir, allow_config_change=..., compile_cache=...); after SIGINT / SIGTERM the process ends at once with exit code 130.

  Before trainer.run installs its handlers (and after it restores them) `_interrupted` ends the process at once.

  By the time trainer.run raises SystemExit(130) it has saved the checkpoint (and waited for it), flushed
  and closed the logs, and stopped the sampler, whose shared memory and temp files are gone. What remains
  is the interpreter's teardown, several seconds after the torch / transformers / jax imports: here the
  atexit handlers run (the grader pool's processes, jax's backends and a distributed shutdown), the
  logs are flushed, and the rest is skipped with os._exit.

  A process of a multi-process job that fails (a lost peer, a failed collective, any error) logs the error
  and ends within seconds with exit code 1 (`distributed.end_alone`): jax's exit-time shutdown barrier would
  otherwise wait for a lost peer until the coordination service's heartbeat timeout (100 s) and abort.
  """
  import jax

  from vcpo_jax import distributed, run_config, trainer  # after flag parsing: keeps --help fast

  try:
    summary = trainer.run(
      config,
      workdir,
      allow_config_change=allow_config_change,
      compile_cache=compile_cache,
      interrupt_grace_s=INTERRUPT_GRACE_S,
    )
    _PHASE[0] = "the summary"
    return summary
  except SystemExit as e:
    if e.code != 130:
      raise
  except Exception as e:
    if isinstance(e, run_config.ConfigError) or not (jax.distributed.is_initialized() and jax.process_count() > 1):
      raise  # a config error fails alike everywhere: main() reports it in one line
    logging.getLogger("vcpo_jax").exception("this process of the %d-process job fails", jax.process_count())
    distributed.end_alone(e)
  # trainer.run logged its one line (what it saved, or that start-up ended with nothing trained)
  for s in (signal.SIGINT, signal.SIGTERM):  # a second signal during the teardown below: no traceback
    signal.signal(s, signal.SIG_IGN)
  atexit._run_exitfuncs()
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(130)


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  try:
    if FLAGS.config is not None:
      FLAGS.config.keys()  # a config file that could not be loaded raises its error here
  except (OSError, ImportError, SyntaxError) as e:
    _die(e, sys.argv, f"--config: {e}")
  config = FLAGS.config
  if FLAGS.config_help or _METHOD_ARGS:
    from configs import common

    config = common.get_base_config() if config is None and FLAGS.config_help else config
  if _METHOD_ARGS and config is not None:
    from vcpo_jax.rl import choices

    try:
      choices.set_paths(config, _METHOD_ARGS)
    except ValueError as e:
      _die(e, sys.argv)
  if FLAGS.config_help:
    print(common.help_text(config, FLAGS["config"].config_filename.split(":")[0] if FLAGS.config is not None else None))
    return
  for name in ("config", "workdir"):
    if FLAGS[name].value is None:
      _die(ValueError(name), sys.argv, f"--{name}: missing; {_REQUIRED[name]} (--config_help lists the config fields)")
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file it writes at INFO
  if not _verbose(sys.argv):  # start-up noise (jax's absent TPU backend, matplotlib's font cache): --verbosity=1
    for name in ("jax", "matplotlib", "transformers"):
      logging.getLogger(name).setLevel(logging.WARNING)
  from vcpo_jax import run_config  # after flag parsing: keeps --help fast

  try:
    summary = train(config, FLAGS.workdir, FLAGS.allow_config_change, FLAGS.compile_cache)
  except run_config.ConfigError as e:
    _die(e, sys.argv)
  logging.getLogger("vcpo_jax").debug("done: %s", summary)
  import jax

  if jax.process_index() == 0:  # what the run shows, on stdout (vcpo_jax.compare draws several runs together)
    from vcpo_jax import compare

    print(compare.format_summary(compare.summarize(FLAGS.workdir)), flush=True)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
