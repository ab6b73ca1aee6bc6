"""EAGLE 3 / 3.1 drafters: specs, validation, training, evaluation."""
