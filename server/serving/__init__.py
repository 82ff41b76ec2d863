"""Serving: the ROUTER loop and its sessions, admission, the local ipc shortcut, status lines,
Prometheus metrics, CURVE keys, and ``start_server``."""
