"""What a schedule of steps saves: WGAN-GP's generator updates, on the schedule
(5 critic steps, then 1 generator step: only the step that runs is computed)
against the workaround a single step forces (every step updates the critic AND
computes and all-reduces the generator's gradient, applying it 1 time in 5).

    python -m trainer.tools.schedule_benchmark --updates=100 --rounds=2

Both train the same run (--task=wgan_gp on one CIFAR-10 batch repeated, so the
input pipeline is not timed) until the generator has made --updates updates, in
turns (schedule, workaround, schedule, ...) in one process; prints each turn's
steps, seconds and seconds per generator update, and the medians' ratio.
"""
import sys
import time

from trainer import cli

cli.set_native_log_level(sys.argv)  # before TensorFlow starts

from absl import flags  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainer import build, check_step, distributed, run_settings, step  # noqa: E402
from trainer import strategy as strategy_lib  # noqa: E402
import models  # noqa: E402
from data import sources  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("updates", 100, "Generator updates per turn.", lower_bound=1)
flags.DEFINE_integer("rounds", 2, "Turns of each.", lower_bound=1)
flags.DEFINE_string("data_dir", None, "TFDS data dir (default: $TFDS_DATA_DIR).")
flags.DEFINE_integer("width", 32, "The DCGAN's width (both networks).", lower_bound=1)


def workaround(task, run):
    """One step doing both: the critic's update, and the generator's gradient
    computed and summed every step, applied only every --critic_steps-th step."""
    every = task.settings.critic_steps

    def workaround_step(batch):
        state, options = run.state, run.step_options
        metrics = task.critic_step(state, batch, options)
        generator, critic = state.models["main"], state.models["discriminator"]
        dtype = batch["image"].dtype

        def generator_loss(_):
            fake = task._generated(state, batch, dtype)  # noqa: SLF001
            return -tf.cast(tf.reshape(critic(fake, training=True), [-1]), dtype), {}

        objective = step.Objective(generator_loss, generator.trainable_variables,
                                   (generator,), state.optimizers["main"])
        gradients, _ = step.summed_gradients(objective, {}, options)  # every step
        due = tf.equal(state.step % every, every - 1)
        step.apply_or_skip(objective.optimizer, gradients, objective.variables, due)
        return metrics
    return workaround_step


def main(argv: list[str]) -> None:
    cli.refuse_arguments(argv)
    config = run_settings.validate(run_settings.from_dict(dict(
        task="wgan_gp", model="dcgan", dataset="cifar10", batch_size=64,
        optimizer="adam", learning_rate=1e-4, optimizer_options="beta_1=0.0,beta_2=0.9",
        lr_schedule="constant", precision="float32", data_dir=FLAGS.data_dir,
        model_options=f"width={FLAGS.width}",
        task_settings={"discriminator_options": f"width={FLAGS.width}"},
        model_dir="/tmp/unused")), models.names(), sources.names())
    spec = build.run_data(config).spec
    plan = build.plan(config, spec, 1)
    batch = tf.nest.map_structure(
        lambda t: tf.cast(t, tf.float32) if t.dtype == tf.float64 else t,
        check_step.global_batches(build.run_data(config, spec),
                                  build.make_task(config, spec), 1))
    strategy = tf.distribute.OneDeviceStrategy(strategy_lib.split_cpu(1)[0])
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(batch).repeat())
    every = build.make_task(config, spec).settings.critic_steps
    cases = {}
    for name in ("schedule", "workaround"):
        run = build.build_run(config, spec, plan, strategy)
        fn = run.train_steps if name == "schedule" else workaround(run.task, run)
        loop = distributed.make_train_loop(strategy, fn, state=run.state)
        steps = FLAGS.updates * (every + 1 if name == "schedule" else every)
        iterator = iter(dataset)
        loop(iterator, tf.constant(every + 1), tf.constant(0.0))  # traced, warmed
        cases[name] = (run, loop, iterator, steps)
    times = {name: [] for name in cases}
    for _ in range(FLAGS.rounds):
        for name, (run, loop, iterator, steps) in cases.items():
            before = int(run.state.optimizers["main"].iterations.numpy())
            start = time.perf_counter()
            loop(iterator, tf.constant(steps), tf.constant(0.0))[0]["skipped"][0].numpy()
            seconds = time.perf_counter() - start
            updates = int(run.state.optimizers["main"].iterations.numpy()) - before
            times[name].append(seconds / updates)
            print(f"{name}: {steps} steps, {updates} generator updates, {seconds:.1f} s, "
                  f"{1000 * seconds / updates:.1f} ms per generator update", flush=True)
    schedule, work = (float(np.median(times[n])) for n in ("schedule", "workaround"))
    print(f"median per generator update: schedule {1000 * schedule:.1f} ms, workaround "
          f"{1000 * work:.1f} ms (workaround / schedule {work / schedule:.2f}x)")


if __name__ == "__main__":
    cli.run(main)
