"""Random draws inside a training step that N replicas and a resumed run agree on.

A stateful op (`tf.random.normal`, `tf.random.uniform`, a `tf.random.Generator`)
draws other numbers on each replica and after a resume: replicas' copies of the
weights drift apart and exact resume breaks (the loop warns and check_step fails
naming the op). Draw instead from the step's seed, a pure function of (--seed,
the step counter, a name you give the draw):

- the SAME on every replica (DP-SGD's noise on the summed gradient, a random
  projection, a coin that decides the whole step): `step_seed(state, "noise")`
  with any `tf.random.stateless_*`;
- one draw PER EXAMPLE, whichever replica holds it (a random start of an attack, a
  mask, a latent vector for each example): `per_example_normal(state, batch,
  "start", shape)` / `per_example_uniform`. Each example's numbers are keyed by its
  "index" (the pipeline gives every example one), so splitting the batch over 1
  or 8 replicas, or into micro-batches, draws the same numbers for it. (A draw per
  replica, e.g. a stateless op seeded by the replica id, would differ with the
  split: check_step fails it.)

Per-example draws use SplitMix64 (Steele et al. 2014) over (the step's key, the
example's index, the element's position): vectorized, XLA-compatible, the same on
every device; good statistical quality for noise, not a cryptographic generator.
"""
import zlib

import numpy as np
import tensorflow as tf

_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (the golden ratio)


def _salt(name) -> int:
    """A draw's name -> a 31-bit number (stable across processes: not hash())."""
    if isinstance(name, int):
        return name & 0x7FFFFFFF
    return zlib.crc32(str(name).encode()) & 0x7FFFFFFF


def step_seed(state, name) -> tf.Tensor:
    """A [2] int64 seed for `tf.random.stateless_*`: a function of (--seed, the
    step counter, `name`), the same on every replica, new every step, the same
    again after a resume."""
    base = tf.stack([tf.constant(state.seed, tf.int64), tf.cast(state.step, tf.int64)])
    return tf.random.experimental.stateless_fold_in(base, _salt(name))


def fixed_seed(seed: int, name) -> tf.Tensor:
    """A [2] int64 seed of (--seed, `name`) alone, the same at every step (e.g. the
    fixed latent vectors a GAN is evaluated on)."""
    return tf.random.experimental.stateless_fold_in(
        tf.constant([seed, 0x5EED], tf.int64), _salt(name))


def _mix(z: tf.Tensor) -> tf.Tensor:
    """SplitMix64's output function on uint64 (wrapping multiplies)."""
    shift = lambda x, n: tf.bitwise.right_shift(x, tf.constant(n, tf.uint64))  # noqa: E731
    z = tf.bitwise.bitwise_xor(z, shift(z, 30)) * tf.constant(0xBF58476D1CE4E5B9, tf.uint64)
    z = tf.bitwise.bitwise_xor(z, shift(z, 27)) * tf.constant(0x94D049BB133111EB, tf.uint64)
    return tf.bitwise.bitwise_xor(z, shift(z, 31))


def _as_uint64(t: tf.Tensor) -> tf.Tensor:
    return tf.cast(tf.cast(t, tf.int64), tf.uint64)  # (two's complement: -1 -> 2^64 - 1)


def per_example_bits(seed: tf.Tensor, keys: tf.Tensor, count: int) -> tf.Tensor:
    """uint64 [B, count]: `count` random 64-bit words per example, a function of
    (seed [2], the example's key [B]) and the word's position alone."""
    seed = _as_uint64(seed)
    stream = _mix(_mix(seed[0] + tf.constant(_GAMMA, tf.uint64)) ^ seed[1])
    start = _mix(stream ^ _mix(_as_uint64(keys) * tf.constant(_GAMMA, tf.uint64)))  # [B]
    positions = tf.range(1, count + 1, dtype=tf.int64)
    offsets = _as_uint64(positions) * tf.constant(_GAMMA, tf.uint64)  # [count]
    return _mix(start[:, None] + offsets[None, :])


def _uniform_from_bits(bits: tf.Tensor) -> tf.Tensor:
    """uint64 -> float64 in the open interval (0, 1): the top 53 bits, centred."""
    top = tf.cast(tf.bitwise.right_shift(bits, tf.constant(11, tf.uint64)), tf.float64)
    return (top + 0.5) * (2.0 ** -53)


def _keys(batch: dict) -> tf.Tensor:
    if "index" not in batch:
        raise ValueError("per-example draws need the batch's 'index' (each example's "
                         "key; the run's input pipeline gives every batch one)")
    return batch["index"]


def per_example_uniform(state, batch: dict, name, shape=(), minval: float = 0.0,
                        maxval: float = 1.0, dtype=tf.float32) -> tf.Tensor:
    """[B, *shape] uniform in (minval, maxval): each example's numbers a function
    of (--seed, the step, `name`, its "index"), whichever replica or micro-batch
    holds it."""
    return _per_example(state, batch, name, shape, dtype,
                        lambda u: minval + (maxval - minval) * u)


def per_example_normal(state, batch: dict, name, shape=(), dtype=tf.float32) -> tf.Tensor:
    """[B, *shape] standard normal, keyed like `per_example_uniform`."""
    return _per_example(state, batch, name, shape, dtype, tf.math.ndtri)


def _per_example(state, batch, name, shape, dtype, transform) -> tf.Tensor:
    keys = _keys(batch)
    return fixed_per_example(step_seed(state, name), keys, shape, dtype, transform)


def fixed_per_example(seed: tf.Tensor, keys: tf.Tensor, shape=(), dtype=tf.float32,
                      transform=tf.math.ndtri) -> tf.Tensor:
    """[B, *shape] draws for examples `keys` from `seed` (default: normal)."""
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    values = transform(_uniform_from_bits(per_example_bits(seed, keys, count)))
    return tf.cast(tf.reshape(values, [-1, *shape]), dtype)


# --- what the loop and check_step look for in a traced step ---------------------------

# Ops that draw from hidden state: other numbers on each replica and after a resume.
STATEFUL_RANDOM_OPS = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
    "RandomShuffle", "RandomCrop", "Multinomial", "StatefulUniform",
    "StatefulUniformInt", "StatefulUniformFullInt", "StatefulStandardNormal",
    "StatefulStandardNormalV2", "StatefulTruncatedNormal", "StatefulRandomBinomial",
    "RngSkip", "RngReadAndSkip", "NonDeterministicInts"})


def stateful_random_ops(graph: tf.Graph) -> list[str]:
    """'Op (node name)' of every stateful random op in `graph` and the functions it
    calls (loops, conditionals, XLA-compiled steps)."""
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes += list(function.node_def)
    return sorted({f"{node.op} ({node.name})" for node in nodes
                   if node.op in STATEFUL_RANDOM_OPS})
