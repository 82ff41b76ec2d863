"""What the tests share: server processes with a readiness handshake and deadlines, fakes of
unit sources, fault injection (a TCP proxy, seeded schedules), an S3 server on loopback, a raw
protocol client, metrics scraping and torchrun launches. Tests import ``support.x`` (tests/ is
on the path, as for conftest); fixtures live in conftest.py."""
