"""mfd-sglang: Multi-Future Drafting speculative decoding, as an SGLang plugin and a reference engine."""

__version__ = "0.1.0"
