"""What leaves the device besides the HTTP API, one file per channel: alerts raised by standing questions
(``alerts``) and the channels they go out on — webhooks (``webhooks``), MQTT and the fleet (``mqtt``), the API's SSE
stream (apps/server/alerts.py) — escalation to a bigger model (``escalate``), and ROS 2 topics (``ros2``:
questions, answers and status). Every output has its own bounded queue and thread: a slow or dead receiver never
blocks ingest."""
