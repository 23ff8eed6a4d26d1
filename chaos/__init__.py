"""chaos: break a running elastic_train job the way the world does, and record what was done.

    faults.py         kill an actor, SIGKILL / SIGSTOP+SIGCONT / preempt (SIGTERM, then SIGKILL) a
                      worker process, lose or add a node, kill the supervisor, break storage
    targets.py        which workers: random, a rank, rank 0, several, a node, the node of rank 0
    schedules.py      when: at given times, every T, seeded Poisson, replay of a spot trace
    traces.py         Oobleck / Bamboo spot traces, time-compressed and capped to this machine
    storage_proxy.py  a fault-injecting proxy in front of an S3 endpoint
    harness.py        runs a schedule against a live run
    log.py            every injected fault, as JSON lines

`python -m chaos --help` attaches to a running job from outside it.
"""
