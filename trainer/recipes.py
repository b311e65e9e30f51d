"""Each model's default recipe, from the founding documents.

A flag given on the command line always wins over the recipe; main logs which
value came from where. Values not in a recipe keep the Config defaults.
"""
# airbench94 (Jordan 2024, arXiv 2404.00498; 94.01% in 9.9 epochs on an A100),
# translated: batch 1024, Nesterov SGD momentum 0.85; its lr 11.5 per 1024 examples
# divided by (1 + 1/(1 - 0.85)) on a summed loss is 1.5 on our mean loss; its
# weight decay 0.0153 passes through momentum, x 1/(1 - 0.85), which is 0.0089 x lr
# in our decoupled form. The schedule rises linearly from 0.2 x peak over 23% of
# the run to the peak and falls to 0.07 x peak (airbench's triangle). Batch-norm
# biases learn 64x faster; every trained variable is decayed, the batch-norm and
# whitening biases too (--decay_vectors: through its per-group weight_decay of
# wd/lr, airbench's decay per step is the same for all of them); label smoothing
# 0.2; 2-px reflect translation, alternating flip; Lookahead every 5 steps; 6-view
# test-time augmentation. 10 epochs: 480 steps (airbench: 476 in 9.9). The
# whitening layer's bias trains for the first 3 epochs only, as airbench's
# (requires_grad=False from epoch 3: no update, no decay); with
# --model_options=whiten=false there is no whitening layer: add --freeze_after_epochs=.
AIRBENCH = dict(dataset="cifar10", image_size=32, batch_size=1024, optimizer="sgd",
                momentum=0.85, learning_rate=1.5, lr_schedule="linear", warmup_epochs=2.3,
                warmup_start_factor=0.2, min_learning_rate=0.105, weight_decay=0.0089,
                decay_vectors=True, lr_multipliers="*/beta=64",
                freeze_after_epochs="whiten/*=3", label_smoothing=0.2, augment="translate",
                alternating_flip=True, lookahead_every=5, lookahead_decay=0.95,
                tta_flip=True, tta_translate=True, epochs=10)

RECIPES: dict[str, dict] = {
    # Seed 1: CIFAR-10 convnet, Adam 1e-3, global batch 1024, 50 epochs (80.79% on TPU).
    "cifar_cnn": dict(dataset="cifar10", image_size=32, batch_size=1024, optimizer="adam",
                      learning_rate=1e-3, lr_schedule="constant", warmup_epochs=0.0,
                      epochs=50),
    # A small residual net on CIFAR-10 as a modern baseline (SGD-Nesterov, cosine).
    "resnet": dict(dataset="cifar10", image_size=32, batch_size=128, optimizer="sgd",
                   learning_rate=0.1, lr_schedule="cosine", warmup_epochs=1.0,
                   weight_decay=5e-4 * 0.1, epochs=30),
    # A fast CIFAR-10 recipe after the speed records (Page's ResNet-9, airbench): a
    # half-width ResNet-9 with fast batch-norm, SGD-Nesterov, one-cycle (linear
    # warmup to 0.4 over a quarter of the run, linear to 0), label smoothing 0.2,
    # flip-and-translate augmentation, flip TTA. Page's weight decay 5e-4 is
    # PyTorch's, added to the gradient before momentum 0.9, which multiplies it by
    # 1 / (1 - 0.9): 5e-3 in our decoupled form (measured, seed 0: 86.9% vs 85.9%
    # with 5e-4). Weight averaging is off: --ema_decay=0.99 ended at 85.4% against
    # the raw weights' 86.9% in the same run (batch-norm's fast statistics follow
    # the raw weights, not their average).
    "resnet_fast": dict(dataset="cifar10", image_size=32, batch_size=512,
                        optimizer="sgd", momentum=0.9, learning_rate=0.4,
                        lr_schedule="linear", warmup_epochs=2.5, weight_decay=5e-3,
                        label_smoothing=0.2, tta_flip=True, epochs=10),
    "airbench": AIRBENCH,
    # The same at widths 32:64:128 (1/6 of the FLOPs), 5 epochs: the
    # 3-minute recipe (airbench's peak at 23% of the run here too).
    "airbench_small": {**AIRBENCH, "warmup_epochs": 1.15, "epochs": 5},  # 23% warmup
    # Seed 2, flowers at 192x192: the codelab's SqueezeNet target is 80% in 35 epochs.
    "squeezenet": dict(dataset="tf_flowers", image_size=192, batch_size=64,
                       optimizer="adam", learning_rate=5e-3, lr_schedule="exponential",
                       warmup_epochs=2.0, lr_decay_rate=0.9, epochs=35),
    "convnet": dict(dataset="tf_flowers", image_size=192, batch_size=64, optimizer="adam",
                    learning_rate=1e-3, lr_schedule="exponential", warmup_epochs=2.0,
                    lr_decay_rate=0.9, epochs=35),
    # Model Garden's ResNet-50 on ImageNet (76.1% top-1 in 90 epochs at batch 4096 on
    # TPU): SGD-Nesterov 0.9, lr 0.1 per 256 examples (1.6 at 4096; it follows
    # --batch_size unless --learning_rate is given) after 5 warm-up epochs, cosine
    # decay, label smoothing 0.1, the zero-init last gamma of each block
    # (models/resnet50.py), bf16 (precision auto on a TPU). Its weight decay, an L2
    # of 1e-4 on kernels added to the gradient before momentum 0.9, is x 1/(1 - 0.9)
    # in our decoupled form: 1e-3 (kernels only, as ours never decays biases or
    # batch-norm). Inception crop for training, central 224/256 crop for evaluation
    # (the dataset's augmentation when images vary in size).
    "resnet50": dict(dataset="imagenet2012", image_size=224, batch_size=4096,
                     optimizer="sgd", momentum=0.9, learning_rate_per_256=0.1,
                     lr_schedule="cosine", warmup_epochs=5.0, weight_decay=1e-3,
                     label_smoothing=0.1, epochs=90),
    # Xception fine-tuning: the codelab's lrfn (ramp-up 5 epochs from 1e-5 to
    # 5e-5 x 8 TPU cores, then x0.8 per epoch), 12 epochs.
    "xception": dict(dataset="tf_flowers", image_size=192, batch_size=64, optimizer="adam",
                     learning_rate=4e-4, lr_schedule="rampup", warmup_epochs=5.0,
                     sustain_epochs=0.0, lr_decay_rate=0.8, min_learning_rate=1e-5,
                     epochs=12),
}


def resolve(values: dict, explicit: set[str], task_recipe: dict | None = None
            ) -> tuple[dict, dict[str, str]]:
    """Applies the task's recipe (e.g. its model) and then values[model]'s recipe
    under the explicit flags; the task's recipe wins over the model's.

    Returns (values, origin) where origin[name] is "flag", "task recipe" or
    "recipe" for every recipe key, for the log.
    """
    origin: dict[str, str] = {}
    resolved = dict(values)
    for name, value in (task_recipe or {}).items():
        if name in explicit:
            origin[name] = "flag"
        else:
            resolved[name], origin[name] = value, "task recipe"
    recipe = dict(RECIPES.get(resolved["model"], {}))
    per_256 = recipe.pop("learning_rate_per_256", None)
    if per_256 is not None:  # scaled with the batch (flag or recipe): Goyal et al.'s rule
        batch = resolved["batch_size"] if "batch_size" in explicit else recipe.get(
            "batch_size", resolved["batch_size"])
        recipe["learning_rate"] = per_256 * batch / 256
    for name, value in recipe.items():
        if name in explicit:
            origin[name] = "flag"
        elif name not in origin and name in resolved:
            resolved[name], origin[name] = value, "recipe"
    return resolved, origin
