"""Worker processes that decode and align off the serving process: the pool, its supervision, the
child's loop and the hand-off of finished blocks through shared files."""
