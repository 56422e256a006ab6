"""Benchmarks behind ``mlfabric bench ...``: each prints a table, writes JSON and returns its
figures as dataclasses; :mod:`mlfabric.bench.procs` starts the local ranks they run on.

    mlfabric bench allreduce --world-size 4 --sizes 4KB,1MB,64MB --json out.json
"""
