"""Flags shared by the launcher and the training script, the CLI error edge, and the two commands' main functions."""
