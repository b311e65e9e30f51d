"""Why TensorFlow will not decode an image for its size, read from its header alone.

TensorFlow's decoders refuse an image whose decoded size passes a fixed limit (a
guard against decompression bombs: a small file that decodes to gigabytes), with a
message that does not say so: "PNG size too large for int", "Failed to initialize
decoder", or for a JPEG only "Invalid JPEG data" (the size goes to the native
log). The limits, as of TensorFlow 2.21:
- PNG: width x height under 2^29 pixels (tensorflow/core/kernels/image/
  decode_image_op.cc), and each side at most 1,000,000, libpng's default
  PNG_USER_WIDTH_MAX / PNG_USER_HEIGHT_MAX, checked first;
- JPEG: width x height x the file's components under 2^29 bytes
  (tensorflow/core/lib/jpeg/jpeg_mem.cc).
"""
import struct

import tensorflow as tf

PNG_MAX_PIXELS = 1 << 29
PNG_MAX_SIDE = 1_000_000
JPEG_MAX_BYTES = 1 << 29

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR chunk (the first), or None: not a PNG."""
    if not data.startswith(_PNG_SIGNATURE) or data[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", data[16:24])


def jpeg_size(data: bytes) -> tuple[int, int, int] | None:
    """(width, height, components) from a JPEG's frame header, nothing decoded; or
    None: not a JPEG, or no readable header."""
    if not data.startswith(b"\xff\xd8"):
        return None
    try:
        height, width, components = tf.io.extract_jpeg_shape(data).numpy()
    except tf.errors.InvalidArgumentError:
        return None
    return int(width), int(height), int(components)


def too_large(data: bytes) -> str | None:
    """Why TensorFlow refuses to decode these image bytes for their size ('too large
    to decode: ...', with the size and the limit), or None: it is not that."""
    size = png_size(data)
    if size is not None:
        width, height = size
        if width * height < PNG_MAX_PIXELS and max(size) <= PNG_MAX_SIDE:
            return None
        return (f"too large to decode: a {width}x{height} PNG ({width * height:,} pixels); "
                f"TensorFlow decodes a PNG of under {PNG_MAX_PIXELS:,} pixels (2^29) "
                f"and at most {PNG_MAX_SIDE:,} a side")
    size = jpeg_size(data)
    if size is None or size[0] * size[1] * size[2] < JPEG_MAX_BYTES:
        return None
    width, height, components = size
    return (f"too large to decode: a {width}x{height} JPEG of {components} component(s) "
            f"({width * height * components:,} bytes decoded); TensorFlow decodes a "
            f"JPEG of under {JPEG_MAX_BYTES:,} bytes (2^29)")
