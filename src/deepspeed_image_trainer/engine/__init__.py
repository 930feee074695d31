"""The DeepSpeed config from flags, the training loop, numerics, DeepSpeed overrides, fine-tuning, the process group,
stops by signal, timing, seeding."""
