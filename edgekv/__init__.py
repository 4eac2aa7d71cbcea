"""edgekv: a streaming Qwen2.5-VL runtime with a hard, length-independent KV-cache memory cap.

    import edgekv
    rt = edgekv.Runtime.from_config("deploy.yaml")
    s = rt.session()
    s.ingest(frame, t=seconds)
    answer = s.ask("What is on the table?", max_new_tokens=64)
"""

from __future__ import annotations

__version__ = "0.1.0"  # the one place the version is written: setup.cfg reads it (version = attr: ...)
__all__ = ["Answer", "IngestResult", "Runtime", "StreamSession", "__version__"]


def __getattr__(name: str):
    # Lazy, so that `import edgekv.monitor` on a Jetson service path does not load the model code.
    if name == "Runtime":
        from edgekv.runtime import Runtime

        return Runtime
    if name in ("Answer", "IngestResult", "StreamSession"):
        from edgekv import session

        return getattr(session, name)
    raise AttributeError(f"module 'edgekv' has no attribute {name!r}")
