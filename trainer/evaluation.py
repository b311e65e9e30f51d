"""One evaluation: loss and accuracy over the whole eval split (the distributed eval
loop), its confusion matrix, and predictions on a fixed handful of test images for
the pictures (TensorBoard, summary.png)."""
import numpy as np
import tensorflow as tf

from data import sources
from trainer import distributed
from trainer.serving import inference

NUM_SAMPLES = 20           # test images in the prediction grids
MAX_CONFUSION_CLASSES = 100  # beyond this a confusion picture is unreadable anyway


def load_samples(spec: sources.DatasetSpec, image_size: int, data_dir: str | None,
                 download: bool, count: int = NUM_SAMPLES) -> dict:
    """The first `count` eval images: uint8 at the model's size (for display) and
    labels. The same images every evaluation and every run."""
    ds, available = sources.load(spec, spec.eval_split, data_dir, download)
    count = min(count, available)
    images, labels = [], []
    for image, label in ds.take(count):
        images.append(inference.resize_uint8(image, image_size))
        labels.append(int(label))
    return {"images": np.stack(images), "labels": np.array(labels)}


def predict_samples(model, samples: dict, spec: sources.DatasetSpec,
                    tta: dict | None = None) -> dict:
    """samples + the model's predicted class and its probability per image (an eager
    call on this worker alone: no collective, so the chief may do it by itself)."""
    probabilities = inference.class_probabilities(model, samples["images"], spec,
                                                  tta)
    return {**samples, "predictions": probabilities.argmax(-1),
            "confidence": probabilities.max(-1)}


def evaluate(eval_loop, eval_dataset, eval_steps: int, model=None,
             samples: dict | None = None, spec: sources.DatasetSpec | None = None,
             tta: dict | None = None) -> dict:
    """`test_<name>` for every scalar metric of the eval step, `test_examples`,
    `confusion` (counts, rows = true class) if the step makes one, and `samples`
    with predictions if given."""
    sums = tf.nest.map_structure(lambda t: t.numpy(), eval_loop(iter(eval_dataset),
                                                                tf.constant(eval_steps)))
    result = {f"test_{key}": value for key, value in distributed.means(sums).items()}
    result["test_examples"] = int(round(float(sums["loss"][1])))
    if "confusion" in sums:
        result["confusion"] = np.rint(sums["confusion"][0]).astype(np.int64)
    if samples is not None:
        result["samples"] = predict_samples(model, samples, spec, tta)
    return result
