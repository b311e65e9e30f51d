"""One evaluation: the task's metrics over the whole eval split (the distributed
eval loop), and its predictions on a fixed handful of test examples for the
pictures (TensorBoard, summary.png)."""
import numpy as np
import tensorflow as tf

from data import sources
from trainer import distributed, inputs

NUM_SAMPLES = 20           # test examples in the prediction pictures


def load_samples(spec: sources.DatasetSpec, image_size: int, data_dir: str | None,
                 download: bool, count: int = NUM_SAMPLES) -> dict:
    """The first `count` eval examples, the same every evaluation and every run:
    "image" uint8 at the model's size (for display and prediction) and what else
    the source gives ("label")."""
    ds, available = sources.load(spec, spec.eval_split, data_dir, download)
    images, labels = [], []
    for image, label in ds.take(min(count, available)):
        images.append(inputs.resize_uint8(image, image_size))
        labels.append(int(label))
    return {"image": np.stack(images), "label": np.array(labels)}


def evaluate(eval_loop, eval_dataset, plan, spec: sources.DatasetSpec, task, model=None,
             samples: dict | None = None) -> dict:
    """`test_<name>` for every scalar metric of the task's eval step,
    `test_examples` (the weight of its loss), every non-scalar metric under its
    name (e.g. `confusion_matrix`: counts stay integers), and `samples` with the
    task's predictions if given. plan: trainer.build.Plan (its eval_steps, and
    eval_examples: the count `spec`'s data promises, checked against those
    evaluated)."""
    sums = tf.nest.map_structure(lambda t: t.numpy(), eval_loop(
        iter(eval_dataset), tf.constant(plan.eval_steps)))
    if "loss" not in sums:
        raise distributed.StepContractError(
            f"task {task.name}'s eval_metrics returned {sorted(sums)}, without 'loss' "
            f"(its weight counts the examples evaluated)")
    result = {f"test_{key}": value for key, value in distributed.means(sums).items()}
    result["test_examples"] = int(round(float(sums["loss"][1])))
    # A file cut short at a record boundary reads without error: count.
    sources.check_count(spec, True, result["test_examples"], plan.eval_examples)
    for key, (total, _) in sums.items():
        if np.size(total) > 1:
            rounded = np.rint(total)
            result[key] = rounded.astype(np.int64) if np.allclose(total, rounded) else total
    if samples is not None:
        result["samples"] = task.sample_predictions(model, samples)
    return result
