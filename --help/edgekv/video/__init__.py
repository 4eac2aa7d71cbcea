"""Video input: frame sources (files, cameras, RTSP, GStreamer, Jetson CSI, synthetic), the capture
thread (latest-frame-wins, reconnect with backoff) and the fps sampler that feeds ``session.ingest``."""

from edgekv.video.capture import Backoff, CaptureThread, Sampler
from edgekv.video.sources import (
    CorruptFrame,
    EndOfStream,
    FrameSource,
    LoopingSource,
    SourceError,
    SourceLost,
    SourceSpec,
    SourceUnavailable,
    csi_pipeline,
    iter_frames,
    open_source,
    parse_spec,
)

__all__ = [
    "Backoff", "CaptureThread", "CorruptFrame", "EndOfStream", "FrameSource", "LoopingSource", "Sampler", "SourceError",
    "SourceLost",
    "SourceSpec", "SourceUnavailable", "csi_pipeline", "iter_frames", "open_source", "parse_spec",
]
