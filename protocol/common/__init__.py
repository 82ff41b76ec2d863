"""Leaf helpers that every side shares: HOST:PORT parsing and the port range check, CURVE key
files, logging setup, argparse types, atomic directory writes (and a full disk told as such),
which folders are in memory, a process's CPU time and the names threads carry in the operating
system.

They import no other fuelline package beyond ``fuelline.protocol``'s errors, open no sockets and
start no threads, so the client, the trainer and the server may all import them without pulling
in one another.
"""
