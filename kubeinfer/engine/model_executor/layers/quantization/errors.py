"""The one error of quantized loading, apart so that every format module can raise it."""


class QuantizationError(ValueError):
    """A quantization the engine cannot serve, a flag that contradicts the checkpoint, or a broken checkpoint."""
