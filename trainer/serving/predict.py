"""Classify images with a trained run, on the CPU:

    python -m trainer.serving.predict --model_dir=DIR photo.jpg other.png ...
    python -m trainer.serving.predict --dataset=cifar10 --index=111        # a test image

Rebuilds the model from DIR/run_config.json and DIR/model.weights.h5 (written by
trainer.main; default DIR: the one trainer.main trains --model in, runs/<model>_<the
model's recipe's dataset, or --dataset>), resizes each image to the model's size as
evaluation does, and prints the top classes with their names and probabilities.
Exit status 2 with a one-line error on bad input.
"""
import dataclasses
import sys

from trainer import cli  # noqa: E402

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import app, flags  # noqa: E402
import tensorflow as tf  # noqa: E402

from data import sources  # noqa: E402
from trainer import checkpoints, config as config_lib, main as main_lib, recipes  # noqa: E402
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


def _dataset_image(spec: sources.DatasetSpec, split: str, index: int,
                   data_dir: str | None):
    """(image, label) number `index` of a dataset split, in TFDS order."""
    ds, size = sources.load(spec, split, data_dir)
    if not 0 <= index < size:
        raise inference.InferenceError(f"--index={index} is outside {spec.name} "
                                       f"{split!r} (0..{size - 1})")
    image, label = next(iter(ds.skip(index).take(1)))
    return image.numpy(), int(label)


def format_top(probabilities, class_names, top: int) -> list[str]:
    order = probabilities.argsort()[::-1][:top]
    width = max(len(class_names[i]) for i in order)
    return [f"  {rank}. {class_names[i]:<{width}}  {100 * probabilities[i]:6.2f}%"
            for rank, i in enumerate(order, 1)]


def run(args: Options) -> list[str]:
    """The lines to print for `args`."""
    trained = inference.TrainedModel(args.model_dir)
    names = trained.class_names
    top = args.top or min(len(names), 5)
    if args.index is not None:
        spec = sources.get_spec(args.dataset or trained.config["dataset"])
        if spec.num_classes != trained.spec.num_classes:
            raise inference.InferenceError(
                f"{spec.name} has {spec.num_classes} classes but the model in "
                f"{args.model_dir} was trained on {trained.spec.name} "
                f"({trained.spec.num_classes}); pick a matching --dataset")
        split = args.split or spec.eval_split
        image, label = _dataset_image(spec, split, args.index, args.data_dir)
        items = [(f"{spec.name} {split} image {args.index} "
                  f"({image.shape[1]}x{image.shape[0]}), true class: {names[label]}",
                  image)]
    else:
        items = [(f"{path} ({image.shape[1]}x{image.shape[0]})", image)
                 for path, image in ((p, inference.decode_file(p)) for p in args.images)]
    lines = [f"model {trained.config['model']} trained on {trained.spec.name} "
             f"(from {args.model_dir}), input {trained.image_size}x{trained.image_size}"]
    probabilities = trained.probabilities([image for _, image in items])
    for (title, _), row in zip(items, probabilities):
        lines += [title, *format_top(row, names, top)]
    return lines


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """predict's flags (also called by tests; defining twice is a no-op). --model,
    --dataset, --model_dir and --data_dir share their names and types with
    trainer.main's: in one process, whichever command defined them first owns them."""
    main_lib.define_flag(flag_values, flags.DEFINE_string, "model_dir", "", "A finished run's "
               "directory (default: runs/<--model>_<dataset>, as trainer.main names "
               "it, the dataset being --dataset or the model's recipe's).")
    main_lib.define_flag(flag_values, flags.DEFINE_string, "model", config_lib.Config().model,
               "Only to find the default --model_dir.")
    main_lib.define_flag(flag_values, flags.DEFINE_string, "dataset", "", "The dataset of "
               "--index (default: the run's own).")
    main_lib.define_flag(flag_values, flags.DEFINE_integer, "index", None, "Classify this "
               "example of --dataset instead of image files.")
    main_lib.define_flag(flag_values, flags.DEFINE_string, "split", "", "Split of --index "
               "(default: the dataset's evaluation split).")
    main_lib.define_flag(flag_values, flags.DEFINE_string, "data_dir", None, "TFDS data dir for "
               "--index.")
    main_lib.define_flag(flag_values, flags.DEFINE_integer, "top", 0, "Classes to print "
               "(default: up to 5).")


def default_model_dir(model: str, dataset: str = "") -> str:
    """The directory trainer.main trains `model` in when no --model_dir is given:
    on `dataset`, or by default on the model's recipe's dataset."""
    dataset = dataset or recipes.RECIPES.get(model, {}).get(
        "dataset", config_lib.Config().dataset)
    return config_lib.default_model_dir(model, dataset)


def options_from_flags(images: list[str],
                       flag_values: flags.FlagValues = FLAGS) -> Options:
    """The Options of parsed flags and the image paths after them. Raises
    UsageError."""
    index = flag_values.index
    if (index is None) == (not images):
        raise UsageError("give image files, or --index=N (with --dataset), not both")
    # Read as given: in a process with trainer.main's flags, --dataset may be its
    # flag, whose default is a dataset rather than "the run's own".
    dataset = flag_values.dataset if flag_values["dataset"].present else ""
    return Options(images=tuple(images), dataset=dataset, index=index,
                   model_dir=flag_values.model_dir or default_model_dir(
                       flag_values.model, dataset),
                   split=flag_values.split, data_dir=flag_values.data_dir,
                   top=flag_values.top)


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


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=main_lib.parse_flags)
