"""Converted multimodal recordings: the format's manifest and reader, alignment of each device's
clock to the master clock, the preprocessing stages, and the window source that serves them."""
