"""Saved-tensor hooks that store ReLU-family activations compressed."""
