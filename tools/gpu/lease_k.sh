#!/usr/bin/env bash
# Issue 32, the third call of 2026-11-27: model.pair_route "auto" now takes the graph on CUDA (AUTO_PAIR_GRAPH);
# the whole `-m gpu` count with it (every CUDA session test then streams its pairs through the graphs).
WHEELS=.whl source "$(dirname "$0")/setup.sh"
stamp "pytest -m gpu, whole suite, pair graphs by default"
gpu_tests ${TESTS_S:-170} tests
stamp done
