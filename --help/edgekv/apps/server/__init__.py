"""The daemon's HTTP API: an OpenAI-compatible chat route, health, Prometheus metrics and the status page.

``app`` builds the FastAPI app and runs it on uvicorn; ``guard`` checks Host, Origin, the token and the body
before any handler; ``openai_chat`` validates chat requests; ``telemetry`` holds the figures.
"""
