"""Weight sync by broadcast (`weightSync.mode: broadcast`): see broadcast.py (protocol, receiver) and sender.py (trainer)."""
