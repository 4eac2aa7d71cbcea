"""Answer benchmarks: ``eval needle`` (the trained toy model, every cache policy and budget) and
``eval videoqa`` (real Qwen2.5-VL weights on MLVU, Video-MME and the streaming benchmarks OVO-Bench,
StreamingBench, RVS)."""
