"""After training: checkpoints turned into other tools' formats and back (export, import, average, ONNX)."""
