"""Classify images with a trained run, on the CPU:

    python -m trainer.predict --model_dir=DIR photo.jpg other.png ...
    python -m trainer.predict --dataset=cifar10 --index=111        # a test image

Rebuilds the model from DIR/run_config.json and DIR/model.weights.h5 (written by
trainer.main; default DIR: runs/<model>_<dataset>, as trainer.main uses), resizes
each image to the model's size as evaluation does, and prints the top classes with
their names and probabilities. Exit status 2 with a one-line error on bad input.
"""
import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from data import sources  # noqa: E402
from trainer import checkpoints, inference  # noqa: E402


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


def run(args) -> list[str]:
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


def parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("images", nargs="*", help="image files (JPEG, PNG, GIF, BMP)")
    parser.add_argument("--model_dir", default="", help="a finished run's directory "
                        "(default: runs/<--model>_<--dataset>)")
    parser.add_argument("--model", default="cifar_cnn",
                        help="only to find the default --model_dir")
    parser.add_argument("--dataset", default="", help="the dataset of --index "
                        "(default: the run's own)")
    parser.add_argument("--index", type=int, default=None,
                        help="classify this example of --dataset instead of files")
    parser.add_argument("--split", default="", help="split of --index (default: the "
                        "evaluation split)")
    parser.add_argument("--data_dir", default=None, help="TFDS data dir for --index")
    parser.add_argument("--top", type=int, default=0,
                        help="classes to print (default: up to 5)")
    args = parser.parse_args(argv)
    if (args.index is None) == (not args.images):
        parser.error("give image files, or --index=N (with --dataset), not both")
    args.model_dir = args.model_dir or os.path.join(
        "runs", f"{args.model}_{args.dataset or 'cifar10'}")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    tf.config.set_visible_devices([], "GPU")  # prediction runs on the CPU
    try:
        print("\n".join(run(args)))
    except (inference.InferenceError, sources.DatasetError,
            checkpoints.CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
