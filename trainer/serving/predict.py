"""Run a trained model on images, on the CPU:

    python -m trainer.serving.predict --model_dir=DIR photo.jpg other.png ...
    python -m trainer.serving.predict --dataset=cifar10 --index=111        # a test image

Rebuilds the run's output model and its task from DIR/run_config.json and
DIR/model.weights.h5 (written by trainer.main; on a run that has not finished,
best.weights.h5 or the newest checkpoint, said in one line; default DIR: the one
trainer.main trains --model in, runs/<model>_<the model's recipe's dataset, or --dataset>),
resizes each image to the model's size as evaluation does, and prints what the
run's task makes of it: a classifier its top classes with their names and
probabilities; an autoencoder writes the reconstruction as an image file (in
--output_dir) and prints its path. A task whose model takes no image (a GAN's
generator) needs none: it writes --samples generated images as one grid.
Exit status 2 with a one-line error on bad input, 5 when a file cannot be written
(one line naming it; nothing half-written is left).
"""
import dataclasses
import os
import sys

from trainer import cli  # noqa: E402

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import tensorflow as tf  # noqa: E402

from data import files, sources  # noqa: E402
from trainer import checkpoints, config as config_lib, recipes  # noqa: E402
from trainer import inputs, tasks  # noqa: E402
from trainer.serving import inference  # noqa: E402

FLAGS = flags.FLAGS


class UsageError(ValueError):
    """Flags and image files that do not fit together."""


@dataclasses.dataclass(frozen=True)
class Options:
    """What to classify, with which run (`run`'s argument)."""
    images: tuple[str, ...]
    model_dir: str
    dataset: str  # "": the run's own
    index: int | None
    split: str  # "": the dataset's evaluation split
    data_dir: str | None
    top: int  # 0: up to 5
    output_dir: str = ""  # "": DIR/predictions
    samples: int = 16  # what a generating task (serves_images False) makes


def _dataset_image(spec: sources.DatasetSpec, split: str, index: int,
                   data_dir: str | None):
    """(image, label) number `index` of a dataset split, in TFDS order."""
    ds, size = sources.load(spec, split, data_dir)
    if not 0 <= index < size:
        raise inference.InferenceError(f"--index={index} is outside {spec.name} "
                                       f"{split!r} (0..{size - 1})")
    image, label = next(iter(ds.skip(index).take(1)))
    return image.numpy(), int(label)


def run(args: Options) -> list[str]:
    """The lines to print for `args`."""
    output_dir = args.output_dir or os.path.join(args.model_dir, "predictions")
    files.refuse_links(output_dir, (args.model_dir,), "--output_dir")
    trained = inference.TrainedModel(args.model_dir)
    if not trained.presenter.serves_images:  # a generator: no input needed
        if args.images or args.index is not None:
            raise UsageError(f"a {trained.config.task} run generates its images: give "
                             f"no image files or --index (--samples=N sets how many)")
        return [f"model {trained.config.model} ({trained.config.task}) trained on "
                f"{trained.spec.name} (from {args.model_dir})",
                *trained.presenter.report_generated(trained.model,
                                                    os.path.join(output_dir, "samples"),
                                                    args.samples, seed=0)]
    if args.index is not None:
        spec = sources.get_spec(args.dataset or trained.config.dataset)
        trained.presenter.check_data(spec)
        split = args.split or spec.eval_split
        image, label = _dataset_image(spec, split, args.index, args.data_dir)
        items = [(f"{spec.name} {split} image {args.index} "
                  f"({image.shape[1]}x{image.shape[0]})", image, {"label": label},
                  f"{spec.name}_{split}_{args.index}")]
    elif args.images:
        items = [(f"{path} ({image.shape[1]}x{image.shape[0]})", image, None,
                  os.path.splitext(os.path.basename(path))[0])
                 for path, image in ((p, inference.decode_file(p)) for p in args.images)]
    else:
        raise UsageError("give image files, or --index=N (with --dataset)")
    lines = [f"model {trained.config.model} ({trained.config.task}) trained on "
             f"{trained.spec.name} (from {args.model_dir}), input "
             f"{trained.image_size}x{trained.image_size}"]
    served = trained.serve([image for _, image, _, _ in items])
    for row, (title, image, example, stem) in enumerate(items):
        lines += trained.presenter.report(
            {key: value[row] for key, value in served.items()}, title,
            inputs.eval_image(trained.data, image), example,
            os.path.join(output_dir, stem), top=args.top or 5)
    return lines


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """predict's flags (also called by tests; defining twice is a no-op). --model,
    --dataset, --model_dir and --data_dir share their names and types with
    trainer.main's: in one process, whichever command defined them first owns them."""
    cli.import_user_code(flag_values, sys.argv)
    cli.define_flag(flag_values, flags.DEFINE_string, "model_dir", "", "A training run's "
                    "directory (one that has not finished: its best.weights.h5, else its "
                    "newest checkpoint; default: the one trainer.main trains --task and "
                    "--model in, runs/<model>_<dataset>[_<task>], the dataset being "
                    "--dataset or the recipe's).")
    cli.define_flag(flag_values, flags.DEFINE_string, "model", config_lib.Config().model,
                    "Only to find the default --model_dir.")
    cli.define_flag(flag_values, flags.DEFINE_string, "task", config_lib.Config().task,
                    "Only to find the default --model_dir.")
    cli.define_flag(flag_values, flags.DEFINE_string, "dataset", "", "The dataset of "
                    "--index (default: the run's own).")
    cli.define_flag(flag_values, flags.DEFINE_integer, "index", None, "Classify this "
                    "example of --dataset instead of image files.")
    cli.define_flag(flag_values, flags.DEFINE_string, "split", "", "Split of --index "
                    "(default: the dataset's evaluation split).")
    cli.define_flag(flag_values, flags.DEFINE_string, "data_dir", None, "TFDS data dir for "
                    "--index.")
    cli.define_flag(flag_values, flags.DEFINE_integer, "top", 0, "Classes to print "
                    "(default: up to 5).")
    cli.define_flag(flag_values, flags.DEFINE_string, "output_dir", "", "Where a task "
                    "that makes images (autoencoder, gan) writes them (default: "
                    "<model_dir>/predictions).")
    cli.define_flag(flag_values, flags.DEFINE_integer, "samples", 16, "How many images "
                    "a generating task (gan) makes, in one grid.")


def default_model_dir(model: str = "", dataset: str = "",
                      task: str = "classification") -> str:
    """The directory trainer.main trains `task` in when no --model_dir is given, as
    it resolves the recipes: the model and dataset given ("": the task's or the
    model's recipe's, else the defaults)."""
    default = config_lib.Config()
    explicit = {name for name, value in (("model", model), ("dataset", dataset)) if value}
    values, _ = recipes.resolve({**default.as_dict(), "model": model or default.model,
                                 "dataset": dataset or default.dataset}, explicit,
                                tasks.get(task).recipe)
    return config_lib.default_model_dir(values["model"], values["dataset"], task)


def options_from_flags(images: list[str],
                       flag_values: flags.FlagValues = FLAGS) -> Options:
    """The Options of parsed flags and the image paths after them. Raises
    UsageError."""
    index = flag_values.index
    if index is not None and images:
        raise UsageError("give image files, or --index=N (with --dataset), not both")
    # Read as given: in a process with trainer.main's flags, --dataset may be its
    # flag, whose default is a dataset rather than "the run's own".
    dataset = flag_values.dataset if flag_values["dataset"].present else ""
    model = flag_values.model if flag_values["model"].present else ""
    return Options(images=tuple(images), dataset=dataset, index=index,
                   model_dir=flag_values.model_dir or default_model_dir(
                       model, dataset, flag_values.task),
                   split=flag_values.split, data_dir=flag_values.data_dir,
                   top=flag_values.top, output_dir=flag_values.output_dir,
                   samples=flag_values.samples)


def parse(argv: list[str]) -> Options:
    """The Options of a command line without the program name (image files and
    flags, in any order), parsed apart from the process's absl FLAGS."""
    flag_values = flags.FlagValues()
    define_flags(flag_values)
    images = flag_values(["predict", *argv])[1:]
    return options_from_flags(images, flag_values)


def main(argv: list[str]) -> None:
    try:
        options = options_from_flags(argv[1:])
        tf.config.set_visible_devices([], "GPU")  # prediction runs on the CPU
        print("\n".join(run(options)))
    except (UsageError, inference.InferenceError, sources.DatasetError,
            checkpoints.CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except files.WriteError as err:  # a task's image (a full disk): named, as training's
        print(f"error: {err}", file=sys.stderr)
        sys.exit(5)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
