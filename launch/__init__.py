"""Entry points and the model trained by the torchrun launcher."""
