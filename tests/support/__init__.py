"""What the tests share. Tests import ``support.x`` (tests/ is on the path, as for conftest);
fixtures live in conftest.py.

- ``processes``: server processes with a readiness handshake and deadlines, RSS, waiting with a deadline
- ``workers``, ``worker_processes``: fakes of unit sources, worker pools
- ``fault_plan``, ``fault_schedule``, ``tcp_proxy``: seeded fault schedules through a TCP proxy
- ``s3``, ``storage``: an S3 server on loopback, remote datasets
- ``raw_client``, ``wire_edits``, ``hostile``, ``admission``: clients that speak the protocol by hand
- ``metrics``: scraping a server's Prometheus endpoint
- ``trainer``, ``onebit``: torchrun launches, process groups for the 1-bit hook
- ``deploy``: the deploy files' command lines, read as a shell would
- ``strays``: the plugin that kills, and fails the run for, processes a test left running
"""
