"""The model-file side: opening a folder or a GGUF file, the formats' readers and names, the models on this
machine, and the bundled demo model."""
