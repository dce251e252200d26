"""firsttoken: a multimodal inference server built for a fast first token."""
__version__ = "0.1.0"
