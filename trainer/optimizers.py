"""Optimizers by name, with decoupled weight decay and float16 loss scaling."""
import keras

NAMES = ("adam", "adamw", "sgd")


def create(name: str, learning_rate, variables, weight_decay: float = 0.0,
           momentum: float = 0.9, precision: str = "float32",
           ema_decay: float = 0.0) -> keras.optimizers.Optimizer:
    """Builds and *builds* the optimizer (slot variables exist before the first step).

    Call inside `strategy.scope()`: Keras 3 optimizers must create their slots there,
    or the first distributed `apply_gradients` fails (keras-team/keras#23085).
    Weight decay is decoupled (AdamW style) and skips 1-D variables: biases and
    batch-norm scales/offsets. ema_decay > 0 keeps a moving average of the weights
    (see trainer/averaging.py).
    """
    decay = weight_decay or None
    ema = dict(use_ema=ema_decay > 0, ema_momentum=ema_decay)
    if name == "adam":
        optimizer = keras.optimizers.Adam(learning_rate, weight_decay=decay, **ema)
    elif name == "adamw":
        optimizer = keras.optimizers.AdamW(learning_rate, weight_decay=weight_decay, **ema)
    elif name == "sgd":
        optimizer = keras.optimizers.SGD(learning_rate, momentum=momentum, nesterov=True,
                                         weight_decay=decay, **ema)
    else:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(NAMES)}")
    if weight_decay:
        optimizer.exclude_from_weight_decay(var_list=[v for v in variables
                                                      if len(v.shape) <= 1])
    if precision == "mixed_float16":
        # float16 gradients underflow: scale the loss up, unscale the gradients, and
        # skip steps whose gradients overflow (dynamic scale).
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.build(variables)
    return optimizer
