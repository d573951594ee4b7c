#!/usr/bin/env bash
# Print the path of a Python >= 3.12 that actually runs, or explain and fail.
# pyenv shims can exist on PATH yet fail ("command not found in this version"), so each
# candidate is run, not just looked up.
set -uo pipefail

check='import sys; assert sys.version_info >= (3, 12)'
candidates=(python3.13 python3.12 python3)
for py in "$HOME"/.pyenv/versions/3.1[23]*/bin/python3.1[23]; do
    candidates+=("$py")
done

for py in "${candidates[@]}"; do
    path=$(command -v "$py" 2>/dev/null) || continue
    if "$path" -c "$check" >/dev/null 2>&1; then
        echo "$path"
        exit 0
    fi
done
echo "No working Python 3.12+ found: install Python 3.12 or newer (e.g. 'pyenv install 3.12') and run make again." >&2
exit 1
