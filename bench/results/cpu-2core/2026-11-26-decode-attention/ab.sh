#!/bin/bash
# Alternates the native decode attention of two checkouts, each in its own process:
#   ab.sh OLD_REPO NEW_REPO DTYPE CTX [ROUNDS]   (FLUSH=1: stream 256 MB between calls)
here=$(dirname "$0")
for i in $(seq "${5:-4}"); do
  for repo in "$1" "$2"; do
    echo -n "$(git -C "$repo" rev-parse --short HEAD) "
    PYTHONPATH="$repo" python "$here/attention_call.py" "$3" "$4" 40
  done
done
