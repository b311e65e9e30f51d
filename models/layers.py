"""Building blocks from the CIFAR-10 speed records (airbench, arXiv 2404.00498) that
any model may use: a patch-whitening first layer initialised from the training
data, and the identity (dirac) initialisation of 3x3 convolutions."""
import keras
import numpy as np
from keras import layers


@keras.saving.register_keras_serializable(package="tfloop")
class PatchWhitening(layers.Conv2D):
    """A frozen k x k 'valid' convolution whose filters whiten the image's k x k
    patches: the eigenvectors of the patch covariance, each divided by the square
    root of its eigenvalue, and their negatives (so a ReLU/GELU after it loses
    nothing). 2 * k * k * channels filters; only the bias trains.

    The kernel is set by `init_from_data(images)`, which the training loop calls
    at start-up (a resumed run then restores it from the checkpoint; with --weights
    the loop leaves it as loaded).
    """

    def __init__(self, channels: int = 3, kernel_size: int = 2, eps: float = 5e-4,
                 **kwargs):
        if not isinstance(kernel_size, int):  # (k, k), from get_config
            kernel_size = kernel_size[0]
        kwargs.update(filters=2 * kernel_size * kernel_size * channels,
                      kernel_size=kernel_size, padding="valid", use_bias=True)
        super().__init__(**kwargs)
        self.channels, self.eps = channels, eps

    def build(self, input_shape):
        super().build(input_shape)
        self.kernel.trainable = False  # the whitening is data, not learned

    def init_from_data(self, images: np.ndarray) -> None:
        """Sets the kernel from float images [N, H, W, C] (as the model sees them)."""
        kernel = whitening_kernel(np.asarray(images), self.kernel_size[0], self.eps)
        self.kernel.assign(kernel.astype(np.float32))

    def get_config(self):
        config = super().get_config()
        config.update(channels=self.channels, eps=self.eps)
        config.pop("filters")
        for key in ("padding", "use_bias"):
            config.pop(key)
        return config


def patches(images: np.ndarray, size: int) -> np.ndarray:
    """Every size x size patch of every image, flattened: [N * P, size * size * C]
    in the (row, column, channel) order of a Keras kernel."""
    n, h, w, c = images.shape
    windows = np.lib.stride_tricks.sliding_window_view(images, (size, size), axis=(1, 2))
    # windows: [N, h-size+1, w-size+1, C, size, size] -> [.., size, size, C]
    return windows.transpose(0, 1, 2, 4, 5, 3).reshape(-1, size * size * c)


def patch_covariance(images: np.ndarray, size: int, chunk: int = 256) -> np.ndarray:
    """The second moment of the size x size patches about the origin (as airbench),
    in float64, a chunk of images at a time: all patches of 5,000 CIFAR images at
    once take 0.5 GB, of 5,000 192-px flowers 17 GB."""
    dim = size * size * images.shape[-1]
    total, count = np.zeros((dim, dim)), 0
    for start in range(0, len(images), chunk):
        flat = patches(np.asarray(images[start:start + chunk], np.float64), size)
        total += flat.T @ flat
        count += len(flat)
    return total / count


def whitening_kernel(images: np.ndarray, size: int, eps: float = 5e-4) -> np.ndarray:
    """[size, size, C, 2 * size * size * C]: filters W with W^T cov W ~= identity on
    the patches of `images`, largest eigenvalue first, then the same negated. Each
    eigenvector's sign is fixed (largest component positive), so every worker and
    every BLAS computes the same filters in the same places."""
    eigenvalues, eigenvectors = np.linalg.eigh(patch_covariance(images, size))
    order = np.argsort(eigenvalues)[::-1]
    eigenvalues, eigenvectors = eigenvalues[order], eigenvectors[:, order]
    largest = np.argmax(np.abs(eigenvectors), axis=0)
    eigenvectors = eigenvectors * np.sign(eigenvectors[largest, np.arange(len(order))])
    filters = eigenvectors / np.sqrt(eigenvalues + eps)
    filters = np.concatenate([filters, -filters], axis=1)
    return filters.reshape(size, size, images.shape[-1], -1)


@keras.saving.register_keras_serializable(package="tfloop")
class Dirac(keras.initializers.Initializer):
    """`base`, except that the first min(in, out) filters of a conv kernel
    [kh, kw, in, out] are the identity: filter i passes input channel i through its
    centre tap. A block then starts near the identity map (airbench: 21 -> 18 epochs
    to 94%)."""

    def __init__(self, base: str | dict | keras.initializers.Initializer = "he_normal"):
        self.base = keras.initializers.get(base)

    def __call__(self, shape, dtype=None):
        kernel = keras.ops.convert_to_numpy(self.base(shape, dtype="float32"))
        kh, kw, channels_in, channels_out = shape
        for i in range(min(channels_in, channels_out)):
            kernel[:, :, :, i] = 0.0
            kernel[kh // 2, kw // 2, i, i] = 1.0
        return keras.ops.convert_to_tensor(kernel, dtype=dtype)

    def get_config(self):
        return {"base": keras.initializers.serialize(self.base)}


def torch_default_init() -> keras.initializers.Initializer:
    """PyTorch's Conv2d default, U(+-1/sqrt(fan_in)): smaller than He's."""
    return keras.initializers.VarianceScaling(1 / 3, "fan_in", "uniform")


def init_from_data(model: keras.Model, images: np.ndarray) -> list[str]:
    """Calls `init_from_data(images)` on every layer of `model` that has it; returns
    their names (empty: the model has none, `images` are not needed)."""
    done = []
    for layer in model._flatten_layers(include_self=False):  # noqa: SLF001
        if hasattr(layer, "init_from_data"):
            layer.init_from_data(images)
            done.append(layer.name)
    return done


def needs_data(model: keras.Model) -> bool:
    return any(hasattr(layer, "init_from_data")
               for layer in model._flatten_layers(include_self=False))  # noqa: SLF001
