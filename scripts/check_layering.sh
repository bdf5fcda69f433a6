#!/usr/bin/env bash
# The layering rule (docs: DESIGN.md's target layout, STYLE.md): parallel/
# and kernels/ sit below core/'s launcher, checkpoint and training code and
# name no model architecture, so they never include core/launch,
# core/checkpoint, core/train or a header under core/model/<arch>/ (the
# model interface, core/model/*.h, and core/common are theirs to use).
# Prints every offending include and exits 1; CTest runs it as `layering`.
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
pattern='^[[:space:]]*#[[:space:]]*include[[:space:]]*"core/((launch|checkpoint|train)/|model/[^/"]+/)'
files=$(find parallel kernels -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \) | sort)
[ -n "$files" ] || { echo "layering: no sources under parallel/ or kernels/ in $(pwd)"; exit 1; }
bad=$(grep -nE "$pattern" $files || true)
if [ -n "$bad" ]; then
  echo "layering: parallel/ and kernels/ may include only core/common and the model interface (core/model/*.h);"
  echo "move what these need into core/common (or parallel/ itself):"
  echo "$bad"
  exit 1
fi
echo "layering: ok ($(echo "$files" | wc -l) files under parallel/ and kernels/)"
