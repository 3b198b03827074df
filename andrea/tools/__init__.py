"""What runs a trained checkpoint: eval, sample, chat, export, inspect, and `andrea runs`."""
