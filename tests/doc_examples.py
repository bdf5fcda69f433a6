#!/usr/bin/env python3
"""Runs the examples of one documentation page, or checks every page's links.

    doc_examples.py --binary build/trainrun --source-dir . PAGE.md
    doc_examples.py --source-dir . --links README.md docs/*.md
    doc_examples.py --source-dir . --count README.md docs/*.md

Each page's fenced blocks, in order, in one scratch directory that mirrors
the checkout (every top-level entry a symlink, `build/` the binary's folder,
the binary's folder first on PATH), so a page reads like a session a user
types from the repository root and later blocks see what earlier ones wrote:

- ```sh / ```bash / ```shell: run with `bash -e -o pipefail -x`; exit 0 or it fails;
- ```console: the `$ ` lines (with `\\` continuations) are run the same way;
  the other lines are sample output and are not compared;
- ```yaml: `trainrun validate --config` on the block (exit 0 or it fails);
- anything else (```text, ```json, no tag) is not run, but a block without a
  tag whose first line looks like a command is an error: tag it.

A marker on the line before the fence (an HTML comment, invisible on GitHub):

    <!-- doctest: gpu (why) -->        needs a GPU: not run here
    <!-- doctest: cluster (why) -->    needs Slurm or several machines: not run
    <!-- doctest: skip (why) -->       not run, for the reason given (required)
    <!-- doctest: file NAME -->        yaml: also written to NAME for later blocks
    <!-- doctest: fragment -->         yaml: a part of a job; validated with
                                       --set data.format=synthetic

and `<!-- doctest-page: gpu (why) -->` on a line of its own marks every block
of the page (docs/gpu-results.md). The convention is described in
docs/architecture.md ("Documentation and its tests").
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([A-Za-z0-9_+-]*)")
MARKER = re.compile(r"^\s*<!--\s*doctest:\s*(\w+)\s*(.*?)\s*-->\s*$")
PAGE_MARKER = re.compile(r"^\s*<!--\s*doctest-page:\s*(\w+)\s*(.*?)\s*-->\s*$")
SHELL = {"sh", "bash", "shell"}
YAML = {"yaml", "yml"}
NOT_RUN = {"gpu", "cluster", "skip"}
LOOKS_LIKE_COMMAND = re.compile(r"^\s*(\$ |trainrun |\./build/trainrun |bash |sbatch |srun )")


class Block:
    def __init__(self, line, lang, text, marker, arg):
        self.line, self.lang, self.text, self.marker, self.arg = line, lang, text, marker, arg


def parse_blocks(path):
    """The fenced blocks of a page: (line of the fence, 1-based), tag, text, marker."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, errors, page_marker = [], [], None
    i = 0
    while i < len(lines):
        pm = PAGE_MARKER.match(lines[i])
        if pm:
            page_marker = (pm.group(1), pm.group(2))
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        marker, arg = None, ""
        if prev >= 0:
            mm = MARKER.match(lines[prev])
            if mm:
                marker, arg = mm.group(1), mm.group(2)
        if page_marker and marker is None:
            marker, arg = page_marker
        b = Block(start + 1, lang, "\n".join(body) + "\n", marker, arg)
        where = "%s:%d" % (path, b.line)
        if marker and marker not in NOT_RUN | {"file", "fragment"}:
            errors.append("%s: unknown doctest marker '%s' (gpu, cluster, skip, file, fragment)" % (where, marker))
        if marker == "skip" and not arg.strip("() "):
            errors.append("%s: '<!-- doctest: skip -->' needs a reason: <!-- doctest: skip (why) -->" % where)
        if marker in ("file", "fragment") and lang not in YAML:
            errors.append("%s: '%s' applies to yaml blocks only" % (where, marker))
        if not lang and marker is None:
            first = next((l for l in body if l.strip()), "")
            if LOOKS_LIKE_COMMAND.match(first):
                errors.append("%s: a block without a tag that starts with a command (%r): tag it ```sh or "
                              "```console to run it, ```text for output, or mark it" % (where, first.strip()))
        blocks.append(b)
    return blocks, errors


def runnable(b):
    return b.marker not in NOT_RUN and (b.lang in SHELL or b.lang in YAML or b.lang == "console")


def console_commands(text):
    """The `$ ` lines of a console block, continuation lines joined."""
    cmds, cur = [], None
    for line in text.split("\n"):
        if cur is not None:
            cur += "\n" + line
            if not line.rstrip().endswith("\\"):
                cmds.append(cur)
                cur = None
        elif line.startswith("$ "):
            cur = line[2:]
            if not cur.rstrip().endswith("\\"):
                cmds.append(cur)
                cur = None
    if cur is not None:
        cmds.append(cur)
    return "\n".join(cmds) + "\n"


def make_workdir(source_dir, binary):
    work = tempfile.mkdtemp(prefix="trainrun-doc-")
    for name in os.listdir(source_dir):
        if name in (".git", "build", "data", "runs"):
            continue
        os.symlink(os.path.join(source_dir, name), os.path.join(work, name))
    os.symlink(os.path.dirname(os.path.abspath(binary)), os.path.join(work, "build"))
    return work


def tail(text, n=60):
    lines = text.rstrip("\n").split("\n")
    return "\n".join(lines[-n:])


def run_page(page, source_dir, binary, timeout):
    blocks, errors = parse_blocks(page)
    work = make_workdir(source_dir, binary)
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(os.path.abspath(binary)) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "2")
    env["TRAINRUN_PROGRESS"] = "plain"
    counts = {"sh": 0, "console": 0, "yaml": 0}
    marked = {}
    t0 = time.time()
    try:
        for k, b in enumerate(blocks):
            where = "%s:%d" % (os.path.relpath(page, source_dir), b.line)
            if b.marker in NOT_RUN:
                marked[b.marker] = marked.get(b.marker, 0) + 1
                continue
            if not runnable(b):
                continue
            if b.lang in YAML:
                name = b.arg if b.marker == "file" else "doc-block-%d.yaml" % k
                if os.path.dirname(name):
                    os.makedirs(os.path.join(work, os.path.dirname(name)), exist_ok=True)
                with open(os.path.join(work, name), "w", encoding="utf-8") as f:
                    f.write(b.text)
                cmd = [binary, "validate", "--config", name]
                if b.marker == "fragment":
                    cmd += ["--set", "data.format=synthetic"]
                kind, shown = "yaml", " ".join(cmd[1:])
            else:
                script = b.text if b.lang in SHELL else console_commands(b.text)
                path = os.path.join(work, ".doc-block-%d.sh" % k)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(script)
                cmd = ["bash", "-e", "-o", "pipefail", "-x", path]  # -x: the output shows which line failed
                kind = "sh" if b.lang in SHELL else "console"
                shown = script
            counts[kind] += 1
            t = time.time()
            try:
                p = subprocess.run(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   timeout=timeout)
                rc, out = p.returncode, p.stdout.decode("utf-8", "replace")
            except subprocess.TimeoutExpired as e:
                rc, out = "timeout after %d s" % timeout, (e.stdout or b"").decode("utf-8", "replace")
            print("%s: %s block: exit %s (%.1f s)" % (where, kind, rc, time.time() - t), flush=True)
            if rc != 0:
                errors.append("%s: the %s block failed (exit %s). The example is stale: fix the page or the "
                              "code, or mark it (see tests/doc_examples.py).\n--- block:\n%s--- output (tail):\n%s"
                              % (where, kind, rc, shown if kind != "yaml" else b.text, tail(out)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    run = sum(counts.values())
    print("%s: %d examples run (%s), %d marked not to run (%s), %.1f s" % (
        os.path.relpath(page, source_dir), run, ", ".join("%d %s" % (v, k) for k, v in counts.items() if v),
        sum(marked.values()), ", ".join("%d %s" % (v, k) for k, v in marked.items()) or "-", time.time() - t0))
    return errors


# ---- links -------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def strip_code(lines):
    """Lines outside fenced blocks, inline code removed; (line number, text)."""
    out, fence = [], None
    for n, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if fence:
            if line.strip().startswith(fence):
                fence = None
            continue
        if m:
            fence = m.group(2)
            continue
        out.append((n, re.sub(r"`[^`]*`", "", line)))
    return out


def anchors(path):
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    seen, result = {}, set()
    fence = None
    for line in lines:
        m = FENCE.match(line)
        if fence:
            if line.strip().startswith(fence):
                fence = None
            continue
        if m:
            fence = m.group(2)
            continue
        h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not h:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h.group(1))
        slug = re.sub(r"[^\w\- ]", "", text.lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        result.add(slug if n == 0 else "%s-%d" % (slug, n))
    return result


def check_links(pages, source_dir):
    errors, checked = [], 0
    cache = {}
    for page in pages:
        with open(page, encoding="utf-8") as f:
            lines = f.read().split("\n")
        for n, line in strip_code(lines):
            for m in list(LINK.finditer(line)) + list(IMAGE.finditer(line)):
                target = m.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                checked += 1
                path, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
                where = "%s:%d" % (os.path.relpath(page, source_dir), n)
                if not os.path.exists(dest):
                    errors.append("%s: link '%s': %s does not exist" % (where, target,
                                                                       os.path.relpath(dest, source_dir)))
                    continue
                if anchor and dest.endswith(".md"):
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if anchor not in cache[dest]:
                        errors.append("%s: link '%s': %s has no heading with anchor '#%s'" % (
                            where, target, os.path.relpath(dest, source_dir), anchor))
    print("%d relative links checked in %d pages" % (checked, len(pages)))
    return errors


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", help="the trainrun binary the examples run")
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--links", action="store_true", help="check the relative links of the pages instead")
    ap.add_argument("--count", action="store_true", help="print each page's size and examples, run nothing")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per block")
    ap.add_argument("pages", nargs="+")
    a = ap.parse_args()
    source_dir = os.path.abspath(a.source_dir)
    pages = [p if os.path.isabs(p) else os.path.join(source_dir, p) for p in a.pages]
    errors = []
    if a.links:
        errors = check_links(pages, source_dir)
    elif a.count:
        for p in pages:
            blocks, errs = parse_blocks(p)
            errors += errs
            run = [b for b in blocks if runnable(b)]
            marked = [b for b in blocks if b.marker in NOT_RUN]
            print("%-28s %7d bytes  %2d examples under test  %2d marked (%s)" % (
                os.path.relpath(p, source_dir), os.path.getsize(p), len(run), len(marked),
                ", ".join(sorted(set(b.marker for b in marked))) or "-"))
    else:
        if not a.binary:
            ap.error("--binary is required to run examples")
        binary = os.path.abspath(a.binary)
        for p in pages:
            errors += run_page(p, source_dir, binary, a.timeout)
    for e in errors:
        print("FAIL " + e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
