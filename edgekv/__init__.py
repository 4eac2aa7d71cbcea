"""edgekv: a streaming Qwen2.5-VL runtime with a hard, length-independent KV-cache memory cap."""

__version__ = "0.1.0"
