#!/bin/bash
# median wall time of N runs of: mlfabric ARGS >/dev/null
N=$1; shift
for i in $(seq $N); do /usr/bin/time -f %e "$@" >/dev/null 2>>/tmp/t.$$ ; done 2>/dev/null
sort -n /tmp/t.$$ | awk '{a[NR]=$1} END{print "median", a[int((NR+1)/2)], "min", a[1], "max", a[NR], "n", NR}'
rm -f /tmp/t.$$
