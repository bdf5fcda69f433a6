#!/usr/bin/env python3
"""Mutation check: does a test fail when the code it guards is broken?

scripts/dev/mutate.py FILE OLD NEW "TARGETS" "TEST CASE"
  Replaces the one occurrence of OLD in FILE (relative to the repository)
  with NEW, builds TARGETS (the first is the Catch2 binary; add trainrun when
  the case runs the binary), runs the case, prints its failures, and always
  restores FILE and rebuilds. Exit: the test's, 3 when no case matched, 4
  when it hung (MUT_TIMEOUT seconds, default 900). MUT_ULIMIT_KB caps the
  test's address space (for mutations that would allocate without bound).
How docs/benchmarks.md's "Scale traps" table was made."""
import subprocess, sys, pathlib, time
ROOT = str(pathlib.Path(__file__).resolve().parents[2])  # the repository
f, old, new, target, test = sys.argv[1:6]
import os, resource
def _limit():
    kb = os.environ.get("MUT_ULIMIT_KB")
    if kb: resource.setrlimit(resource.RLIMIT_AS, (int(kb) * 1024, int(kb) * 1024))
p = pathlib.Path(ROOT) / f
src = p.read_text()
n = src.count(old)
if n != 1:
    sys.exit(f"mutation text found {n} times in {f}")
p.write_text(src.replace(old, new))
try:
    b = subprocess.run(f"cd {ROOT} && JOBS=2 bash scripts/build.sh {target}", shell=True,
                       capture_output=True, text=True)
    if b.returncode != 0:
        print("BUILD FAILED\n", b.stdout[-3000:], b.stderr[-3000:]); sys.exit(2)
    t0 = time.time()
    try:
      r = subprocess.run(["./" + target.split()[0], test.replace(",", "\\,")], cwd=ROOT + "/build", capture_output=True, text=True, preexec_fn=_limit, timeout=int(__import__("os").environ.get("MUT_TIMEOUT","900")))
    except subprocess.TimeoutExpired:
      print(f'TIMED OUT after {time.time()-t0:.0f}s (the test hangs)'); sys.exit(4)
    out = r.stdout + r.stderr
    if "No test cases matched" in out or "No tests ran" in out: print("NO TEST MATCHED"); sys.exit(3)
    ol = out.splitlines(); lines = []
    for i, l in enumerate(ol):
        if 'FAILED' in l: lines += ol[i:i+7]
        elif 'test cases:' in l or 'assertions:' in l: lines.append(l)
    print(f"rc={r.returncode} ({time.time()-t0:.1f}s)")
    print("\n".join(lines[:30]))
    print("---- tail ----"); print(out[-2500:])
finally:
    p.write_text(src)
    subprocess.run(f"cd {ROOT} && JOBS=2 bash scripts/build.sh {target}", shell=True, capture_output=True)
