"""A live stream's session (``Runtime.session()``): ``stream`` coordinates; ``clock``, ``ingest``, ``memory``
and ``answer`` are its rooms; ``results`` what it returns."""

from edgekv.session.answer import WindowEmpty
from edgekv.session.clock import MAX_ABS_SECONDS
from edgekv.session.results import Answer, Counters, IngestResult, YesNo
from edgekv.session.stream import StreamSession

__all__ = ["MAX_ABS_SECONDS", "Answer", "Counters", "IngestResult", "StreamSession", "WindowEmpty", "YesNo"]
