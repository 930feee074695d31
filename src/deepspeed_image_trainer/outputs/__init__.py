"""Checkpoints (published by renames, written in the background, converted to universal ones), run folders and their
locks, the history, DeepSpeed's monitors, plots."""
