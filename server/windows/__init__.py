"""Aligned windows of multimodal recordings: cutting and resampling, the served source, and the preprocessing stages."""
