"""What leaves the device besides the HTTP API: one file per channel (``ros2``: questions, answers and status on
ROS 2 topics). The daemon's loop starts and stops them; none blocks ingest."""
