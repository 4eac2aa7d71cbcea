"""Voice: questions spoken into a microphone or a WAV file (``listen``: VAD, segmentation, ASR)."""
