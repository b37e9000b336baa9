"""Training a `.module` language model (`modulec train`): batches from a flat token file
(runtime.train.data), a step on the GPU (runtime.cuda.step.TrainStep) or the CPU reference
(runtime.train.backends), resumable HF checkpoints (runtime.train.checkpoint).
See docs/training.md."""
