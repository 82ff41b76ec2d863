"""The trainer: the torchrun entry point (``python -m fuelline.trainer``), the multimodal model,
its losses, gradient compression (``fuelline.trainer.onebit``), dynamic batch size and
checkpoints. Needs torch (``pip install fuelline[trainer]``)."""
