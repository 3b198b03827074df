"""ANDREA: raw chat data to a trained GPT checkpoint, on an engine of paired forward/backward ops."""

__version__ = "0.1.0"
