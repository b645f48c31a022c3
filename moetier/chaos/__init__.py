"""`moetier chaos`: the fault matrix and the soak, run against the demo model's cluster.

cluster.py starts the services (moetier up's commands and settings, supervised here), workload.py
sends and checks the requests, faults.py is the matrix, persist.py reads what was persisted,
harness.py runs the cases and reports, soak.py runs traffic and periodic faults for a long time.
docs/reliability.md describes all of it."""
