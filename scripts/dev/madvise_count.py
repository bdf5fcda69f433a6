#!/usr/bin/env python3
"""Counts madvise calls inside mmaps of *.safetensors files in an strace -f log
(strace -f -e trace=openat,mmap,madvise,close), per pid."""
import re, sys, collections
fds = {}; maps = collections.defaultdict(list); total = collections.Counter(); inside = collections.Counter()
import fileinput, os
for line in fileinput.input(sys.argv[1:]):
    pid, call = os.path.basename(fileinput.filename()).split('.')[-1], line.strip()
    o = re.match(r'openat\(.*"([^"]+)".*\)\s+=\s+(\d+)', call)
    if o:
        fds[(pid, o.group(2))] = o.group(1); continue
    c = re.match(r'close\((\d+)\)', call)
    if c: fds.pop((pid, c.group(1)), None); continue
    mm = re.match(r'mmap\(\w+, (\d+), [^,]+, [^,]+, (\d+), [^)]+\)\s+=\s+(0x[0-9a-f]+)', call)
    if mm and fds.get((pid, mm.group(2)), '').endswith('.safetensors'):
        a = int(mm.group(3), 16); maps[pid].append((a, a + int(mm.group(1)))); continue
    ma = re.match(r'madvise\((0x[0-9a-f]+), (\d+), (\w+)', call)
    if ma:
        total[pid] += 1
        a = int(ma.group(1), 16)
        if any(lo <= a < hi for lo, hi in maps[pid]): inside[pid] += 1
for pid in sorted(total):
    if inside[pid] or maps[pid]: print(f"pid {pid}: {inside[pid]} madvise calls on safetensors maps ({total[pid]} madvise in all)")
