"""The daemon (``edgekv-camera``, ``edgekv serve``): capture thread → sampler → session, questions from every
channel, the fair share between ingest and answers, persistent memory, systemd.

``camera`` is the command line, ``loop`` the main loop, ``scheduling`` the frame backlog and fair share,
``startup`` the checks made before the model loads, ``systemd`` readiness and the watchdog, ``console`` what
it prints, ``quiz`` the toy's graded demo.
"""
