"""What leaves the device: alerts raised by standing questions (``alerts``) and the channels they go out on —
webhooks (``webhooks``), MQTT and the fleet (``mqtt``), the API's SSE stream (apps/server/alerts.py). Every
output has its own bounded queue and thread: a slow or dead receiver never blocks ingest."""
