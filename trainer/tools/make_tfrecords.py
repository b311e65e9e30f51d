"""data/make_tfrecords.py's command under trainer's name:

    python -m trainer.tools.make_tfrecords --source=tf_flowers --output=DIR/flowers

The same flags and files as `python -m data.make_tfrecords`, which works from this
project's folder; from a folder of yours that holds a `data` package or data.py,
Python would find that one first, while trainer's commands import the framework's
own `data` wherever they run (trainer/__init__.py)."""
import sys

from data import quiet

if __name__ == "__main__":  # quiet before TensorFlow starts, as the command is
    quiet.set_native_log_level(sys.argv)

from absl import app  # noqa: E402

from data import make_tfrecords  # noqa: E402

if __name__ == "__main__":
    make_tfrecords.define_flags()
    app.run(make_tfrecords.main)
