"""The pipeline's pass names, importable without the passes (the CLI offers them as
`--dump-after` choices and must start fast); modulec.lower.passes asserts they match."""

PASS_NAMES = ("lower", "tensor_parallel", "sequence_parallel", "lora", "fuse", "derive_backward",
              "tp_overlap")
