"""Entry point: python main.py --config=configs/NAME.py[:variant] --workdir=DIR [--config.field=value ...]."""

import logging

from absl import app, flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "Experiment config (configs/*.py[:variant]).", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, plots. Reused to resume.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file it writes at INFO
  from vcpo_jax import trainer  # after flag parsing: keeps --help fast

  summary = trainer.run(flags.FLAGS.config, flags.FLAGS.workdir)
  logging.info("done: %s", summary)


if __name__ == "__main__":
  app.run(main)
