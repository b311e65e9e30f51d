"""One evaluation: the task's metrics over the whole eval split (the distributed
eval loop), and its predictions on a fixed handful of test examples for the
pictures (TensorBoard, summary.png). A task may first run a function over a whole
split (`SplitMapper`, e.g. the training set's features for a kNN classifier) and
finish the summed metrics itself (e.g. a Fréchet distance)."""
from typing import Callable

import numpy as np
import tensorflow as tf

from data import pipeline, sources
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


class SplitMapper:
    """Runs a function over every example of a split once, on every replica, as
    evaluation reads it (no augmentation), and gathers its per-example outputs:
    what a task's `before_evaluation(state, splits)` uses. Each split's pipeline is
    built once (in memory when the run's training data is)."""

    def __init__(self, strategy: tf.distribute.Strategy, data: inputs.RunData, state,
                 cache: bool = True):
        self.strategy, self.data, self.spec, self.state = strategy, data, data.spec, state
        self.cache = cache
        self._datasets: dict[str, tuple] = {}
        self._steps: dict = {}

    def map(self, fn: Callable[..., dict], split: str | None = None) -> dict[str, np.ndarray]:
        """fn(state, batch) -> {name: per-example tensor [B, ...]}, per replica, over
        `split` (default: the training split); returns {name: array [N, ...]} of the
        split's N examples (padding dropped), with "label" and "index" of each."""
        split = split or self.spec.train_split
        if split not in self._datasets:
            _, count = self.data.load(split)
            batch = self.data.eval_batch_size or self.data.batch_size
            dataset = self.strategy.distribute_datasets_from_function(
                inputs.eval_input_fn(self.data, cache=self.cache, split=split))
            self._datasets[split] = (dataset, pipeline.eval_steps(count, batch))
        dataset, steps = self._datasets[split]
        key = (id(fn), split)
        if key not in self._steps:
            state = self.state

            def replica(batch):
                values = {"label": batch["label"], "index": batch["index"],
                          **fn(state, batch), "mask": batch["mask"]}
                context = tf.distribute.get_replica_context()
                return {name: context.all_gather(v, axis=0) for name, v in values.items()}

            @tf.function
            def one_batch(iterator):
                return self.strategy.run(replica, args=(next(iterator),))
            self._steps[key] = one_batch
        one_batch = self._steps[key]
        iterator = iter(dataset)
        parts: dict[str, list] = {}
        for _ in range(steps):
            gathered = self.strategy.experimental_local_results(one_batch(iterator))[0]
            for name, value in gathered.items():
                parts.setdefault(name, []).append(value.numpy())
        values = {name: np.concatenate(chunks) for name, chunks in parts.items()}
        keep = values.pop("mask") > 0
        return {name: value[keep] for name, value in values.items()}


class Stopped(Exception):
    """A stop signal arrived during an evaluation; it ended between two steps."""


def evaluate(eval_loop, eval_dataset, plan, spec: sources.DatasetSpec, task, model=None,
             samples: dict | None = None, state=None,
             splits: SplitMapper | None = None,
             stop_requested: Callable[[], bool] = lambda: False) -> dict:
    """`test_<name>` for every scalar metric of the task's eval step,
    `test_examples` (the weight of its loss), every non-scalar metric under its
    name (e.g. `confusion_matrix`: counts stay integers), and `samples` with the
    task's predictions if given, all as the task finishes them
    (`finish_evaluation`); first the task's `before_evaluation(state, splits)`.
    plan: trainer.build.Plan (its eval_steps, and eval_examples: the count
    `spec`'s data promises, checked against those evaluated)."""
    if state is not None:
        task.before_evaluation(state, splits)
    # One step per call, summed here: a stop signal ends it within a step, not
    # after the whole test set.
    iterator, sums = iter(eval_dataset), None
    for _ in range(plan.eval_steps):
        if stop_requested():
            raise Stopped()
        part = tf.nest.map_structure(lambda t: t.numpy(),
                                     eval_loop(iterator, tf.constant(1)))
        sums = part if sums is None else tf.nest.map_structure(np.add, sums, part)
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
    result = task.finish_evaluation(result)
    if samples is not None:
        result["samples"] = task.presenter(task).sample_predictions(model, samples)
    return result
